"""Agent threads: every message sent to a thread reaches the one run that owns it.

Written against the contract and the inbox capability, so it runs on etcd and on the
in-memory model alike::

    threads = Threads(provider, handle, ttl_ms=15_000)
    await threads.send("chat:42", "hello")            # durable when it returns
    await threads.send("chat:42", "hi", run=True)     # serverless: run it here if idle
    await threads.send("chat:42", "fyi", wake=False)  # for a run active now, or the next
    await threads.abort("chat:42")                    # stop the run, wherever it runs
    await threads.cancel_pending("chat:42")           # drop what is queued
    await threads.serve()                             # a long-running worker
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import secrets
import socket

from etcd_leases.contract import check_key, check_owner, check_ttl_ms
from etcd_leases.dead_letters import DeadLetter
from etcd_leases.errors import (
    LeaseError,
    LeaseHeld,
    LeaseLost,
    LeaseTypeError,
    LeaseValueError,
    ProviderClosed,
)
from etcd_leases.inbox import (
    DEFAULT_MAX_PENDING,
    MAX_PAYLOAD_BYTES,
    InboxProvider,
    Message,
    check_max_pending,
    payload_bytes,
)
from etcd_leases.send_ids import (
    DEFAULT_MAX_PER_THREAD,
    DEFAULT_WINDOW_S,
    SendId,
    check_send_id_limits,
)
from etcd_leases.threads.retries import Retries
from etcd_leases.threads.run import Handler, ThreadRunner

_log = logging.getLogger("etcd_leases.threads")
# After a handler failed on a thread, how long a worker waits before running it again.
_RETRY_AFTER_S = 1.0


class Threads:
    """Send messages to threads and run them, one owner per thread.

    ``handler(thread, lease, messages)`` is one run of a thread: it iterates over
    ``messages`` (see :class:`~etcd_leases.threads.ThreadMessages`) and acknowledges
    each with ``await messages.ack(message)``; ``lease.token`` fences anything else
    it writes. The lease key of ``thread`` is ``namespace + thread``.

    A message not acknowledged is delivered again (see
    :mod:`etcd_leases.threads.retries`): after ``backoff_s`` (doubling up to
    ``max_backoff_s``), at most ``max_attempts`` times first in line of a run, then it
    goes to the thread's dead letters (``max_attempts=None``: retried for ever,
    uncounted). One handed later in a run is counted from the next run: it can be
    handed once more.
    ``run_deadline_s`` cancels a handler that runs longer.
    """

    def __init__(
        self,
        provider: object,
        handler: Handler,
        *,
        worker: str | None = None,
        ttl_ms: int = 15_000,
        linger: float = 0.0,
        max_pending: int = DEFAULT_MAX_PENDING,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        namespace: str = "thread/",
        send_id_window_s: float = DEFAULT_WINDOW_S,
        max_send_ids: int = DEFAULT_MAX_PER_THREAD,
        max_attempts: int | None = 5,
        backoff_s: float = 0.1,
        max_backoff_s: float = 30.0,
        run_deadline_s: float | None = None,
    ) -> None:
        if not isinstance(provider, InboxProvider):
            raise LeaseTypeError(
                f"{type(provider).__name__} cannot run threads: it needs the hold "
                "capabilities and an inbox (see etcd_leases.inbox.InboxProvider)"
            )
        worker = worker or f"{socket.gethostname()}:{os.getpid()}"
        check_owner(worker, "worker")
        check_ttl_ms(ttl_ms)
        check_max_pending(max_pending)
        if not 0 <= linger < float("inf"):
            raise LeaseValueError(f"linger must be a number of seconds >= 0, got {linger!r}")
        if not 0 < max_payload_bytes <= MAX_PAYLOAD_BYTES:
            raise LeaseValueError(f"max_payload_bytes must be in 1 ..= {MAX_PAYLOAD_BYTES}")
        check_send_id_limits(send_id_window_s, max_send_ids)
        self.retries = Retries(max_attempts, backoff_s, max_backoff_s, run_deadline_s)
        if not isinstance(namespace, str):
            raise LeaseTypeError(f"namespace must be a str, not {type(namespace).__name__}")
        self.provider = provider
        self.handler = handler
        self.worker = worker
        self.ttl_ms = ttl_ms
        self.linger = linger
        self.max_pending = max_pending
        self.max_payload_bytes = max_payload_bytes
        self.namespace = namespace
        self.send_id_window_s = send_id_window_s
        self.max_send_ids = max_send_ids
        # Owners are unique per run, even across restarts of a worker of the same name:
        # a run that was frozen must never pass for a later one.
        self._runs = (f"{worker}/{secrets.token_hex(3)}-{n}" for n in itertools.count(1))
        self._tenders: dict[str, asyncio.Task[None]] = {}
        self._poked: set[str] = set()

    def key(self, thread: str) -> str:
        """The lease key of ``thread``."""
        check_key(thread, "thread")
        key = self.namespace + thread
        check_key(key, "namespace + thread")
        return key

    async def send(
        self,
        thread: str,
        payload: str | bytes,
        *,
        run: bool = False,
        send_id: str | None = None,
        wake: bool = True,
    ) -> Message:
        """Store ``payload`` at the end of ``thread``'s inbox; durable when this returns.

        A run active on the thread receives it by watch, within milliseconds, whatever
        ``wake`` says. If no run holds the thread: ``wake=True`` (default) starts one,
        here in this call with ``run=True`` (the serverless case), else in a serving
        worker; ``wake=False`` starts none: the message waits for the next run that
        starts for another reason (a waking send, :meth:`wake`, :meth:`run`). Raises
        ``InboxFull`` when ``max_pending`` messages are waiting, ``ValueError`` for an
        oversized payload or ``run=True`` with ``wake=False``.

        ``send_id`` (chosen by the caller, say a request id) makes the send
        idempotent: another send to ``thread`` with the same id, within
        ``send_id_window_s`` and among its last ``max_send_ids`` ids, stores nothing
        and returns the first send's message with ``duplicate`` set, even once that
        message has been handled.
        """
        self.key(thread)  # refuse a thread name that makes no lease key, before writing
        data = payload_bytes(payload, self.max_payload_bytes)
        if run and not wake:
            raise LeaseValueError("run=True runs the thread, so it cannot go with wake=False")
        once = None
        if send_id is not None:
            once = SendId(send_id, self.send_id_window_s, self.max_send_ids)
        message = await self.provider.inbox.append(thread, data, self.max_pending, once, wake)
        if run:
            await self.run(thread)
        return message

    async def run(self, thread: str) -> bool:
        """Run ``thread`` here until its inbox is empty, if no one else holds it.

        ``False`` when another run holds the thread (it receives the messages);
        ``True`` once this call's runs have ended. Raises ``LeaseLost`` if a run lost
        the thread, or the handler's exception.
        """
        runner = ThreadRunner(
            self.provider,
            self.handler,
            thread,
            self.key(thread),
            lambda: next(self._runs),
            self.ttl_ms,
            self.linger,
            self.retries,
        )
        try:
            await runner.run()
        except LeaseHeld:
            return False
        return True

    async def wake(self, thread: str) -> bool:
        """Have a serving worker run ``thread`` if messages wait in it (say, sent with
        ``wake=False``); whether any did."""
        self.key(thread)
        return await self.provider.inbox.wake(thread)

    async def abort(self, thread: str) -> bool:
        """Cancel the handler of the run holding ``thread`` now, wherever it runs.

        The handler sees ``CancelledError`` within milliseconds (its run watches for
        aborts; a blocking handler's messages end and ``messages.aborted`` is set).
        The messages it was handed and had not acknowledged are acknowledged for it:
        an abort is the caller's word that they are done with. The run then ends as
        usual: the thread is released, or handed to a follow-up run for the messages
        still waiting (``cancel_pending`` drops those). The abort names the run's
        tenure (its token): it never stops a later run of the thread. ``False`` when
        no run held the thread; ``True`` when one did, even if its handler had
        already returned.
        """
        return await self.provider.inbox.abort(self.key(thread), thread)

    async def cancel_pending(self, thread: str) -> int:
        """Delete, in one step, the messages waiting in ``thread``'s inbox; how many.

        While a run holds the thread, the first message in line is kept: it is the
        one its handler is handling (a handler that acknowledges each message before
        asking for the next is never handed a cancelled one). Dead letters stay.
        """
        return await self.provider.inbox.cancel_pending(self.key(thread), thread)

    async def dead_letters(self, thread: str) -> list[DeadLetter]:
        """``thread``'s messages that failed ``max_attempts`` deliveries, in seq order."""
        return await self.provider.inbox.dead_letters(thread)

    async def retry_dead_letter(self, letter: DeadLetter, *, run: bool = False) -> Message:
        """Send ``letter`` again, at the end of its thread's inbox, and drop it.

        Safe to repeat (say, after a crash in between): the send carries an id of the
        letter, so it is stored once within ``send_id_window_s``.
        """
        once = "retry:" + hashlib.sha256(letter.id.encode("utf-8", "surrogateescape")).hexdigest()
        message = await self.send(letter.thread, letter.payload, send_id=once)
        await self.provider.inbox.drop_dead_letter(letter)
        if run:
            await self.run(letter.thread)
        return message

    async def drop_dead_letter(self, letter: DeadLetter) -> bool:
        """Delete ``letter`` for good; whether it was there."""
        return await self.provider.inbox.drop_dead_letter(letter)

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Run every woken thread that has messages waiting and no live owner, until
        ``stop``.

        Watches the threads' wake marks (set by waking sends and :meth:`wake`, cleared
        when a run releases its thread): a thread whose run is elsewhere is left to it,
        and taken over if its owner dies (its lease expires) with messages waiting.
        Stopping cancels the runs here; their threads are released for others.
        """
        stop = stop or asyncio.Event()
        watching = asyncio.ensure_future(self._watch_threads())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait((watching, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            tasks = [watching, stopped, *self._tenders.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if watching.done() and not watching.cancelled():
            watching.result()  # the watch's error (a closed provider, refused access)

    async def _watch_threads(self) -> None:
        async with contextlib.aclosing(self.provider.inbox.watch_threads()) as threads:
            async for thread in threads:
                if thread in self._tenders:
                    self._poked.add(thread)
                else:
                    self._tenders[thread] = asyncio.ensure_future(self._tend(thread))

    async def _tend(self, thread: str) -> None:
        """Run ``thread`` whenever it is woken, has messages and is free, until not."""
        try:
            while True:
                self._poked.discard(thread)
                try:
                    if not await self.provider.inbox.count_woken(thread):
                        if thread in self._poked:
                            continue  # a message came during the read
                        return
                    if not await self.run(thread):
                        await self._wait_until_free(thread)
                except LeaseLost as exc:
                    _log.warning("thread %r: a run lost it: %s", thread, exc)
                except ProviderClosed:
                    return
                except LeaseError as exc:  # etcd unreachable, a stalled call: try again
                    _log.warning("thread %r: %s; trying again", thread, exc)
                    await asyncio.sleep(_RETRY_AFTER_S)
                except Exception:
                    _log.exception("thread %r: the handler failed", thread)
                    await asyncio.sleep(_RETRY_AFTER_S)
        finally:
            self._tenders.pop(thread, None)

    async def _wait_until_free(self, thread: str) -> None:
        """Until the thread's owner releases it, or dies and its lease expires."""
        states = self.provider.watch_owner(self.key(thread))
        async with contextlib.aclosing(states):
            async for state in states:
                if state.owner is None:
                    return
