"""EtcdInbox: the threads' inboxes as etcd keys beside the leases, each step one txn.

The keys are laid out in :mod:`etcd_leases.etcd.inbox_keys`; waking, aborting and
cancelling are in :mod:`etcd_leases.etcd.thread_control`.

**Order = acknowledgement order.** An append reads the thread's ``seq`` key (n) and
commits ``seq = n + 1`` and the message under ``n + 1`` in one txn that compares the
``seq`` key's mod_revision: two appends that read the same n cannot both commit, so
seqs are handed out one at a time in commit order. A send acknowledged before another
starts has committed first, so it holds the lower seq; the zero-padded seq makes key
order seq order, and watch events (revision order) follow it too.

**Bounded.** The same txn compares that no message with seq <= n + 1 - max_pending is
left, so at most ``max_pending`` are ever waiting (exactly, when acks follow seq order;
an out-of-order ack only makes the bound stricter).

**No lost wake-up.** ``release_if_empty`` deletes the lease key (and the thread's
wake mark) in one txn that compares its owner and token *and* that the thread's
message range is empty (an etcd compare over ``range_end``): a message committed
before it makes it fail; a waking one after it finds the thread free and puts the
mark again, which serving workers watch.

**Unknown outcomes.** A txn whose answer is lost is sent again, identically: it
compares the same ``seq`` revision, so the copies commit at most once, and the nonce
in the message key (and in the ``seq`` value) tells whether one of ours did; where
neither can tell any more, the send raises BackendUnavailable rather than risk a
second copy. A send with a send id always can: the tombstone its txn wrote names
its message (:mod:`etcd_leases.etcd.send_ids`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator

from etcd_leases.contract import check_key, check_owner
from etcd_leases.dead_letters import DeadLetter
from etcd_leases.errors import BackendUnavailable
from etcd_leases.etcd.dead_letters import EtcdDeadLetters
from etcd_leases.etcd.inbox_keys import InboxKeys, id_of, key_of
from etcd_leases.etcd.provider import EtcdBackend
from etcd_leases.etcd.send_ids import Tombstone, TombstoneLeases, evictions
from etcd_leases.etcd.thread_control import EtcdThreadControl
from etcd_leases.etcd.txn import (
    Txn,
    delete,
    first_in_range,
    first_kv,
    get,
    mod_revision_is,
    prefix_end,
    put,
    range_is_empty,
    value_is,
)
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.inbox import Acked, InboxFull, Message, check_append, not_in_inbox
from etcd_leases.send_ids import SendId


class _SendQueue:
    """This process's sends to one thread, one at a time.

    Concurrent sends to a thread would only conflict on its ``seq`` key (one commits,
    the others try again): queued, each commits at once, knowing the ``seq`` key from
    the answer to the previous one.
    """

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0
        #: The thread's ``seq`` key as last seen (empty: there is none), once read.
        self.seq_kv: pb.KeyValue | None = None


def _counts(seq_kv: pb.KeyValue) -> tuple[int, int]:
    """From a ``seq`` key: the thread's last seq, and how many send ids it has used."""
    parts = seq_kv.value.split()  # "<last> <nonce>", then "<ids used>" once one was
    return int(parts[0]) if parts else 0, int(parts[2]) if len(parts) > 2 else 0


def _kvs(response: pb.TxnResponse, index: int) -> list[pb.KeyValue]:
    return list(response.responses[index].response_range.kvs)


def _or_empty(kv: pb.KeyValue | None) -> pb.KeyValue:
    """A key read: an absent one as an empty ``KeyValue`` (no value, mod_revision 0)."""
    return kv if kv is not None else pb.KeyValue()


class EtcdInbox:
    """The :class:`~etcd_leases.inbox.Inbox` capability on an :class:`EtcdBackend`."""

    def __init__(self, backend: EtcdBackend) -> None:
        self.keys = InboxKeys(backend.prefix)
        self._backend = backend
        self._client = backend.client
        self._queues: dict[str, _SendQueue] = {}
        self._tombstone_leases = TombstoneLeases(backend.client)
        self._dead = EtcdDeadLetters(backend, self.keys)
        self._control = EtcdThreadControl(backend, self.keys)

    def _message(self, thread: str, kv: pb.KeyValue) -> Message:
        return Message(thread, self.keys.seq_of(thread, kv.key), kv.value, id_of(kv.key))

    # The capability.

    async def append(
        self,
        thread: str,
        payload: bytes,
        max_pending: int,
        send_id: SendId | None = None,
        wake: bool = True,
    ) -> Message:
        data = check_append(thread, payload, max_pending, send_id, wake)
        self._client.check_open()
        queue = self._queues.setdefault(thread, _SendQueue())
        queue.users += 1
        try:
            async with queue.lock:
                return await self._append(thread, data, max_pending, queue, send_id, wake)
        finally:
            queue.users -= 1
            if not queue.users:
                del self._queues[thread]

    async def _append(
        self,
        thread: str,
        data: bytes,
        max_pending: int,
        queue: _SendQueue,
        send_id: SendId | None,
        wake: bool,
    ) -> Message:
        seq_key, nonce = self.keys.seq(thread), secrets.token_hex(8)
        seq_kv = queue.seq_kv
        if seq_kv is None:
            seq_kv = queue.seq_kv = _or_empty(await self._client.range(seq_key))
        while True:
            last, ids_used = _counts(seq_kv)
            seen = seq_kv.mod_revision
            key = self.keys.message(thread, last + 1, nonce)
            compares = [mod_revision_is(seq_key, seen)]
            if (oldest_allowed := last + 2 - max_pending) > 1:
                end = self.keys.messages(thread, below_seq=oldest_allowed)
                compares.append(range_is_empty(self.keys.messages(thread), end))
            ops = [put(key, data), get(seq_key)]
            if wake:
                ops.append(put(self.keys.wake(thread), b""))
            if send_id is not None:
                ids_used += 1
                tomb_key = self.keys.send_id(thread, send_id.id)
                compares.append(mod_revision_is(tomb_key, 0))  # the id is not taken
                ops += await self._tombstone(thread, send_id, ids_used, last + 1, key)
            # The seq key carries the nonce too: after a lost answer it says whether
            # ours was the last send, even once its message has been acknowledged.
            seq_value = b"%d %s %d" % (last + 1, nonce.encode(), ids_used)
            txn = Txn.when(*compares).then(put(seq_key, seq_value), *ops)
            txn.otherwise(get(seq_key), get(key), *([get(tomb_key)] if send_id else []))
            response, answers_lost = await self._backend._send_copies(txn)
            seq_kv = queue.seq_kv = _or_empty(first_kv(response))
            ours = seq_kv.value == seq_value
            if not response.succeeded and send_id and (earlier := _kvs(response, 2)):
                tomb = Tombstone.parse(earlier[0])
                if tomb.message_key != key:  # else a lost answer's copy of ours landed
                    return Message(thread, tomb.seq, data, id_of(tomb.message_key), duplicate=True)
                ours = True
            if response.succeeded or _kvs(response, 1) or (answers_lost and ours):
                return Message(thread, last + 1, data, id_of(key))
            if seq_kv.mod_revision == seen:
                raise InboxFull(thread, max_pending)
            if answers_lost:
                # A copy of ours may have landed, been acknowledged and been followed
                # by another send: sending again could deliver the message twice.
                raise BackendUnavailable(
                    f"etcd: the answer to a send to {thread!r} was lost and another send "
                    "followed: whether it was stored is unknown (a send id settles it)"
                )
            # Another process's send took this seq: take the next one.

    async def _tombstone(
        self, thread: str, send_id: SendId, number: int, seq: int, message_key: bytes
    ) -> list[pb.RequestOp]:
        """The writes that remember ``send_id`` for its window, evicting the oldest."""
        lease = await self._tombstone_leases.lease(send_id.window_s)
        tomb = Tombstone(seq, number, message_key)
        return [
            put(self.keys.send_id(thread, send_id.id), tomb.value(), lease),
            put(self.keys.send_id_number(thread, number), send_id.id.encode(), lease),
            *await evictions(self._client, self.keys, thread, number, send_id),
        ]

    async def pending(self, thread: str) -> list[Message]:
        check_key(thread, "thread")
        self._client.check_open()
        response = await self._range(self.keys.messages(thread))
        return [self._message(thread, kv) for kv in response.kvs]

    async def count_pending(self, thread: str) -> int:
        check_key(thread, "thread")
        self._client.check_open()
        return (await self._range(self.keys.messages(thread), count_only=True)).count

    async def watch(self, thread: str) -> AsyncGenerator[list[Message], None]:
        check_key(thread, "thread")
        self._client.check_open()
        last = -1  # the first batch is yielded even when empty
        async with contextlib.aclosing(self._watch_range(self.keys.messages(thread))) as batches:
            async for kvs in batches:
                batch = [m for m in (self._message(thread, kv) for kv in kvs) if m.seq > last]
                if batch or last < 0:
                    last = batch[-1].seq if batch else 0
                    yield batch

    async def wake(self, thread: str) -> bool:
        check_key(thread, "thread")
        self._client.check_open()
        return await self._control.wake(thread)

    async def count_woken(self, thread: str) -> int:
        check_key(thread, "thread")
        self._client.check_open()
        return await self._control.count_woken(thread)

    async def cancel_pending(self, key: str, thread: str) -> int:
        check_key(key)
        check_key(thread, "thread")
        self._client.check_open()
        return await self._control.cancel_pending(key, thread)

    async def abort(self, key: str, thread: str) -> bool:
        check_key(key)
        check_key(thread, "thread")
        self._client.check_open()
        return await self._control.abort(key, thread)

    async def aborted(self, thread: str, token: int) -> None:
        check_key(thread, "thread")
        self._client.check_open()
        await self._control.aborted(thread, token)

    async def ack(self, key: str, owner: str, token: int, message: Message) -> Acked | None:
        check_key(key)
        check_owner(owner)
        message_key = self._key_of(message)
        self._client.check_open()
        lease_key = self._backend.etcd_key(key)
        txn = Txn.when(mod_revision_is(lease_key, token), value_is(lease_key, owner.encode()))
        # Deleting an absent key succeeds, so a lost answer can be settled by asking again.
        counter = self.keys.delivery(message.thread, message.seq)
        messages = self.keys.messages(message.thread)
        waiting = first_in_range(messages, prefix_end(messages))
        last = get(self.keys.seq(message.thread))
        response, _ = await self._backend._send_copies(
            txn.then(delete(message_key), delete(counter), waiting, last)
        )
        if not response.succeeded:
            return None
        first, seq = (op.response_range.kvs for op in response.responses[2:])
        first_seq = self.keys.seq_of(message.thread, first[0].key) if first else None
        return Acked(first_seq, _counts(seq[0])[0] if seq else 0)

    async def deliver(self, key: str, owner: str, token: int, message: Message) -> int:
        check_key(key)
        check_owner(owner)
        self._key_of(message)
        self._client.check_open()
        return await self._dead.deliver(key, owner, token, message)

    async def dead_letter(
        self, key: str, owner: str, token: int, message: Message, attempts: int
    ) -> bool:
        check_key(key)
        check_owner(owner)
        message_key = self._key_of(message)
        self._client.check_open()
        return await self._dead.dead_letter(key, owner, token, message, message_key, attempts)

    async def dead_letters(self, thread: str) -> list[DeadLetter]:
        check_key(thread, "thread")
        self._client.check_open()
        return await self._dead.list(thread)

    async def drop_dead_letter(self, letter: DeadLetter) -> bool:
        check_key(letter.thread, "thread")
        self._client.check_open()
        return await self._dead.drop(letter)

    def _key_of(self, message: Message) -> bytes:
        """The etcd key of ``message``: never anything but one of its thread's messages."""
        check_key(message.thread, "thread")
        try:
            message_key = key_of(message.id)
        except UnicodeEncodeError:
            raise not_in_inbox(message) from None
        if not self.keys.is_message(message.thread, message_key):
            raise not_in_inbox(message)
        return message_key

    async def release_if_empty(self, key: str, owner: str, token: int, thread: str) -> bool:
        check_key(key)
        check_owner(owner)
        check_key(thread, "thread")
        self._client.check_open()
        lease_key, messages = self._backend.etcd_key(key), self.keys.messages(thread)
        txn = (
            Txn.when(
                mod_revision_is(lease_key, token),
                value_is(lease_key, owner.encode()),
                range_is_empty(messages, prefix_end(messages)),
            )
            .then(get(lease_key), delete(lease_key), delete(self.keys.wake(thread)))
            .otherwise(get(lease_key))
        )
        response, answers_lost = await self._backend._send_copies(txn)
        if not response.succeeded:
            # After a lost answer, a key gone means a copy of ours deleted it (or it
            # expired): the thread is free either way, its lease gone or expiring.
            return answers_lost and first_kv(response) is None
        kv = first_kv(response)
        if kv is not None:
            # Its lease now holds no key: back to the pool, if it is one of ours. Never
            # revoked: a session lease carries the other threads this process runs.
            self._backend.lease_freed(kv.lease)
        return True

    async def watch_threads(self) -> AsyncGenerator[str, None]:
        self._client.check_open()
        woken = self._watch_range(self.keys.all_wakes(), keys_only=True)
        async with contextlib.aclosing(woken) as batches:
            async for kvs in batches:
                for thread in dict.fromkeys(self.keys.thread_of_wake(kv.key) for kv in kvs):
                    if thread is not None:
                        yield thread

    async def _range(
        self, start: bytes, keys_only: bool = False, *, count_only: bool = False
    ) -> pb.RangeResponse:
        """Every key under ``start``, in key order (a linearizable read), or their count."""
        request = pb.RangeRequest(
            key=start, range_end=prefix_end(start), keys_only=keys_only, count_only=count_only
        )
        return await self._client.call("/etcdserverpb.KV/Range", request, pb.RangeResponse)

    async def _watch_range(
        self, start: bytes, keys_only: bool = False
    ) -> AsyncGenerator[list[pb.KeyValue], None]:
        """The keys under ``start`` now, then each batch of keys put under it.

        After a compaction took history the watch still needed, every key under
        ``start`` again: consumers skip what they have seen.
        """
        response = await self._range(start, keys_only)
        yield list(response.kvs)
        revision = response.header.revision
        watcher = self._backend._watches.watch(start, revision + 1, range_end=prefix_end(start))
        try:
            async for events in watcher:
                if not events:
                    yield list((await self._range(start, keys_only)).kvs)
                else:
                    yield [event.kv for event in events if event.type == pb.Event.PUT]
        finally:
            watcher.cancel()
