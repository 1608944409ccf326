"""Every error etcd-leases raises is a :class:`LeaseError`.

Bad arguments are also the built-in ``TypeError`` / ``ValueError`` so callers that
already catch those keep working; backend failures never surface as raw gRPC errors.
"""

from __future__ import annotations


class LeaseError(Exception):
    """Root of every error this library raises."""


class LeaseTypeError(LeaseError, TypeError):
    """An argument has the wrong type; nothing was sent to the backend."""


class LeaseValueError(LeaseError, ValueError):
    """An argument has a bad value; nothing was sent to the backend."""


class BackendUnavailable(LeaseError):
    """No endpoint answered in time, or none has a leader."""


class PermissionDenied(LeaseError):
    """The backend refused the credentials or the operation."""


class ProviderClosed(LeaseError):
    """The provider was closed; it cannot be used any more."""


class BackendError(LeaseError):
    """The backend answered with an error this library does not expect."""


class BackendFull(BackendError):
    """etcd's database reached its quota (alarm NOSPACE): it refuses writes (acquire,
    transfer, fenced put; on etcd 3.5.1 now and then a release too) but still renews
    leases, until an operator compacts, defragments and disarms the alarm."""


class LeaseLost(LeaseError):
    """The tenure is over (expired, released, transferred or taken) or cannot be vouched for."""


class LeaseHeld(LeaseError):
    """The key is held by someone else; ``holder`` says who."""

    def __init__(self, key: str, holder: str | None) -> None:
        super().__init__(f"{key!r} is held by {holder!r}")
        self.key = key
        self.holder = holder
