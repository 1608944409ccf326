"""etcd-client-py (Rust's etcd-client through PyO3): its ``with_lock`` API."""

from __future__ import annotations

from typing import Any

from ..config import TTL_MS
from . import AsyncPeer, Skipped

NAME = "etcd-client-py with_lock"


class EtcdClientLock(AsyncPeer):
    name = NAME
    does = (
        "with_lock(EtcdLockOption(ttl)): connects, LeaseGrant, etcd's Lock RPC;"
        " on exit Unlock, LeaseRevoke (inside the Rust client)"
    )

    def __init__(self, endpoint: str, prefix: str) -> None:
        first = endpoint.split(",")[0]
        self._url = first if "://" in first else f"http://{first}"
        self._prefix = prefix
        self._client: Any = None
        self._option: Any = None

    async def open(self) -> None:
        try:
            import etcd_client
        except ImportError as exc:
            raise Skipped(f"etcd-client-py is not installed ({exc})") from None
        self._client = etcd_client.Client([self._url])
        self._option = etcd_client.EtcdLockOption

    async def cycle(self, key: str) -> None:
        # Its lock API gives no result to check: the block is entered once locked.
        option = self._option(lock_name=(self._prefix + key).encode(), ttl=TTL_MS // 1000)
        async with self._client.with_lock(option):
            pass
