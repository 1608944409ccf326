"""etcd-leases: one owner per key across processes, on etcd."""

from etcd_leases.contract import AcquireResult, LeaseProvider, is_lease_provider
from etcd_leases.errors import (
    BackendError,
    BackendUnavailable,
    LeaseError,
    LeaseTypeError,
    LeaseValueError,
    PermissionDenied,
    ProviderClosed,
)
from etcd_leases.etcd.provider import EtcdLeaseProvider
from etcd_leases.memory import InMemoryLeaseProvider
from etcd_leases.noop import NoopLeaseProvider, lease_provider_for

__all__ = [
    "AcquireResult",
    "BackendError",
    "BackendUnavailable",
    "EtcdLeaseProvider",
    "InMemoryLeaseProvider",
    "LeaseError",
    "LeaseProvider",
    "LeaseTypeError",
    "LeaseValueError",
    "NoopLeaseProvider",
    "PermissionDenied",
    "ProviderClosed",
    "is_lease_provider",
    "lease_provider_for",
]
