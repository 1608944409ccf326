"""etcd-leases: one owner per key across processes, on etcd.

Every name below is imported on first use (PEP 562), so a short-lived process that
takes one key loads the etcd backend and nothing else: not the inbox, the threads,
the in-memory backend or the recipes it does not touch.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from etcd_leases.etcd.native import NativeElection, NativeLock
    from etcd_leases.hold import HeldLease, adopt, hold
    from etcd_leases.memory_provider import InMemoryLeaseProvider
    from etcd_leases.noop import NoopLeaseProvider, lease_provider_for
    from etcd_leases.providers import EtcdLeaseProvider

    #: The installed distribution's version (package metadata).
    __version__: str

# Where each public name lives; the module is imported when the name is first read.
_HOMES = {
    "AcquireResult": "contract",
    "HoldingProvider": "contract",
    "Keeper": "contract",
    "LeaseProvider": "contract",
    "OwnerState": "contract",
    "is_lease_provider": "contract",
    "Election": "election",
    "NativeElection": "etcd.native",
    "NativeLock": "etcd.native",
    "BackendError": "errors",
    "BackendFull": "errors",
    "BackendUnavailable": "errors",
    "LeaseError": "errors",
    "LeaseHeld": "errors",
    "LeaseLost": "errors",
    "LeaseTypeError": "errors",
    "LeaseValueError": "errors",
    "PermissionDenied": "errors",
    "ProviderClosed": "errors",
    "HeldLease": "hold",
    "adopt": "hold",
    "hold": "hold",
    "InMemoryLeaseProvider": "memory_provider",
    "NoopLeaseProvider": "noop",
    "lease_provider_for": "noop",
    "EtcdLeaseProvider": "providers",
}

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
    "NativeElection",
    "NativeLock",
    "NoopLeaseProvider",
    "OwnerState",
    "PermissionDenied",
    "ProviderClosed",
    "adopt",
    "hold",
    "is_lease_provider",
    "lease_provider_for",
]


class _Package(types.ModuleType):
    """This package, whose ``hold`` stays the function once the module of that name loads."""

    def __setattr__(self, name: str, value: object) -> None:
        # Importing the submodule etcd_leases.hold sets the package's "hold" to it;
        # ``from etcd_leases import hold`` must give the function, as it always has.
        if name == "hold" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if not TYPE_CHECKING:  # type checkers see the imports above, and no other name

    def __getattr__(name: str) -> Any:
        if name == "__version__":  # read on first use: importlib.metadata is slow to import
            from importlib import metadata

            try:
                version = metadata.version("etcd-leases")
            except metadata.PackageNotFoundError:  # a checkout never installed
                version = "0+unknown"
            globals()[name] = version
            return version
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
        globals()[name] = value  # later reads skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})


# Quiet unless the application configures logging (loggers under "etcd_leases").
logging.getLogger(__name__).addHandler(logging.NullHandler())
