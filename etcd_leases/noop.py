"""The provider used when no real backend is configured, and how one is picked."""

from __future__ import annotations

from etcd_leases.contract import (
    AcquireResult,
    LeaseProvider,
    check_key,
    check_lease_call,
    check_transfer_call,
    is_lease_provider,
)


class NoopLeaseProvider:
    """Everyone owns everything: the single-process behaviour, with no coordination."""

    async def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> AcquireResult:
        check_lease_call(key, owner, ttl_ms)
        return AcquireResult(acquired=True, owner=owner, ttl_ms=ttl_ms)

    async def get_lease_owner(self, key: str) -> str | None:
        check_key(key)
        return None

    async def release_lease(self, key: str, owner: str) -> None:
        check_lease_call(key, owner)

    async def renew_lease(self, key: str, owner: str, ttl_ms: int) -> bool:
        check_lease_call(key, owner, ttl_ms)
        return True

    async def transfer_lease(self, key: str, from_owner: str, to_owner: str, ttl_ms: int) -> bool:
        check_transfer_call(key, from_owner, to_owner, ttl_ms)
        return True


def lease_provider_for(backend: object) -> LeaseProvider:
    """The lease provider a storage backend offers, else the backend itself, else a no-op.

    A backend offers one through ``get_lease_provider()``; when that returns ``None``
    the no-op provider keeps single-process behaviour.
    """
    get_lease_provider = getattr(backend, "get_lease_provider", None)
    if callable(get_lease_provider):
        provider = get_lease_provider()
        return provider if is_lease_provider(provider) else NoopLeaseProvider()
    if is_lease_provider(backend):
        return backend
    return NoopLeaseProvider()
