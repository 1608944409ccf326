"""etcd-client-py (Rust's etcd-client through PyO3): its ``with_lock`` API."""

from __future__ import annotations

from typing import Any

from ..config import TTL_MS
from . import AsyncPeer, Skipped

NAME = "etcd-client-py with_lock"


class EtcdClientLock(AsyncPeer):
    name = NAME
    does = (
        "with_lock(EtcdLockOption(ttl)): a new connection, LeaseGrant, a keep-alive stream,"
        " etcd's Lock RPC; on exit another connection, LeaseRevoke (inside the Rust client)"
    )

    def __init__(self, endpoint: str, prefix: str) -> None:
        first = endpoint.split(",")[0]
        self._url = first if "://" in first else f"http://{first}"
        self._prefix = prefix
        self._client: Any = None
        self._option: Any = None
        self._session: Any = None

    async def open(self) -> None:
        try:
            import etcd_client
        except ImportError as exc:
            raise Skipped(f"etcd-client-py is not installed ({exc})") from None
        self._client = etcd_client.Client([self._url])
        self._option = etcd_client.EtcdLockOption
        # A connection held open for the peer's life, as an application would: the
        # library shuts its tokio runtime down whenever its last open context exits,
        # which per cycle costs a runtime restart, and at times hung for good.
        self._session = self._client.connect()
        await self._session.__aenter__()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.__aexit__(None, None, None)

    async def cycle(self, key: str) -> None:
        # Its lock API gives no result to check: the block is entered once locked.
        option = self._option(lock_name=(self._prefix + key).encode(), ttl=TTL_MS // 1000)
        async with self._client.with_lock(option):
            pass
