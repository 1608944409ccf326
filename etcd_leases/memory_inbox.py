"""The reference model of the inbox capability, beside the in-memory leases.

One process, one event loop: every call below runs without awaiting in between, so
each is atomic the way the etcd transactions are.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator

from etcd_leases.contract import check_key, check_owner
from etcd_leases.dead_letters import DeadLetter
from etcd_leases.errors import ProviderClosed
from etcd_leases.inbox import Acked, InboxFull, Message, check_append, not_in_inbox
from etcd_leases.memory import MemoryBackend
from etcd_leases.send_ids import SendId


class MemoryInbox:
    """Inboxes in dicts, fenced by the tenures of a :class:`MemoryBackend`."""

    def __init__(self, backend: MemoryBackend) -> None:
        self._backend = backend
        self._messages: dict[str, dict[int, Message]] = {}
        self._last_seq: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._watchers: dict[str, set[asyncio.Queue[list[Message] | None]]] = {}
        self._thread_watchers: set[asyncio.Queue[str | None]] = set()
        # Per thread, oldest first: send id -> (its message, when it is forgotten).
        self._send_ids: dict[str, OrderedDict[str, tuple[Message, float]]] = {}
        self._deliveries: dict[str, int] = {}  # message id -> deliveries counted
        self._dead: dict[str, dict[str, DeadLetter]] = {}
        self._woken: set[str] = set()
        self._aborts: dict[str, int] = {}  # thread -> the token of its last abort
        self._abort_signals: dict[str, asyncio.Event] = {}

    async def append(
        self,
        thread: str,
        payload: bytes,
        max_pending: int,
        send_id: SendId | None = None,
        wake: bool = True,
    ) -> Message:
        data = check_append(thread, payload, max_pending, send_id, wake)
        self._backend._check_open()
        if send_id is not None and (earlier := self._sent_before(thread, send_id)):
            return Message(thread, earlier.seq, data, earlier.id, duplicate=True)
        waiting = self._messages.setdefault(thread, {})
        if len(waiting) >= max_pending:
            raise InboxFull(thread, max_pending)
        seq = self._last_seq.get(thread, 0) + 1
        self._last_seq[thread] = seq
        message = Message(thread, seq, data, f"{thread}#{next(self._ids)}")
        waiting[seq] = message
        if send_id is not None:
            ids = self._send_ids.setdefault(thread, OrderedDict())
            ids[send_id.id] = message, time.monotonic() + send_id.window_s
            while len(ids) > send_id.max_per_thread:
                ids.popitem(last=False)
        for queue in self._watchers.get(thread, ()):
            queue.put_nowait([message])
        if wake:
            self._wake(thread)
        return message

    def _wake(self, thread: str) -> None:
        self._woken.add(thread)
        for threads in self._thread_watchers:
            threads.put_nowait(thread)

    async def wake(self, thread: str) -> bool:
        check_key(thread, "thread")
        self._backend._check_open()
        if not self._messages.get(thread):
            return False
        self._wake(thread)
        return True

    async def count_woken(self, thread: str) -> int:
        check_key(thread, "thread")
        self._backend._check_open()
        return len(self._messages.get(thread, {})) if thread in self._woken else 0

    def _sent_before(self, thread: str, send_id: SendId) -> Message | None:
        """The message of an earlier send with this id, if it is still remembered."""
        ids = self._send_ids.get(thread, OrderedDict())
        now = time.monotonic()
        while ids and next(iter(ids.values()))[1] <= now:
            ids.popitem(last=False)
        earlier = ids.get(send_id.id)
        return earlier[0] if earlier and earlier[1] > now else None

    async def pending(self, thread: str) -> list[Message]:
        check_key(thread, "thread")
        self._backend._check_open()
        return list(self._messages.get(thread, {}).values())

    async def count_pending(self, thread: str) -> int:
        check_key(thread, "thread")
        self._backend._check_open()
        return len(self._messages.get(thread, {}))

    async def watch(self, thread: str) -> AsyncGenerator[list[Message], None]:
        check_key(thread, "thread")
        self._backend._check_open()
        queue: asyncio.Queue[list[Message] | None] = asyncio.Queue()
        self._watchers.setdefault(thread, set()).add(queue)
        try:
            yield list(self._messages.get(thread, {}).values())
            while (batch := await queue.get()) is not None:
                yield batch
            raise ProviderClosed("the provider was closed")
        finally:
            self._watchers[thread].discard(queue)

    async def ack(self, key: str, owner: str, token: int, message: Message) -> Acked | None:
        self._check_fenced(key, owner, message)
        if not self._backend._holds(key, owner, token):
            return None
        self._remove(message)
        first = min(self._messages.get(message.thread, {}), default=None)
        return Acked(first, self._last_seq.get(message.thread, 0))

    def _remove(self, message: Message) -> bool:
        waiting = self._messages.get(message.thread, {})
        self._deliveries.pop(message.id, None)
        if message.seq in waiting and waiting[message.seq].id == message.id:
            del waiting[message.seq]
            return True
        return False

    def _check_fenced(self, key: str, owner: str, message: Message) -> None:
        check_key(key)
        check_owner(owner)
        check_key(message.thread, "thread")
        thread, sign, number = message.id.rpartition("#")
        if thread != message.thread or not sign or not number.isdigit():
            raise not_in_inbox(message)
        self._backend._check_open()

    async def deliver(self, key: str, owner: str, token: int, message: Message) -> int:
        self._check_fenced(key, owner, message)
        if not self._backend._holds(key, owner, token):
            return 0
        count = self._deliveries.get(message.id, 0) + 1
        self._deliveries[message.id] = count
        return count

    async def dead_letter(
        self, key: str, owner: str, token: int, message: Message, attempts: int
    ) -> bool:
        self._check_fenced(key, owner, message)
        if not self._backend._holds(key, owner, token):
            return False
        if self._remove(message):
            letter = DeadLetter(message.thread, message.seq, message.payload, message.id, attempts)
            self._dead.setdefault(message.thread, {})[message.id] = letter
        return True

    async def dead_letters(self, thread: str) -> list[DeadLetter]:
        check_key(thread, "thread")
        self._backend._check_open()
        return sorted(self._dead.get(thread, {}).values(), key=lambda letter: letter.seq)

    async def drop_dead_letter(self, letter: DeadLetter) -> bool:
        check_key(letter.thread, "thread")
        self._backend._check_open()
        return self._dead.get(letter.thread, {}).pop(letter.id, None) is not None

    async def release_if_empty(self, key: str, owner: str, token: int, thread: str) -> bool:
        check_key(key)
        check_owner(owner)
        check_key(thread, "thread")
        self._backend._check_open()
        if not self._backend._holds(key, owner, token) or self._messages.get(thread):
            return False
        self._backend._set(key, None, "released")
        self._woken.discard(thread)
        return True

    async def cancel_pending(self, key: str, thread: str) -> int:
        check_key(key)
        check_key(thread, "thread")
        self._backend._check_open()
        waiting = self._messages.get(thread, {})
        held = self._backend._holder(key) is not None
        dropped = sorted(waiting)[1:] if held else list(waiting)
        for seq in dropped:
            self._remove(waiting[seq])
        if not held:
            self._woken.discard(thread)
        return len(dropped)

    async def abort(self, key: str, thread: str) -> bool:
        check_key(key)
        check_key(thread, "thread")
        self._backend._check_open()
        tenure = self._backend._holder(key)
        if tenure is None:
            return False
        self._aborts[thread] = tenure.token
        if (signal := self._abort_signals.pop(thread, None)) is not None:
            signal.set()
        return True

    async def aborted(self, thread: str, token: int) -> None:
        check_key(thread, "thread")
        while self._aborts.get(thread) != token:
            await self._abort_signals.setdefault(thread, asyncio.Event()).wait()

    async def watch_threads(self) -> AsyncGenerator[str, None]:
        self._backend._check_open()
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._thread_watchers.add(queue)
        try:
            for name, waiting in list(self._messages.items()):
                if waiting and name in self._woken:
                    yield name
            while (appended_to := await queue.get()) is not None:
                yield appended_to
            raise ProviderClosed("the provider was closed")
        finally:
            self._thread_watchers.discard(queue)

    def close(self) -> None:
        """End every watch with ``ProviderClosed`` (called when the provider closes)."""
        for queues in self._watchers.values():
            for queue in queues:
                queue.put_nowait(None)
        for threads in self._thread_watchers:
            threads.put_nowait(None)
