"""The reference model of the contract: one process, a monotonic clock, ms TTLs.

Every backend must behave like this one on every row of the contract; the
conformance suite runs the same tests against it and against etcd. It implements
the recipes' capabilities too (watching, keeping, fenced writes), so hold and
election are tested on it as well.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from etcd_leases.contract import (
    AcquireResult,
    OwnerState,
    check_key,
    check_lease_call,
    check_transfer_call,
)
from etcd_leases.errors import LeaseError, LeaseLost, ProviderClosed


@dataclass
class _Tenure:
    owner: str
    token: int
    ttl_ms: int
    expires_at: float
    expiry: asyncio.TimerHandle | None = None


class MemoryBackend:
    """Leases in a dict. ``clock`` (seconds, monotonic) can be swapped in tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tenures: dict[str, _Tenure] = {}
        # Like etcd's revision: one counter for every key, so tokens only grow.
        self._tokens = itertools.count(1)
        self._watchers: dict[str, set[asyncio.Queue[OwnerState | None]]] = {}
        self._keepers: dict[str, set[_MemoryKeeper]] = {}
        self._data: dict[str, bytes] = {}
        self._closed = False

    # Bookkeeping: every change of tenure goes through _set, which tells watchers.

    def _check_open(self) -> None:
        if self._closed:
            raise ProviderClosed("the provider is closed")

    def _holder(self, key: str) -> _Tenure | None:
        tenure = self._tenures.get(key)
        if tenure is not None and tenure.expires_at <= self._clock():
            self._set(key, None, "expired")
            return None
        return tenure

    def _set(self, key: str, tenure: _Tenure | None, reason: str) -> None:
        old = self._tenures.pop(key, None)
        if old is not None and old.expiry is not None:
            old.expiry.cancel()
        if tenure is not None:
            self._tenures[key] = tenure
            self._schedule_expiry(key, tenure)
        state = OwnerState(None, None) if tenure is None else OwnerState(tenure.owner, tenure.token)
        for queue in self._watchers.get(key, ()):
            queue.put_nowait(state)
        for keeper in list(self._keepers.get(key, ())):
            if keeper.token != state.token:
                keeper.lose(reason)

    def _schedule_expiry(self, key: str, tenure: _Tenure) -> None:
        # Expiry is also checked lazily on every access; the timer makes it visible
        # to watchers and keepers without anyone asking.
        if tenure.expiry is not None:
            tenure.expiry.cancel()
        delay = max(0.0, tenure.expires_at - self._clock())
        tenure.expiry = asyncio.get_running_loop().call_later(delay, self._expire_when_due, key)

    def _expire_when_due(self, key: str) -> None:
        tenure = self._holder(key)
        if tenure is not None:  # the timer fired a hair early: look again later
            self._schedule_expiry(key, tenure)

    def _start_tenure(self, key: str, owner: str, ttl_ms: int, reason: str) -> _Tenure:
        tenure = _Tenure(owner, next(self._tokens), ttl_ms, self._clock() + ttl_ms / 1000)
        self._set(key, tenure, reason)
        return tenure

    def _reset_ttl(self, key: str, tenure: _Tenure, ttl_ms: int) -> None:
        tenure.ttl_ms = ttl_ms
        tenure.expires_at = self._clock() + ttl_ms / 1000
        self._schedule_expiry(key, tenure)

    # The contract.

    async def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> AcquireResult:
        check_lease_call(key, owner, ttl_ms)
        self._check_open()
        tenure = self._holder(key)
        if tenure is None:
            tenure = self._start_tenure(key, owner, ttl_ms, f"taken over by {owner!r}")
        elif tenure.owner == owner:
            self._reset_ttl(key, tenure, ttl_ms)
        else:
            return AcquireResult(acquired=False, owner=tenure.owner)
        return AcquireResult(acquired=True, owner=owner, token=tenure.token, ttl_ms=ttl_ms)

    async def get_lease_owner(self, key: str) -> str | None:
        check_key(key)
        self._check_open()
        tenure = self._holder(key)
        return None if tenure is None else tenure.owner

    async def release_lease(self, key: str, owner: str) -> None:
        check_lease_call(key, owner)
        self._check_open()
        tenure = self._holder(key)
        if tenure is not None and tenure.owner == owner:
            self._set(key, None, "released")

    async def renew_lease(self, key: str, owner: str, ttl_ms: int) -> bool:
        check_lease_call(key, owner, ttl_ms)
        self._check_open()
        tenure = self._holder(key)
        if tenure is None or tenure.owner != owner:
            return False
        self._reset_ttl(key, tenure, ttl_ms)
        return True

    async def transfer_lease(self, key: str, from_owner: str, to_owner: str, ttl_ms: int) -> bool:
        check_transfer_call(key, from_owner, to_owner, ttl_ms)
        self._check_open()
        tenure = self._holder(key)
        if tenure is None or tenure.owner != from_owner:
            return False
        self._start_tenure(key, to_owner, ttl_ms, f"transferred to {to_owner!r}")
        return True

    # The recipes' capabilities.

    async def watch_owner(self, key: str) -> AsyncGenerator[OwnerState, None]:
        check_key(key)
        self._check_open()
        queue: asyncio.Queue[OwnerState | None] = asyncio.Queue()
        self._watchers.setdefault(key, set()).add(queue)
        try:
            tenure = self._holder(key)
            yield (
                OwnerState(None, None) if tenure is None else OwnerState(tenure.owner, tenure.token)
            )
            while (state := await queue.get()) is not None:
                yield state
            raise ProviderClosed("the provider was closed")
        finally:
            self._watchers[key].discard(queue)

    async def acquire_kept(
        self, key: str, owner: str, ttl_ms: int
    ) -> tuple[AcquireResult, _MemoryKeeper | None]:
        sent_at = time.monotonic()  # the keeper counts on this clock
        result = await self.acquire_lease(key, owner, ttl_ms)
        if not result.acquired:
            return result, None
        assert result.token is not None and result.ttl_ms is not None
        valid_until = sent_at + result.ttl_ms / 1000
        return result, await self.keep_lease(key, owner, result.token, ttl_ms, valid_until)

    async def keep_lease(
        self, key: str, owner: str, token: int, ttl_ms: int, valid_until: float
    ) -> _MemoryKeeper:
        check_lease_call(key, owner, ttl_ms)
        self._check_open()
        if not self._holds(key, owner, token):
            raise LeaseLost(f"{owner!r} no longer holds {key!r} with token {token}")
        keeper = _MemoryKeeper(self, key, owner, token, ttl_ms, valid_until)
        self._keepers.setdefault(key, set()).add(keeper)
        return keeper

    def _holds(self, key: str, owner: str, token: int) -> bool:
        tenure = self._holder(key)
        return tenure is not None and tenure.owner == owner and tenure.token == token

    def _forget_keeper(self, keeper: _MemoryKeeper) -> None:
        self._keepers.get(keeper.key, set()).discard(keeper)

    async def put_fenced(
        self, key: str, owner: str, token: int, data_key: str, value: bytes
    ) -> bool:
        check_key(data_key, "data_key")
        self._check_open()
        if not self._holds(key, owner, token):
            return False
        self._data[data_key] = bytes(value)
        return True

    async def delete_fenced(self, key: str, owner: str, token: int, data_key: str) -> bool:
        check_key(data_key, "data_key")
        self._check_open()
        if not self._holds(key, owner, token):
            return False
        self._data.pop(data_key, None)
        return True

    async def get_value(self, data_key: str) -> bytes | None:
        check_key(data_key, "data_key")
        self._check_open()
        return self._data.get(data_key)

    async def close(self) -> None:
        """Stop every watcher (they raise ProviderClosed) and keeper (lost); idempotent."""
        self._closed = True
        for queues in self._watchers.values():
            for queue in queues:
                queue.put_nowait(None)
        for keepers in self._keepers.values():
            for keeper in list(keepers):
                keeper.lose("provider closed")


class _MemoryKeeper:
    """Renews one tenure at a third of its TTL; the provider tells it of any change."""

    def __init__(
        self,
        provider: MemoryBackend,
        key: str,
        owner: str,
        token: int,
        ttl_ms: int,
        valid_until: float,
    ) -> None:
        self.key, self.owner, self.token, self.ttl_ms = key, owner, token, ttl_ms
        self.lost = asyncio.Event()
        self.lost_reason: str | None = None
        self._provider = provider
        self._valid_until = valid_until
        self._task = asyncio.get_running_loop().create_task(self._renew_forever())

    def remaining(self) -> float:
        if self.lost.is_set():
            return 0.0
        return max(0.0, self._valid_until - time.monotonic())

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            sent_at = time.monotonic()
            try:
                renewed = await self._provider.renew_lease(self.key, self.owner, self.ttl_ms)
            except LeaseError as exc:
                self.lose(str(exc))
                return
            if not renewed:
                self.lose("expired")
                return
            self._valid_until = sent_at + self.ttl_ms / 1000

    def lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()
        self._provider._forget_keeper(self)
        if self._task is not asyncio.current_task():
            self._task.cancel()
