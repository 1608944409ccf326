"""Waking, aborting and emptying threads in etcd (see :mod:`etcd_leases.inbox`).

- **Wake mark.** ``wake/<thread>`` is put by every waking send, in the txn that stores
  its message, and deleted by ``release_if_empty`` in the txn that frees the thread:
  serving workers watch the ``wake/`` prefix, so a send with ``wake=False`` stores its
  message and starts nothing.
- **Abort.** ``abort/<thread>`` holds the token of the tenure aborted, written in a txn
  that compares that this tenure holds the lease key, under the tenure's etcd lease (it
  goes with it). A run stops only for its own token (one watch of every abort key
  serves a provider's runs, :mod:`etcd_leases.etcd.abort_watch`): an abort of an
  earlier tenure never stops a later one.
- **Cancel.** One txn deletes the thread's messages, all of them while the thread is
  free, all but the first in line while a tenure holds it. It compares what was read
  (the lease key, the ``seq`` key, the first message), so the count read is the count
  deleted, and a copy sent again after a lost answer deletes nothing more.
"""

from __future__ import annotations

from etcd_leases.errors import BackendUnavailable
from etcd_leases.etcd.abort_watch import AbortWatch
from etcd_leases.etcd.inbox_keys import InboxKeys
from etcd_leases.etcd.provider import EtcdBackend
from etcd_leases.etcd.txn import (
    Txn,
    delete_range,
    first_in_range,
    get,
    mod_revision_is,
    prefix_end,
    put,
    range_is_empty,
    value_is,
)
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

# Attempts of a cancel against sends and acks that keep changing what it read.
_CANCEL_ATTEMPTS = 100


class EtcdThreadControl:
    def __init__(self, backend: EtcdBackend, keys: InboxKeys) -> None:
        self._backend = backend
        self._keys = keys
        self._aborts = AbortWatch(backend, keys)

    async def _read(self, txn: Txn) -> pb.TxnResponse:
        """A txn of reads alone, sent by itself: etcd answers it without a raft write,
        which it could not if the batcher nested it with writes."""
        return await self._backend.client.call("/etcdserverpb.KV/Txn", txn.request, pb.TxnResponse)

    async def wake(self, thread: str) -> bool:
        messages = self._keys.messages(thread)
        txn = Txn.when(range_is_empty(messages, prefix_end(messages)))
        response, _ = await self._backend._send_copies(
            txn.otherwise(put(self._keys.wake(thread), b""))
        )
        return not response.succeeded

    async def count_woken(self, thread: str) -> int:
        messages = self._keys.messages(thread)
        request = pb.RangeRequest(key=messages, range_end=prefix_end(messages), count_only=True)
        txn = Txn.when().then(get(self._keys.wake(thread)), pb.RequestOp(request_range=request))
        response = await self._read(txn)
        woken, waiting = (op.response_range for op in response.responses)
        return waiting.count if woken.kvs else 0

    async def cancel_pending(self, key: str, thread: str) -> int:
        lease_key, seq_key = self._backend.etcd_key(key), self._keys.seq(thread)
        messages, deliveries = self._keys.messages(thread), self._keys.deliveries(thread)
        read = Txn.when().then(
            get(lease_key), get(seq_key), first_in_range(messages, prefix_end(messages))
        )
        for _ in range(_CANCEL_ATTEMPTS):
            response = await self._read(read)
            lease, seq, waiting = (op.response_range for op in response.responses)
            compares = [
                mod_revision_is(lease_key, lease.kvs[0].mod_revision if lease.kvs else 0),
                mod_revision_is(seq_key, seq.kvs[0].mod_revision if seq.kvs else 0),
            ]
            if not waiting.kvs or (lease.kvs and waiting.count == 1):
                return 0
            if lease.kvs:  # a run holds the thread: its first message stays
                first = waiting.kvs[0]
                compares.append(mod_revision_is(first.key, first.mod_revision))
                first_seq = self._keys.seq_of(thread, first.key)
                ops = [
                    delete_range(first.key + b"\0", prefix_end(messages)),
                    delete_range(
                        self._keys.delivery(thread, first_seq + 1), prefix_end(deliveries)
                    ),
                ]
                cancelled = waiting.count - 1
            else:
                ops = [
                    delete_range(messages, prefix_end(messages)),
                    delete_range(deliveries, prefix_end(deliveries)),
                    delete_range(self._keys.wake(thread), b""),
                ]
                cancelled = waiting.count
            done, _ = await self._backend._send_copies(Txn.when(*compares).then(*ops))
            if done.succeeded:
                return cancelled
        raise BackendUnavailable(
            f"the inbox of {thread!r} kept changing: its pending messages were not cancelled"
        )

    async def abort(self, key: str, thread: str) -> bool:
        lease_key = self._backend.etcd_key(key)
        while True:
            kv = await self._backend.client.range(lease_key)
            if kv is None:
                return False
            txn = Txn.when(
                mod_revision_is(lease_key, kv.mod_revision), value_is(lease_key, kv.value)
            )
            aborting = put(self._keys.abort(thread), b"%d" % kv.mod_revision, kv.lease)
            response, _ = await self._backend._send_copies(txn.then(aborting))
            if response.succeeded:
                return True

    async def aborted(self, thread: str, token: int) -> None:
        await self._aborts.aborted(thread, token)
