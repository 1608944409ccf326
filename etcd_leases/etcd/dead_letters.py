"""Delivery counts and dead letters in etcd (see :mod:`etcd_leases.dead_letters`).

A message's delivery count is the ``version`` of its ``att/`` key: each counted
delivery puts it once more, so counting needs no read, and it survives takeovers.
The put is guarded by a nested txn comparing the key's value with the run's owner,
so a copy sent again after a lost answer counts nothing twice. Acknowledging or
dead-lettering the message deletes the key in the same txn.
"""

from __future__ import annotations

from etcd_leases.dead_letters import DeadLetter, decode, encode
from etcd_leases.errors import LeaseValueError
from etcd_leases.etcd.inbox_keys import InboxKeys, id_of, key_of
from etcd_leases.etcd.provider import EtcdBackend
from etcd_leases.etcd.txn import Txn, delete, get, mod_revision_is, put, value_is
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.inbox import Message


class EtcdDeadLetters:
    def __init__(self, backend: EtcdBackend, keys: InboxKeys) -> None:
        self._backend = backend
        self._keys = keys

    def _fence(self, key: str, owner: str, token: int) -> tuple[pb.Compare, pb.Compare]:
        lease_key = self._backend.etcd_key(key)
        return mod_revision_is(lease_key, token), value_is(lease_key, owner.encode())

    async def deliver(self, key: str, owner: str, token: int, message: Message) -> int:
        counter = self._keys.delivery(message.thread, message.seq)
        once = (
            Txn.when(value_is(counter, owner.encode()))
            .then(get(counter))
            .otherwise(put(counter, owner.encode()), get(counter))
        )
        txn = Txn.when(*self._fence(key, owner, token)).then(pb.RequestOp(request_txn=once.request))
        response, _ = await self._backend._send_copies(txn)
        if not response.succeeded:
            return 0
        inner = response.responses[0].response_txn
        return int(inner.responses[-1].response_range.kvs[0].version)

    async def dead_letter(
        self,
        key: str,
        owner: str,
        token: int,
        message: Message,
        message_key: bytes,
        attempts: int,
    ) -> bool:
        thread = message.thread
        txn = Txn.when(*self._fence(key, owner, token)).then(
            delete(message_key),
            delete(self._keys.delivery(thread, message.seq)),
            put(self._keys.dead_letter(thread, message_key), encode(attempts, message.payload)),
        )
        response, _ = await self._backend._send_copies(txn)
        return response.succeeded

    async def list(self, thread: str) -> list[DeadLetter]:
        prefix = self._keys.dead_letters(thread)
        letters = []
        for kv in await self._backend.client.range_prefix(prefix):
            attempts, payload = decode(kv.value)
            seq = int(kv.key[len(prefix) :].partition(b".")[0])
            letters.append(DeadLetter(thread, seq, payload, id_of(kv.key), attempts))
        return letters

    async def drop(self, letter: DeadLetter) -> bool:
        dead_key = key_of(letter.id)
        if not dead_key.startswith(self._keys.dead_letters(letter.thread)):
            raise LeaseValueError(f"{letter.id!r} is not a dead letter of {letter.thread!r}")
        request = pb.DeleteRangeRequest(key=dead_key)
        response = await self._backend.client.call(
            "/etcdserverpb.KV/DeleteRange", request, pb.DeleteRangeResponse
        )
        return response.deleted > 0
