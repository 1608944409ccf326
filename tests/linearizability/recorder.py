"""A provider that records every call it passes on to another, into a :class:`History`."""

from __future__ import annotations

from collections.abc import Awaitable

from etcd_leases import AcquireResult, LeaseProvider
from tests.linearizability.history import Answer, Call, History


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
        start = self.history.clock()
        try:
            answer = await send(self.inner, key, call)
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
