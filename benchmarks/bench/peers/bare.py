"""The bare loop: LeaseGrant, a compare-and-put Txn on that lease, LeaseRevoke.

The least any etcd lock that frees its lease on release can send, with no client
logic around the three RPCs: the yardstick for throughput.
"""

from __future__ import annotations

from ..config import TTL_MS
from ..floor import BareEtcd
from . import AsyncPeer, CorrectnessError

NAME = "bare gRPC grant+txn+revoke"


class BareLoop(AsyncPeer):
    name = NAME
    does = "LeaseGrant, Txn (put if absent, on the lease), LeaseRevoke: 3 RPCs, 3 raft writes"

    def __init__(self, endpoint: str, prefix: str) -> None:
        self._etcd = BareEtcd(endpoint, prefix)

    async def open(self) -> None:
        await self._etcd.range(self._etcd.key("warm-up"))

    async def close(self) -> None:
        await self._etcd.close()

    async def cycle(self, key: str) -> None:
        lease_id = await self._etcd.take(self._etcd.key(key), TTL_MS // 1000)
        if lease_id is None:
            raise CorrectnessError(f"{NAME}: could not take the free key {key!r}")
        await self._etcd.revoke(lease_id)
