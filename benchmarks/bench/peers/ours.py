"""Ours: ``acquire_lease`` then ``release_lease`` through one ``EtcdLeaseProvider``."""

from __future__ import annotations

from etcd_leases import EtcdLeaseProvider

from ..config import TTL_MS
from . import AsyncPeer, CorrectnessError

NAME = "etcd_leases"


class OurProvider(AsyncPeer):
    name = NAME
    does = (
        "acquire_lease (reports the holder and a fencing token) + release_lease"
        " (frees the lease); whatever etcd calls the backend makes"
    )

    def __init__(self, endpoint: str, prefix: str) -> None:
        self.provider = EtcdLeaseProvider(endpoint, prefix=prefix)

    async def open(self) -> None:
        await self.provider.get_lease_owner("warm-up")  # connect before anything is timed

    async def close(self) -> None:
        await self.provider.close()

    async def cycle(self, key: str) -> None:
        got = await self.provider.acquire_lease(key, "bench", TTL_MS)
        if not got.acquired:
            raise CorrectnessError(f"{NAME}: could not take the free key {key!r}: {got}")
        await self.provider.release_lease(key, "bench")
