"""A serving worker (``Threads.serve``): every woken thread runs, again and again, here
or where its owner is; on the in-memory model and on etcd."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest

from etcd_leases import HeldLease
from etcd_leases.threads import ThreadMessages, Threads
from tests.conftest import Live, eventually
from tests.test_threads import Handled, recorder


async def _serving(threads: Threads) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    return stop, asyncio.create_task(threads.serve(stop))


async def test_serve_runs_a_thread_each_time_it_is_woken_after_its_runs_ended(
    live: Live,
) -> None:
    handled = Handled()
    threads = Threads(live.provider, recorder(handled), ttl_ms=5000)
    stop, serving = await _serving(threads)
    await threads.send("t", "first")
    await eventually(lambda: handled.payloads("t") == ["first"], "the first message ran")
    # The worker is done with the thread: nothing waits, nothing tends it.
    await eventually(lambda: "t" not in threads._tenders, "the thread's tender ended")
    await threads.send("t", "second")
    await eventually(lambda: handled.payloads("t") == ["first", "second"], "a second run")
    assert len(handled.runs) == 2
    stop.set()
    await serving


async def test_serve_runs_a_thread_again_after_its_handler_failed(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    runs: list[str] = []

    async def fails_once(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for message in messages:
            runs.append(message.text)
            if len(runs) == 1:
                raise RuntimeError("the model is down")
            await messages.ack(message)

    threads = Threads(live.provider, fails_once, ttl_ms=5000)
    with caplog.at_level(logging.ERROR, logger="etcd_leases.threads"):
        stop, serving = await _serving(threads)
        await threads.send("t", "m")  # woken once: the worker tries again by itself
        await eventually(lambda: runs == ["m", "m"], "the message ran again")
        await eventually(lambda: "t" not in threads._tenders, "the thread's tender ended")
        stop.set()
        await serving
    ours = [r.getMessage() for r in caplog.records if r.name == "etcd_leases.threads"]
    assert ours == ["thread 't': the handler failed"]
    assert await live.provider.inbox.pending("t") == []


async def test_serve_waits_for_the_owner_elsewhere_quietly_then_takes_the_thread(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    handled = Handled()
    threads = Threads(live.provider, recorder(handled), ttl_ms=5000)
    results: list[bool] = []
    run = threads.run

    async def counted_run(thread: str) -> bool:
        results.append(await run(thread))
        return results[-1]

    threads.run = counted_run  # type: ignore[method-assign]
    other = live.another()
    assert (await other.acquire_lease(threads.key("t"), "elsewhere", 30_000)).acquired
    with caplog.at_level(logging.WARNING, logger="etcd_leases.threads"):
        stop, serving = await _serving(threads)
        await threads.send("t", "m")
        await eventually(lambda: results == [False], "the worker found the thread held")
        # It waits for the owner to let go; it does not try again and again.
        await asyncio.sleep(0.5)
        assert results == [False]
        await other.release_lease(threads.key("t"), "elsewhere")
        # Its run ends once the thread is empty (stopping first would cancel it).
        await eventually(lambda: results == [False, True], "the worker's run took the thread")
        stop.set()
        await serving
    assert handled.payloads("t") == ["m"]
    assert [r.getMessage() for r in caplog.records if r.name == "etcd_leases.threads"] == []


async def test_serve_runs_a_message_that_came_while_it_read_the_thread_empty(
    live: Live,
) -> None:
    """The race serve's ``_poked`` set is for: after a run, the worker reads whether the
    thread is still woken, and a waking send lands while that read is on its way."""
    handled = Handled()
    threads = Threads(live.provider, recorder(handled), ttl_ms=5000)
    inbox = live.provider.inbox
    count_woken: Callable[[str], Awaitable[int]] = inbox.count_woken
    reads = 0

    async def read_then_send(thread: str) -> int:
        nonlocal reads
        reads += 1
        woken = await count_woken(thread)
        if reads == 2:  # the read after the first run: nothing woken yet
            assert woken == 0
            await threads.send("t", "during the read")
            await eventually(lambda: "t" in threads._poked, "the worker saw the wake")
        return woken

    inbox.count_woken = read_then_send  # type: ignore[method-assign]
    stop, serving = await _serving(threads)
    await threads.send("t", "first")
    await eventually(
        lambda: handled.payloads("t") == ["first", "during the read"], "the second message ran"
    )
    stop.set()
    await serving


async def test_stopping_serve_ends_and_releases_its_runs_before_it_returns(live: Live) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def blocks(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for _ in messages:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

    threads = Threads(live.provider, blocks, ttl_ms=5000)
    stop, serving = await _serving(threads)
    await threads.send("t", "m")
    await asyncio.wait_for(started.wait(), 10)
    stop.set()
    await serving
    assert cancelled.is_set()
    assert await live.provider.get_lease_owner(threads.key("t")) is None
    assert len(await live.provider.inbox.pending("t")) == 1  # kept for the next run
