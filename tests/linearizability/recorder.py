"""A provider that records every call it passes on to another, into a :class:`History`.

:class:`RecordingProvider` records the five calls; :class:`RecordingHoldingProvider`
also the acquire that ``hold`` and the election make through ``acquire_kept``, so the
recipes' calls land in the same history. :func:`claim` records a holder's belief that
it holds its key (``lease.check()`` passing) as what it is: a read of the key.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable

from etcd_leases import AcquireResult, HeldLease, HoldingProvider, LeaseLost, LeaseProvider
from etcd_leases.contract import Keeper, OwnerState
from tests.linearizability.history import Answer, Call, History, get_owner


def send(provider: LeaseProvider, key: str, call: Call) -> Awaitable[Answer]:
    """Make ``call`` on ``key`` through ``provider``."""
    if call.name == "acquire":
        return provider.acquire_lease(key, call.owner, call.ttl_ms)
    if call.name == "get_owner":
        return provider.get_lease_owner(key)
    if call.name == "release":
        return provider.release_lease(key, call.owner)
    if call.name == "renew":
        return provider.renew_lease(key, call.owner, call.ttl_ms)
    return provider.transfer_lease(key, call.owner, call.to_owner, call.ttl_ms)


class RecordingProvider:
    """Passes the five calls on to ``inner`` and records each in ``history`` as ``client``.

    A call that raises, for whatever reason (cancellation included), is recorded
    without an answer: the checker then lets it have taken effect, or not.
    """

    def __init__(self, inner: LeaseProvider, history: History, client: str) -> None:
        self.inner = inner
        self.history = history
        self.client = client

    async def _record(self, key: str, call: Call) -> Answer:
        return await self._recorded(key, call, send(self.inner, key, call))

    async def _recorded(self, key: str, call: Call, made: Awaitable[Answer]) -> Answer:
        start = self.history.clock()
        try:
            answer = await made
        except BaseException:
            self.history.add(key, call, start, None, client=self.client)
            raise
        self.history.add(key, call, start, self.history.clock(), answer, self.client)
        return answer

    async def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> AcquireResult:
        answer = await self._record(key, Call("acquire", owner, ttl_ms))
        assert isinstance(answer, AcquireResult)
        return answer

    async def get_lease_owner(self, key: str) -> str | None:
        answer = await self._record(key, Call("get_owner"))
        assert answer is None or isinstance(answer, str)
        return answer

    async def release_lease(self, key: str, owner: str) -> None:
        await self._record(key, Call("release", owner))

    async def renew_lease(self, key: str, owner: str, ttl_ms: int) -> bool:
        return bool(await self._record(key, Call("renew", owner, ttl_ms)))

    async def transfer_lease(self, key: str, from_owner: str, to_owner: str, ttl_ms: int) -> bool:
        return bool(await self._record(key, Call("transfer", from_owner, ttl_ms, to_owner)))


class RecordingHoldingProvider(RecordingProvider):
    """A :class:`RecordingProvider` that ``hold``, ``adopt`` and :class:`Election` accept.

    ``acquire_kept`` is recorded as the acquire it is; the rest (the key's watch, the
    keeper's renewals, fenced writes) are not contract calls and pass through.
    """

    def __init__(self, inner: HoldingProvider, history: History, client: str) -> None:
        super().__init__(inner, history, client)
        self.holding = inner

    async def acquire_kept(
        self, key: str, owner: str, ttl_ms: int
    ) -> tuple[AcquireResult, Keeper | None]:
        kept: list[Keeper | None] = []

        async def acquiring() -> AcquireResult:
            result, keeper = await self.holding.acquire_kept(key, owner, ttl_ms)
            kept.append(keeper)
            return result

        result = await self._recorded(key, Call("acquire", owner, ttl_ms), acquiring())
        assert isinstance(result, AcquireResult)
        return result, kept[0]

    def watch_owner(self, key: str) -> AsyncGenerator[OwnerState, None]:
        return self.holding.watch_owner(key)

    async def keep_lease(
        self, key: str, owner: str, token: int, ttl_ms: int, valid_until: float
    ) -> Keeper:
        return await self.holding.keep_lease(key, owner, token, ttl_ms, valid_until)

    async def put_fenced(
        self, key: str, owner: str, token: int, data_key: str, value: bytes
    ) -> bool:
        return await self.holding.put_fenced(key, owner, token, data_key, value)

    async def delete_fenced(self, key: str, owner: str, token: int, data_key: str) -> bool:
        return await self.holding.delete_fenced(key, owner, token, data_key)

    async def get_value(self, data_key: str) -> bytes | None:
        return await self.holding.get_value(data_key)


def claim(history: History, client: str, lease: HeldLease) -> bool:
    """Whether ``lease.check()`` passes; if it does, recorded as a read of the key that
    answered its holder: the holder acts on it as on such an answer, so the checker
    must find the key held by it at that moment."""
    start = history.clock()
    try:
        lease.check()
    except LeaseLost:
        return False
    history.add(lease.key, get_owner(), start, history.clock(), lease.owner, f"{client}:check")
    return True
