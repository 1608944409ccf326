"""EtcdInbox: the threads' inboxes as etcd keys beside the leases, each step one txn.

Layout, under the inbox prefix (default: beside the lease prefix, e.g.
``/etcd-leases.inbox/``; see :func:`default_inbox_prefix`)::

    seq/<thread>                          the thread's last seq, as decimal text
    msg/<thread>/<seq, 20 digits>.<nonce> one message; its value is the payload

where ``<thread>`` is the thread's UTF-8 bytes after their length (``0009/chat:42\\0x``),
so one thread's keys never fall in another's range, whatever bytes names contain.

**Order = acknowledgement order.** An append reads the thread's ``seq`` key (n) and
commits ``seq = n + 1`` and the message under ``n + 1`` in one txn that compares the
``seq`` key's mod_revision: two appends that read the same n cannot both commit, so
seqs are handed out one at a time in commit order. A send acknowledged before another
starts has committed first, so it holds the lower seq; the zero-padded seq makes key
order seq order, and watch events (revision order) follow it too.

**Bounded.** The same txn compares that no message with seq <= n + 1 - max_pending is
left, so at most ``max_pending`` are ever waiting (exactly, when acks follow seq order;
an out-of-order ack only makes the bound stricter).

**No lost wake-up.** ``release_if_empty`` deletes the lease key in one txn that
compares its owner and token *and* that the thread's message range is empty (an etcd
compare over ``range_end``): a message committed before it makes it fail; one after it
finds the thread free.

**Unknown outcomes.** A txn whose answer is lost is sent again, identically: it
compares the same ``seq`` revision, so the copies commit at most once, and the nonce
in the message key tells whether one of ours did.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator

from etcd_leases.contract import check_key, check_owner
from etcd_leases.errors import BackendUnavailable, LeaseError, LeaseValueError
from etcd_leases.etcd.client import prefix_end
from etcd_leases.etcd.provider import EtcdBackend
from etcd_leases.etcd.txn import (
    Txn,
    delete,
    first_kv,
    get,
    mod_revision_is,
    put,
    range_is_empty,
    value_is,
)
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.inbox import InboxFull, Message, check_append, payload_bytes

_SEQ_DIGITS = 20
_TXN_ATTEMPTS = 3


def default_inbox_prefix(lease_prefix: str) -> bytes:
    """Where inboxes go by default: beside the leases, never under a lease key.

    ``/etcd-leases/`` -> ``/etcd-leases.inbox/``. A prefix without a final ``/``
    (or just ``/``) gets ``<prefix>\xff.inbox/`` instead: no UTF-8 key has an 0xFF
    byte, so no lease key falls under it either.
    """
    stem = lease_prefix.rstrip("/")
    if lease_prefix.endswith("/") and stem:
        return f"{stem}.inbox/".encode()
    return lease_prefix.encode("utf-8") + b"\xff.inbox/"


def _id_of(key: bytes) -> str:
    """A message's id: its etcd key (the root may hold an 0xFF byte, kept as is)."""
    return key.decode("utf-8", "surrogateescape")


def _key_of(message_id: str) -> bytes:
    return message_id.encode("utf-8", "surrogateescape")


class _SendQueue:
    """This process's sends to one thread, one at a time.

    Concurrent sends to a thread would only conflict on its ``seq`` key (one commits,
    the others try again): queued, each commits at once, knowing the ``seq`` key from
    the answer to the previous one.
    """

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0
        self.known = False
        self.seq_kv: pb.KeyValue | None = None


class EtcdInbox:
    """The :class:`~etcd_leases.inbox.Inbox` capability on an :class:`EtcdBackend`."""

    def __init__(self, backend: EtcdBackend, prefix: str | None = None) -> None:
        if prefix is None:
            root = default_inbox_prefix(backend.prefix)
        else:
            root, lease_prefix = prefix.encode("utf-8"), backend.prefix.encode("utf-8")
            if not root or root.startswith(lease_prefix) or lease_prefix.startswith(root):
                raise LeaseValueError(
                    f"the inbox prefix {prefix!r} overlaps the lease prefix {backend.prefix!r}"
                )
        self._backend = backend
        self._client = backend.client
        self._root = root
        self._queues: dict[str, _SendQueue] = {}

    # Keys.

    @staticmethod
    def _name(thread: str) -> bytes:
        data = thread.encode("utf-8")
        return b"%04d/" % len(data) + data

    def _seq_key(self, thread: str) -> bytes:
        return self._root + b"seq/" + self._name(thread)

    def _messages(self, thread: str) -> bytes:
        """The prefix of ``thread``'s messages."""
        return self._root + b"msg/" + self._name(thread) + b"/"

    def _message_key(self, thread: str, seq: int, nonce: str) -> bytes:
        return self._messages(thread) + b"%0*d.%s" % (_SEQ_DIGITS, seq, nonce.encode())

    def _message(self, thread: str, kv: pb.KeyValue) -> Message:
        name = kv.key[len(self._messages(thread)) :]
        return Message(thread, int(name[:_SEQ_DIGITS]), kv.value, _id_of(kv.key))

    def _thread_of(self, key: bytes) -> str | None:
        """The thread a message key belongs to (``None`` for anything else)."""
        name = key[len(self._root) + len(b"msg/") :]
        length, slash, rest = name.partition(b"/")
        if not slash or not length.isdigit() or len(rest) <= int(length):
            return None
        return rest[: int(length)].decode("utf-8", errors="replace")

    # The capability.

    async def append(self, thread: str, payload: bytes, max_pending: int) -> Message:
        check_append(thread, payload, max_pending)
        self._client.check_open()
        queue = self._queues.setdefault(thread, _SendQueue())
        queue.users += 1
        try:
            async with queue.lock:
                return await self._append(thread, payload_bytes(payload), max_pending, queue)
        finally:
            queue.users -= 1
            if not queue.users:
                del self._queues[thread]

    async def _append(
        self, thread: str, data: bytes, max_pending: int, queue: _SendQueue
    ) -> Message:
        seq_key, nonce = self._seq_key(thread), secrets.token_hex(8)
        if not queue.known:
            queue.seq_kv, queue.known = await self._client.range(seq_key), True
        while True:
            last = int(queue.seq_kv.value) if queue.seq_kv is not None else 0
            seen = queue.seq_kv.mod_revision if queue.seq_kv is not None else 0
            key = self._message_key(thread, last + 1, nonce)
            compares = [mod_revision_is(seq_key, seen)]
            if (oldest_allowed := last + 2 - max_pending) > 1:
                end = self._messages(thread) + b"%0*d" % (_SEQ_DIGITS, oldest_allowed)
                compares.append(range_is_empty(self._messages(thread), end))
            txn = (
                Txn.when(*compares)
                .then(put(seq_key, b"%d" % (last + 1)), put(key, data), get(seq_key))
                .otherwise(get(seq_key), get(key))
            )
            response = await self._send(txn)
            queue.seq_kv = first_kv(response)
            if response.succeeded or self._found(response, 1):
                return Message(thread, last + 1, data, _id_of(key))
            if (queue.seq_kv.mod_revision if queue.seq_kv is not None else 0) == seen:
                raise InboxFull(thread, max_pending)
            # Another process's send took this seq: take the next one.

    @staticmethod
    def _found(response: pb.TxnResponse, index: int) -> bool:
        return bool(response.responses[index].response_range.kvs)

    async def _send(self, txn: Txn) -> pb.TxnResponse:
        for attempt in range(_TXN_ATTEMPTS):
            try:
                return await self._client.txn(txn.request)
            except BackendUnavailable:
                if attempt == _TXN_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def pending(self, thread: str) -> list[Message]:
        check_key(thread, "thread")
        return (await self._read(thread))[0]

    async def _read(self, thread: str) -> tuple[list[Message], int]:
        self._client.check_open()
        start = self._messages(thread)
        response = await self._client.call(
            "/etcdserverpb.KV/Range",
            pb.RangeRequest(key=start, range_end=prefix_end(start)),
            pb.RangeResponse,
        )
        messages = [self._message(thread, kv) for kv in response.kvs]
        return messages, response.header.revision

    async def watch(self, thread: str) -> AsyncGenerator[list[Message], None]:
        check_key(thread, "thread")
        messages, revision = await self._read(thread)
        yield messages
        last = messages[-1].seq if messages else 0
        start = self._messages(thread)
        watcher = self._backend._watches.watch(start, revision + 1, range_end=prefix_end(start))
        try:
            async for events in watcher:
                if not events:  # history compacted away: read what is waiting now
                    messages = (await self._read(thread))[0]
                else:
                    messages = [
                        self._message(thread, event.kv)
                        for event in events
                        if event.type == pb.Event.PUT
                    ]
                batch = [message for message in messages if message.seq > last]
                if batch:
                    last = batch[-1].seq
                    yield batch
        finally:
            watcher.cancel()

    async def ack(self, key: str, owner: str, token: int, message: Message) -> bool:
        check_key(key)
        check_owner(owner)
        self._client.check_open()
        lease_key = self._backend.etcd_key(key)
        txn = Txn.when(mod_revision_is(lease_key, token), value_is(lease_key, owner.encode()))
        # Deleting an absent key succeeds, so a lost answer can be settled by asking again.
        response = await self._send(txn.then(delete(_key_of(message.id))))
        return response.succeeded

    async def release_if_empty(self, key: str, owner: str, token: int, thread: str) -> bool:
        check_key(key)
        check_owner(owner)
        check_key(thread, "thread")
        self._client.check_open()
        lease_key, messages = self._backend.etcd_key(key), self._messages(thread)
        txn = Txn.when(
            mod_revision_is(lease_key, token),
            value_is(lease_key, owner.encode()),
            range_is_empty(messages, prefix_end(messages)),
        ).then(get(lease_key), delete(lease_key))
        response = await self._send(txn)
        if not response.succeeded:
            return False
        kv = first_kv(response)
        if kv is not None and kv.lease:
            # The tenure's own lease now holds no key: revoke it rather than leak it.
            with contextlib.suppress(LeaseError):
                await self._client.revoke(kv.lease)
        return True

    async def watch_threads(self) -> AsyncGenerator[str, None]:
        self._client.check_open()
        start = self._root + b"msg/"
        threads, revision = await self._waiting_threads(start)
        for thread in threads:
            if thread is not None:
                yield thread
        watcher = self._backend._watches.watch(start, revision + 1, range_end=prefix_end(start))
        try:
            async for events in watcher:
                if not events:  # history compacted away: every thread waiting now
                    threads = (await self._waiting_threads(start))[0]
                else:
                    threads = [
                        self._thread_of(event.kv.key)
                        for event in events
                        if event.type == pb.Event.PUT
                    ]
                for thread in threads:
                    if thread is not None:
                        yield thread
        finally:
            watcher.cancel()

    async def _waiting_threads(self, start: bytes) -> tuple[list[str | None], int]:
        response = await self._client.call(
            "/etcdserverpb.KV/Range",
            pb.RangeRequest(key=start, range_end=prefix_end(start), keys_only=True),
            pb.RangeResponse,
        )
        threads = list(dict.fromkeys(self._thread_of(kv.key) for kv in response.kvs))
        return threads, response.header.revision
