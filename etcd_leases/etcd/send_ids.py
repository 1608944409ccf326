"""Send-id tombstones in etcd (see :mod:`etcd_leases.send_ids`): their leases, their bound.

A tombstone (``ids/<thread>/<send id>``, with its number under ``idn/``) is written in
the txn that stores its message, and compared absent by it: a send whose id is taken
stores nothing and reads the tombstone instead. Tombstones are attached to a lease
granted for the window, shared by every tombstone this process writes within a short
while of the grant, so the window costs one grant per while, not one per send, and
etcd forgets them on its own, whatever becomes of this process. The thread's ``seq``
key counts the ids it has used; the number-th id evicts the one ``max_per_thread``
before it.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.inbox_keys import InboxKeys
from etcd_leases.etcd.lease_ids import new_lease_id
from etcd_leases.etcd.txn import delete
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.send_ids import SendId


@dataclass(frozen=True)
class Tombstone:
    """What a tombstone says: the message its send stored, and its number."""

    seq: int
    number: int
    message_key: bytes

    def value(self) -> bytes:
        return b"%d %d %s" % (self.seq, self.number, self.message_key)

    @classmethod
    def parse(cls, kv: pb.KeyValue) -> Tombstone:
        seq, number, message_key = kv.value.split(b" ", 2)
        return cls(int(seq), int(number), message_key)


class TombstoneLeases:
    """One lease per window, reused while it still outlives a new tombstone's window."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._lock = asyncio.Lock()
        self._leases: dict[float, tuple[int, float]] = {}  # window -> (id, usable until)

    async def lease(self, window_s: float) -> int:
        async with self._lock:
            lease_id, usable_until = self._leases.get(window_s, (0, 0.0))
            if time.monotonic() < usable_until:
                return lease_id
            # Longer than the window by a tenth (at least 1 s): how long it is reused.
            ttl_s = math.ceil(window_s) + max(1, math.ceil(window_s / 10))
            lease_id, sent_at = new_lease_id(), time.monotonic()
            granted_s = await self._client.grant(ttl_s, lease_id)
            self._leases[window_s] = lease_id, sent_at + granted_s - window_s
            return lease_id


async def evictions(
    client: EtcdClient, keys: InboxKeys, thread: str, number: int, send_id: SendId
) -> list[pb.RequestOp]:
    """What the ``number``-th send id of ``thread`` deletes: the one it pushes out.

    Read before the txn that deletes it, which compares the ``seq`` key: no tombstone
    of the thread changes unless that key does (expiry only deletes).
    """
    oldest = number - send_id.max_per_thread
    if oldest < 1:
        return []
    name_key = keys.send_id_number(thread, oldest)
    name = await client.range(name_key)
    if name is None:
        return []  # expired already
    ops = [delete(name_key)]
    evicted = name.value.decode("utf-8")
    tomb_key = keys.send_id(thread, evicted)
    tomb = await client.range(tomb_key) if evicted != send_id.id else None
    # The same id sent again since (after its tombstone expired) has a newer tombstone.
    if tomb is not None and Tombstone.parse(tomb).number == oldest:
        ops.append(delete(tomb_key))
    return ops
