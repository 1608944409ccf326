"""etcd-leases: one owner per key across processes, on etcd."""

import importlib.metadata
import logging

try:
    #: The installed distribution's version (package metadata).
    __version__ = importlib.metadata.version("etcd-leases")
except importlib.metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

from etcd_leases.contract import (
    AcquireResult,
    HoldingProvider,
    Keeper,
    LeaseProvider,
    OwnerState,
    is_lease_provider,
)
from etcd_leases.election import Election
from etcd_leases.errors import (
    BackendError,
    BackendFull,
    BackendUnavailable,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    LeaseTypeError,
    LeaseValueError,
    PermissionDenied,
    ProviderClosed,
)
from etcd_leases.hold import HeldLease, adopt, hold
from etcd_leases.noop import NoopLeaseProvider, lease_provider_for
from etcd_leases.providers import EtcdLeaseProvider, InMemoryLeaseProvider

# Quiet unless the application configures logging (loggers under "etcd_leases").
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "AcquireResult",
    "BackendError",
    "BackendFull",
    "BackendUnavailable",
    "Election",
    "EtcdLeaseProvider",
    "HeldLease",
    "HoldingProvider",
    "InMemoryLeaseProvider",
    "Keeper",
    "LeaseError",
    "LeaseHeld",
    "LeaseLost",
    "LeaseProvider",
    "LeaseTypeError",
    "LeaseValueError",
    "NoopLeaseProvider",
    "OwnerState",
    "PermissionDenied",
    "ProviderClosed",
    "adopt",
    "hold",
    "is_lease_provider",
    "lease_provider_for",
]
