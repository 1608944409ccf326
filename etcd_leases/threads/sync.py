"""Agent threads for threaded programs: the same recipe, with a blocking handler::

    from etcd_leases.sync import EtcdLeaseProvider
    from etcd_leases.threads.sync import Threads

    def handle(thread, lease, messages):          # runs in a worker thread
        for message in messages:
            reply(message.text)
            messages.ack(message)                 # LeaseLost once the run lost the thread

    with EtcdLeaseProvider("127.0.0.1:2379") as provider:
        threads = Threads(provider, handle)
        threads.send("chat:42", "hello", run=True)

A thread cannot be cancelled: a handler whose run lost its thread learns it from
``lease.lost``, ``lease.check()``, the next message or ``ack`` (``LeaseLost``); at
``run_deadline_s`` or an abort (``threads.abort(thread)``, from any process) its
messages end (the next one it asks for is none; ``messages.aborted`` says which) and
the run waits for it to return. The next run of the thread in this process starts
only after the handler has returned.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator
from typing import Any

from anyio.from_thread import BlockingPortal

from etcd_leases.dead_letters import DeadLetter
from etcd_leases.hold import HeldLease
from etcd_leases.inbox import Message
from etcd_leases.sync import SyncHeldLease, SyncLeaseProvider
from etcd_leases.threads.messages import ThreadMessages
from etcd_leases.threads.threads import Threads as AsyncThreads


class SyncThreadMessages:
    """A run's messages seen from the handler's thread (see :class:`ThreadMessages`)."""

    def __init__(self, portal: BlockingPortal, messages: ThreadMessages) -> None:
        self.thread = messages.thread
        self._portal = portal
        self._messages = messages

    def __iter__(self) -> Iterator[Message]:
        return self

    def __next__(self) -> Message:
        try:
            return self._portal.call(self._messages.__anext__)
        except StopAsyncIteration:
            raise StopIteration from None

    def ack(self, message: Message) -> None:
        """Remove ``message``, fenced by the run's token (``LeaseLost`` once it is lost)."""
        self._portal.call(self._messages.ack, message)

    def take_waiting(self) -> list[Message]:
        """Blocking :meth:`ThreadMessages.take_waiting`."""
        return self._portal.call(self._messages.take_waiting)

    @property
    def aborted(self) -> bool:
        """Whether the run was aborted: stop, the messages handed are done with."""
        return self._messages.aborted


#: ``handler(thread, lease, messages)``, called in a worker thread for each run.
SyncHandler = Callable[[str, SyncHeldLease, SyncThreadMessages], None]


class Threads:
    """Blocking :class:`etcd_leases.threads.Threads` over a sync provider; same options."""

    def __init__(self, provider: SyncLeaseProvider, handler: SyncHandler, **options: Any) -> None:
        self._portal = provider.portal
        self._handler = handler
        self.aio = AsyncThreads(provider.aio, self._run_in_thread, **options)
        self._stop = self._portal.call(self._new_event)

    @staticmethod
    async def _new_event() -> asyncio.Event:
        return asyncio.Event()

    async def _run_in_thread(self, thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        held = SyncHeldLease(self._portal, lease)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(
            None, self._handler, thread, held, SyncThreadMessages(self._portal, messages)
        )
        # Never start another run of the thread while this one runs, however often
        # the run is cancelled meanwhile.
        cancelled = False
        try:
            while not work.done():
                try:
                    await asyncio.shield(work)
                except asyncio.CancelledError:
                    cancelled = True
        finally:
            held._stop_mirroring()
        if cancelled:
            raise asyncio.CancelledError
        work.result()

    def key(self, thread: str) -> str:
        return self.aio.key(thread)

    def send(
        self,
        thread: str,
        payload: str | bytes,
        *,
        run: bool = False,
        send_id: str | None = None,
        wake: bool = True,
    ) -> Message:
        """Blocking :meth:`etcd_leases.threads.Threads.send`."""
        send = functools.partial(
            self.aio.send, thread, payload, run=run, send_id=send_id, wake=wake
        )
        return self._portal.call(send)

    def wake(self, thread: str) -> bool:
        """Blocking :meth:`etcd_leases.threads.Threads.wake`."""
        return self._portal.call(self.aio.wake, thread)

    def abort(self, thread: str) -> bool:
        """Blocking :meth:`etcd_leases.threads.Threads.abort`."""
        return self._portal.call(self.aio.abort, thread)

    def cancel_pending(self, thread: str) -> int:
        """Blocking :meth:`etcd_leases.threads.Threads.cancel_pending`."""
        return self._portal.call(self.aio.cancel_pending, thread)

    def dead_letters(self, thread: str) -> list[DeadLetter]:
        """Blocking :meth:`etcd_leases.threads.Threads.dead_letters`."""
        return self._portal.call(self.aio.dead_letters, thread)

    def retry_dead_letter(self, letter: DeadLetter, *, run: bool = False) -> Message:
        """Blocking :meth:`etcd_leases.threads.Threads.retry_dead_letter`."""
        return self._portal.call(functools.partial(self.aio.retry_dead_letter, letter, run=run))

    def drop_dead_letter(self, letter: DeadLetter) -> bool:
        """Blocking :meth:`etcd_leases.threads.Threads.drop_dead_letter`."""
        return self._portal.call(self.aio.drop_dead_letter, letter)

    def run(self, thread: str) -> bool:
        """Blocking :meth:`etcd_leases.threads.Threads.run`."""
        return self._portal.call(self.aio.run, thread)

    def serve(self) -> None:
        """Blocking :meth:`etcd_leases.threads.Threads.serve`, until :meth:`stop`."""

        async def serve() -> None:
            self._stop.clear()
            await self.aio.serve(self._stop)

        self._portal.call(serve)

    def stop(self) -> None:
        """Make :meth:`serve` return (its runs are cancelled, their threads released)."""
        self._portal.call(self._set_stop)

    async def _set_stop(self) -> None:
        self._stop.set()
