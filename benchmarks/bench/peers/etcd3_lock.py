"""python3-etcd3's ``Lock``, blocking, driven from threads."""

from __future__ import annotations

from typing import Any

from ..config import TTL_MS
from . import CorrectnessError, Skipped, ThreadPeer

NAME = "python3-etcd3 Lock"


class Etcd3Lock(ThreadPeer):
    name = NAME
    does = "LeaseGrant + Txn to acquire, Txn to release; the lease is left to expire"

    def __init__(self, endpoint: str, prefix: str) -> None:
        self._endpoint = endpoint.split(",")[0].rpartition("://")[2]
        self._prefix = prefix
        self._client: Any = None

    async def open(self) -> None:
        try:
            import etcd3
        except ImportError as exc:
            raise Skipped(f"python3-etcd3 is not installed ({exc})") from None
        host, _, port = self._endpoint.rpartition(":")
        self._client = etcd3.client(host=host, port=int(port))

    async def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def cycle(self, key: str) -> None:
        lock = self._client.lock(self._prefix + key, ttl=TTL_MS // 1000)
        if not lock.acquire(timeout=10):
            raise CorrectnessError(f"{NAME}: could not take the free lock {key!r} in 10 s")
        lock.release()
