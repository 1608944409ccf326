"""Delivery modes of agent threads, on the in-memory model and on etcd: quiet sends
(``wake=False``), ``wake``, ``abort`` and ``cancel_pending``. Across processes:
tests/test_thread_delivery_processes.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from etcd_leases import HeldLease, LeaseValueError, hold
from etcd_leases.threads import ThreadMessages, Threads
from tests.conftest import Live, eventually


@dataclass
class Gated:
    """A handler that holds each message ``hold`` until ``go`` is set, recording all."""

    handled: list[tuple[str, str, int]] = field(default_factory=list)  # thread, text, token
    acked: list[str] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)  # tokens of runs cut short
    holding: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)
    messages: ThreadMessages | None = None  # the last run's

    def queued(self) -> list[str]:
        """What the last run has received and not handed to the handler yet."""
        return [] if self.messages is None else [m.text for m in self.messages._waiting]

    def texts(self, thread: str) -> list[str]:
        return [text for name, text, _ in self.handled if name == thread]

    async def __call__(self, thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        self.messages = messages
        try:
            async for message in messages:
                self.handled.append((thread, message.text, lease.token))
                if message.text == "hold":
                    self.holding.set()
                    await self.go.wait()
                await messages.ack(message)
                self.acked.append(message.text)
        except asyncio.CancelledError:
            self.cancelled.append(lease.token)
            raise


@contextlib.asynccontextmanager
async def serving(threads: Threads) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(threads.serve(stop))
    try:
        yield
    finally:
        stop.set()
        await task


async def test_a_quiet_send_starts_no_run_until_the_thread_is_woken(live: Live) -> None:
    handler = Gated()
    threads = Threads(live.provider, handler, ttl_ms=5000)
    await threads.send("quiet", "first", wake=False)
    async with serving(threads):
        await threads.send("quiet", "second", wake=False)
        # A waking send to another thread, after both: once it is handled, the worker
        # has seen every wake there was, and the quiet thread's was none.
        await threads.send("loud", "x")
        await eventually(lambda: handler.texts("loud") == ["x"], "the waking send handled")
        assert handler.texts("quiet") == []
        assert [m.text for m in await live.provider.inbox.pending("quiet")] == ["first", "second"]
        assert await live.provider.get_lease_owner(threads.key("quiet")) is None
        assert await threads.wake("quiet")
        await eventually(lambda: handler.texts("quiet") == ["first", "second"], "woken")
        # Handed over is not done with: stopping before "second" is acknowledged would
        # leave it waiting (seen once in CI).
        await eventually(lambda: handler.acked[-2:] == ["first", "second"], "acknowledged")
    assert not await threads.wake("quiet")  # nothing waits: nothing to wake


async def test_a_waking_send_takes_the_quiet_messages_before_it_along(live: Live) -> None:
    handler = Gated()
    threads = Threads(live.provider, handler, ttl_ms=5000)
    await threads.send("t", "quiet", wake=False)
    await threads.send("t", "loud", run=True)
    assert handler.texts("t") == ["quiet", "loud"]
    # The run released the thread, and its wake with it: a quiet send stays quiet.
    await threads.send("t", "later", wake=False)
    assert await live.provider.inbox.count_woken("t") == 0
    assert await live.provider.inbox.count_pending("t") == 1


async def test_a_quiet_send_reaches_the_run_active_now(live: Live) -> None:
    handler = Gated()
    threads = Threads(live.provider, handler, ttl_ms=5000)
    await threads.send("t", "hold")
    running = asyncio.create_task(threads.run("t"))
    await asyncio.wait_for(handler.holding.wait(), 10)
    await threads.send("t", "during", wake=False)
    handler.go.set()
    assert await asyncio.wait_for(running, 10)
    assert handler.texts("t") == ["hold", "during"]
    assert handler.acked == ["hold", "during"]


async def test_run_true_with_wake_false_is_refused(live: Live) -> None:
    threads = Threads(live.provider, Gated())
    with pytest.raises(LeaseValueError, match="wake=False"):
        await threads.send("t", "x", run=True, wake=False)
    assert await live.provider.inbox.pending("t") == []


async def test_cancel_pending_keeps_the_message_being_handled(live: Live) -> None:
    handler = Gated()
    threads = Threads(live.provider, handler, ttl_ms=5000)
    await threads.send("t", "hold")
    running = asyncio.create_task(threads.run("t"))
    await asyncio.wait_for(handler.holding.wait(), 10)
    for text in ("a", "b", "c"):
        await threads.send("t", text)
    # The run has a, b, c queued (without this wait, it received them only after they
    # were gone now and then, and a run that never drops what was cancelled passed).
    await eventually(lambda: handler.queued() == ["a", "b", "c"], "a, b, c queued")
    assert await threads.cancel_pending("t") == 3
    assert [m.text for m in await live.provider.inbox.pending("t")] == ["hold"]
    handler.go.set()
    assert await asyncio.wait_for(running, 10)
    # The ack of "hold" told the run that a, b, c were gone.
    assert handler.texts("t") == ["hold"]
    assert handler.acked == ["hold"]
    assert await live.provider.get_lease_owner(threads.key("t")) is None


async def test_cancel_pending_on_a_free_thread_drops_everything(live: Live) -> None:
    handler = Gated()
    threads = Threads(live.provider, handler, ttl_ms=5000)
    for text in ("a", "b"):
        await threads.send("t", text, wake=False)
    await threads.send("t", "c")
    assert await threads.cancel_pending("t") == 3
    assert await threads.cancel_pending("t") == 0
    assert await live.provider.inbox.pending("t") == []
    assert await live.provider.inbox.count_woken("t") == 0
    await threads.send("t", "d", run=True)  # the thread works on afterwards
    assert handler.texts("t") == ["d"]


async def test_abort_cancels_the_handler_and_frees_the_thread(live: Live) -> None:
    handler = Gated()
    threads = Threads(live.provider, handler, ttl_ms=5000)
    other = Threads(live.another(), Gated())  # another client (process) aborts
    assert not await other.abort("t")  # nobody runs it
    await threads.send("t", "hold")
    running = asyncio.create_task(threads.run("t"))
    await asyncio.wait_for(handler.holding.wait(), 10)
    token = handler.handled[0][2]
    assert await other.abort("t")
    assert await asyncio.wait_for(running, 10)  # the run ends normally
    assert handler.cancelled == [token]
    assert handler.acked == []
    # The message being handled was dropped with the abort; the thread is free.
    assert await live.provider.inbox.pending("t") == []
    assert await live.provider.get_lease_owner(threads.key("t")) is None
    assert not await other.abort("t")


async def test_an_abort_stops_only_the_run_it_names(live: Live) -> None:
    handler = Gated()
    threads = Threads(live.provider, handler, ttl_ms=5000)
    await threads.send("t", "hold")
    await threads.send("t", "hold")  # waits behind: goes to the follow-up run
    running = asyncio.create_task(threads.run("t"))
    await asyncio.wait_for(handler.holding.wait(), 10)
    handler.holding.clear()
    assert await threads.abort("t")
    await asyncio.wait_for(handler.holding.wait(), 10)  # the follow-up run holds the other
    first, follow_up = (token for _, _, token in handler.handled)
    assert follow_up > first
    # Time for an abort that did not name its run to reach it (a correct one never does).
    await asyncio.sleep(0.3)
    assert handler.cancelled == [first]
    handler.go.set()
    assert await asyncio.wait_for(running, 10)
    assert handler.acked == ["hold"]
    # A later run, the earlier abort still on record: not stopped either.
    await threads.send("t", "last", run=True)
    assert handler.acked == ["hold", "last"]
    assert handler.cancelled == [first]


async def test_a_busy_handler_takes_in_the_messages_sent_since(live: Live) -> None:
    taken: list[str] = []
    busy = asyncio.Event()

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for message in messages:
            busy.set()
            while len(taken) < 2:  # an agent loop: between its steps, what came meanwhile
                taken.extend(m.text for m in messages.take_waiting())
                await asyncio.sleep(0.01)
            assert message.text == "first"
            for handed in list(messages.handed.values()):  # "first" and those taken
                await messages.ack(handed)

    threads = Threads(live.provider, handle, ttl_ms=5000)
    await threads.send("t", "first")
    running = asyncio.create_task(threads.run("t"))
    await asyncio.wait_for(busy.wait(), 10)
    await threads.send("t", "second", wake=False)
    await threads.send("t", "third")
    assert await asyncio.wait_for(running, 10)
    assert taken == ["second", "third"]
    assert await live.provider.inbox.pending("t") == []


async def test_an_abort_seen_before_its_run_waits_still_stops_it(live: Live) -> None:
    inbox = live.provider.inbox
    async with (
        hold(live.provider, "thread/other", "run-o", 5000) as other,
        hold(live.provider, "thread/t", "run-t", 5000) as held,
    ):
        waiting = asyncio.create_task(inbox.aborted("other", other.token))
        await asyncio.sleep(0)  # it waits: on etcd, the shared watch of aborts is up
        assert await inbox.abort("thread/t", "t")
        assert await inbox.abort("thread/other", "other")
        await asyncio.wait_for(waiting, 10)  # the watch has shown both aborts, in order
        await asyncio.wait_for(inbox.aborted("t", held.token), 10)
        # An abort of another tenure of the thread ends nothing.
        stale = asyncio.create_task(inbox.aborted("t", held.token + 1))
        await asyncio.sleep(0.2)
        assert not stale.done()
        stale.cancel()
