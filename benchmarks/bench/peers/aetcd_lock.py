"""aetcd's ``Lock`` (asyncio): the same grant + txn, txn as python3-etcd3's."""

from __future__ import annotations

from typing import Any

from ..config import TTL_MS
from . import AsyncPeer, CorrectnessError, Skipped

NAME = "aetcd Lock"


class AetcdLock(AsyncPeer):
    name = NAME
    does = "LeaseGrant + Txn to acquire, Txn to release; the lease is left to expire"

    def __init__(self, endpoint: str, prefix: str) -> None:
        self._endpoint = endpoint.split(",")[0].rpartition("://")[2]
        self._prefix = prefix
        self._client: Any = None

    async def open(self) -> None:
        try:
            import aetcd
        except ImportError as exc:
            raise Skipped(f"aetcd is not installed ({exc})") from None
        host, _, port = self._endpoint.rpartition(":")
        self._client = aetcd.Client(host=host, port=int(port))
        await self._client.connect()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def cycle(self, key: str) -> None:
        lock = self._client.lock((self._prefix + key).encode(), ttl=TTL_MS // 1000)
        if not await lock.acquire(timeout=10):
            raise CorrectnessError(f"{NAME}: could not take the free lock {key!r} in 10 s")
        await lock.release()
