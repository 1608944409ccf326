"""The reference model of the contract: one process, a monotonic clock, ms TTLs.

Every backend must behave like this one on every row of the contract; the
conformance suite runs the same tests against it and against etcd.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from etcd_leases.contract import AcquireResult, check_key, check_owner, check_ttl_ms


@dataclass
class _Tenure:
    owner: str
    token: int
    ttl_ms: int
    expires_at: float


class InMemoryLeaseProvider:
    """Leases in a dict. ``clock`` (seconds, monotonic) can be swapped in tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tenures: dict[str, _Tenure] = {}
        # Like etcd's revision: one counter for every key, so tokens only grow.
        self._tokens = itertools.count(1)

    def _holder(self, key: str) -> _Tenure | None:
        tenure = self._tenures.get(key)
        if tenure is not None and tenure.expires_at <= self._clock():
            del self._tenures[key]
            return None
        return tenure

    def _start_tenure(self, key: str, owner: str, ttl_ms: int) -> _Tenure:
        tenure = _Tenure(owner, next(self._tokens), ttl_ms, self._clock() + ttl_ms / 1000)
        self._tenures[key] = tenure
        return tenure

    async def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> AcquireResult:
        check_key(key)
        check_owner(owner)
        check_ttl_ms(ttl_ms)
        tenure = self._holder(key)
        if tenure is None:
            tenure = self._start_tenure(key, owner, ttl_ms)
        elif tenure.owner == owner:
            tenure.ttl_ms = ttl_ms
            tenure.expires_at = self._clock() + ttl_ms / 1000
        else:
            return AcquireResult(acquired=False, owner=tenure.owner)
        return AcquireResult(acquired=True, owner=owner, token=tenure.token, ttl_ms=ttl_ms)

    async def get_lease_owner(self, key: str) -> str | None:
        check_key(key)
        tenure = self._holder(key)
        return None if tenure is None else tenure.owner

    async def release_lease(self, key: str, owner: str) -> None:
        check_key(key)
        check_owner(owner)
        tenure = self._holder(key)
        if tenure is not None and tenure.owner == owner:
            del self._tenures[key]

    async def renew_lease(self, key: str, owner: str, ttl_ms: int) -> bool:
        check_key(key)
        check_owner(owner)
        check_ttl_ms(ttl_ms)
        tenure = self._holder(key)
        if tenure is None or tenure.owner != owner:
            return False
        tenure.ttl_ms = ttl_ms
        tenure.expires_at = self._clock() + ttl_ms / 1000
        return True

    async def transfer_lease(self, key: str, from_owner: str, to_owner: str, ttl_ms: int) -> bool:
        check_key(key)
        check_owner(from_owner, "from_owner")
        check_owner(to_owner, "to_owner")
        check_ttl_ms(ttl_ms)
        tenure = self._holder(key)
        if tenure is None or tenure.owner != from_owner:
            return False
        self._start_tenure(key, to_owner, ttl_ms)
        return True
