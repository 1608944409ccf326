"""What a run's handler iterates over: its thread's messages, acknowledged one by one."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from etcd_leases.errors import LeaseError, LeaseLost, LeaseValueError
from etcd_leases.hold import HeldLease
from etcd_leases.inbox import Inbox, Message


class ThreadMessages:
    """The messages of one run, in the order their sends were acknowledged.

    ``async for message in messages`` yields every message waiting when the run
    started, then each one sent while it runs (delivered by watch, within
    milliseconds); :meth:`take_waiting` takes those queued now without waiting.
    Iteration ends once nothing is waiting and nothing arrived for ``linger``
    seconds; a message that arrives later goes to a follow-up run.
    ``await messages.ack(message)`` removes it, fenced by the run's token: it raises
    :class:`LeaseLost` once the run has lost its thread. Each ack also drops from the
    run's queue the messages ``cancel_pending`` deleted meanwhile, so a handler that
    acknowledges each message before asking for the next is never handed one.
    """

    def __init__(self, inbox: Inbox, lease: HeldLease, thread: str, linger: float) -> None:
        self.thread = thread
        self._inbox = inbox
        self._lease = lease
        self._linger = linger
        self._waiting: deque[Message] = deque()
        self._arrived = asyncio.Event()
        self._started = asyncio.Event()  # the first batch (what was waiting) is in
        self._error: LeaseError | None = None
        self._closed = False
        #: Handed to the handler, not yet acknowledged: what an abort drops.
        self.handed: dict[int, Message] = {}
        #: Set when the run was aborted (a blocking handler sees it here).
        self.aborted = False
        self._pump = asyncio.get_running_loop().create_task(self._receive())

    async def _receive(self) -> None:
        try:
            async with contextlib.aclosing(self._inbox.watch(self.thread)) as batches:
                async for batch in batches:
                    self._waiting.extend(batch)
                    self._started.set()
                    self._arrived.set()
        except LeaseError as exc:
            self._error = exc
        self._started.set()
        self._arrived.set()

    async def first(self) -> Message | None:
        """The message first in line, before the handler starts (``None``: none)."""
        await self._started.wait()
        return self._waiting[0] if self._waiting else None

    def replace_first(self, message: Message | None) -> None:
        """Put ``message`` (the first, with its attempt) first in line, or drop the first."""
        self._waiting.popleft()
        if message is not None:
            self._waiting.appendleft(message)

    def take_waiting(self) -> list[Message]:
        """Every message queued for this run now, without waiting, each handed to the
        caller as if iterated: for a handler busy with one message (an agent loop
        between two steps) that takes in those sent since. Acknowledge each as usual."""
        if self._closed:
            return []
        taken = list(self._waiting)
        self._waiting.clear()
        self.handed.update((message.seq, message) for message in taken)
        return taken

    def __aiter__(self) -> AsyncIterator[Message]:
        return self

    async def __anext__(self) -> Message:
        await self._started.wait()
        self._lease.check()
        if not self._waiting and self._error is None and not self._closed:
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._linger):
                    await self._arrived.wait()
            self._lease.check()
        if self._waiting and not self._closed:
            message = self._waiting.popleft()
            self.handed[message.seq] = message
            return message
        if self._error is not None:
            raise self._error
        raise StopAsyncIteration

    async def ack(self, message: Message) -> None:
        """Remove ``message`` from the inbox, only while this run holds the thread."""
        if message.thread != self.thread:
            raise LeaseValueError(
                f"message {message.seq} of thread {message.thread!r} is not {self.thread!r}'s: "
                "a run acknowledges only its own thread's messages"
            )
        lease = self._lease
        acked = None
        if lease.remaining() > 0:
            acked = await self._inbox.ack(lease.key, lease.owner, lease.token, message)
        if acked is None:
            raise LeaseLost(
                f"{lease.owner!r} lost {self.thread!r} before acknowledging message {message.seq}"
            )
        self.handed.pop(message.seq, None)
        while self._waiting and acked.removed(self._waiting[0].seq):
            self._waiting.popleft()  # cancelled meanwhile

    async def close(self) -> None:
        """End the iteration (a handler still waiting sees its end) and the watch."""
        self._closed = True
        self._started.set()
        self._arrived.set()
        self._pump.cancel()
        await asyncio.gather(self._pump, return_exceptions=True)
