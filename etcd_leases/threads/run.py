"""A thread's runs: take the thread, run the handler, then hand off or release.

How a run ends decides whether a message can be stranded, so it is done in one of
two atomic steps, never a plain release:

- the inbox is empty: ``release_if_empty`` frees the thread in the same transaction
  that checks the inbox is still empty. A message sent a moment earlier makes it
  fail (and the thread is handed off below); one sent a moment later finds the
  thread free, so its sender, or a serving worker, starts the next run.
- messages are waiting: the lease is transferred to a follow-up run of this
  process (``transfer_lease``: the thread is never free in between), which reads
  the inbox afresh and handles them.

The hand-off (transfer, then adopting the tenure) is one step a cancel cannot split:
it runs to its end, and only then is a cancel that came meanwhile let through, by
ending the follow-up's tenure like any cancelled hold, which gives the thread back.
A cancel mid-way would otherwise leave the key with a follow-up owner that nothing
keeps alive or releases, blocking the thread for a whole TTL.

An abort (``Threads.abort``, from any process) is not a cancel of the run: it cancels
the handler of the tenure it names, the run acknowledges the messages that handler
was handed and had not acknowledged, and then ends as above.
"""

from __future__ import annotations

import asyncio
import logging
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace

from etcd_leases.errors import LeaseError, LeaseLost
from etcd_leases.hold import HeldLease, adopt, hold
from etcd_leases.inbox import InboxProvider
from etcd_leases.threads.messages import ThreadMessages
from etcd_leases.threads.retries import Retries

_log = logging.getLogger("etcd_leases.threads")

#: ``handler(thread, lease, messages)``: one run of a thread (see :class:`ThreadMessages`).
Handler = Callable[[str, HeldLease, ThreadMessages], Awaitable[None]]


@dataclass(frozen=True)
class ThreadRunner:
    """Runs one thread: its first run and every follow-up, until the thread is released.

    ``new_owner()`` names each run (owners are unique per run, so a frozen run never
    passes for a later one); ``key`` is the thread's lease key.
    """

    provider: InboxProvider
    handler: Handler
    thread: str
    key: str
    new_owner: Callable[[], str]
    ttl_ms: int
    linger: float
    retries: Retries

    async def run(self) -> None:
        """Take the thread (``LeaseHeld`` if someone holds it) and run it until released.

        Raises ``LeaseLost`` if a run lost the thread (its messages stay in the inbox
        for whoever takes it next), or the handler's own exception (the thread is
        released; its unacknowledged messages are delivered to the next run).
        """
        # The stack holds the current tenure only: a hand-off swaps it for the next.
        async with AsyncExitStack() as tenure:
            first = hold(self.provider, self.key, self.new_owner(), self.ttl_ms)
            lease: HeldLease | None = await tenure.enter_async_context(first)
            while lease is not None:
                await self._run_once(lease)
                lease = await self._end(lease, tenure)

    async def _run_once(self, lease: HeldLease) -> None:
        """The handler, with the run's messages, unless an abort came first."""
        messages = ThreadMessages(self.provider.inbox, lease, self.thread, self.linger)
        aborted = asyncio.ensure_future(self._aborted(lease))
        try:
            if await self._first_delivery(lease, messages, aborted) and not aborted.done():
                await self._handle(lease, messages, aborted)
        finally:
            aborted.cancel()
            await messages.close()
            await asyncio.gather(aborted, return_exceptions=True)

    async def _handle(
        self, lease: HeldLease, messages: ThreadMessages, aborted: asyncio.Future[None]
    ) -> None:
        """Run the handler; cancel it (``LeaseLost``) the moment the run loses the
        thread, once it has run ``run_deadline_s``, or when the run is aborted: then
        the messages it was handed and had not acknowledged are acknowledged for it."""
        work = asyncio.ensure_future(self.handler(self.thread, lease, messages))
        lost = asyncio.ensure_future(lease.lost.wait())
        try:
            deadline = self.retries.run_deadline_s
            done, _ = await asyncio.wait(
                (work, lost, aborted), timeout=deadline, return_when=FIRST_COMPLETED
            )
            if aborted in done and not work.done():
                messages.aborted = True
                _log.info("thread %r: %s aborted", self.thread, lease.owner)
            elif not done:
                _log.warning(
                    "thread %r: the handler of %s ran past its %g s deadline: cancelled",
                    *(self.thread, lease.owner, deadline),
                )
        finally:
            for task in (work, lost):
                task.cancel()
            await messages.close()  # first: a handler in a thread may be waiting on it
            await asyncio.gather(work, lost, return_exceptions=True)
        if messages.aborted:
            for message in sorted(messages.handed.values(), key=lambda m: m.seq):
                await messages.ack(message)  # an aborted message is done with
            return
        if not work.cancelled():
            work.result()  # the handler's own exception, if any
        lease.check()  # raises LeaseLost if the handler was cut short by the loss

    async def _aborted(self, lease: HeldLease) -> None:
        """Once ``abort`` names this run's tenure (never, if that cannot be watched)."""
        try:
            await self.provider.inbox.aborted(self.thread, lease.token)
        except LeaseError as exc:
            _log.warning("thread %r: %s cannot be aborted: %s", self.thread, lease.owner, exc)
            await asyncio.Event().wait()

    async def _first_delivery(
        self, lease: HeldLease, messages: ThreadMessages, aborted: asyncio.Future[None]
    ) -> bool:
        """Count the delivery of the message first in line, back off before a retry
        (an abort ends it), and dead-letter it past ``max_attempts``; whether a message
        is left to deliver."""
        inbox, limit = self.provider.inbox, self.retries.max_attempts
        while (first := await messages.first()) is not None:
            if limit is None:
                return True
            attempt = await inbox.deliver(lease.key, lease.owner, lease.token, first)
            if not attempt:
                raise LeaseLost(f"{lease.owner!r} lost {self.thread!r} before delivering")
            if attempt <= limit:
                messages.replace_first(replace(first, attempt=attempt))
                if backoff := self.retries.backoff(attempt):
                    lost = asyncio.ensure_future(lease.lost.wait())
                    try:
                        await asyncio.wait(
                            (lost, aborted), timeout=backoff, return_when=FIRST_COMPLETED
                        )
                    finally:
                        lost.cancel()
                lease.check()
                return True
            failed = attempt - 1
            if not await inbox.dead_letter(lease.key, lease.owner, lease.token, first, failed):
                raise LeaseLost(f"{lease.owner!r} lost {self.thread!r} before dead-lettering")
            _log.warning(
                "thread %r: message %d was delivered %d times, never acknowledged: "
                "moved to the dead letters",
                *(self.thread, first.seq, failed),
            )
            messages.replace_first(None)
        return False

    async def _end(self, lease: HeldLease, tenure: AsyncExitStack) -> HeldLease | None:
        """Release the thread if its inbox is empty, else hand it to a follow-up run."""
        inbox = self.provider.inbox
        if await lease.release_with(
            lambda: inbox.release_if_empty(self.key, lease.owner, lease.token, self.thread)
        ):
            return None
        handing_off = asyncio.ensure_future(self._hand_off(lease, tenure))
        cancelled = False
        while not handing_off.done():
            try:
                await asyncio.shield(handing_off)
            except asyncio.CancelledError:
                cancelled = True
        follow_up = handing_off.result()
        if cancelled:  # the exit of ``tenure`` gives the thread back
            raise asyncio.CancelledError
        return follow_up

    async def _hand_off(self, lease: HeldLease, tenure: AsyncExitStack) -> HeldLease:
        """Transfer the thread to a follow-up run and adopt it into ``tenure``."""
        follow_up = self.new_owner()
        try:
            await lease.transfer(follow_up)
        except LeaseLost:
            _log.warning("thread %r: %s lost it before handing it off", self.thread, lease.owner)
            raise
        _log.info("thread %r: %s handed off to %s", self.thread, lease.owner, follow_up)
        await tenure.pop_all().aclose()  # the handed-on tenure: nothing left to release
        return await tenure.enter_async_context(
            adopt(self.provider, self.key, follow_up, self.ttl_ms)
        )
