"""A run cancelled while it hands its thread on leaves the thread free (issue 15, part 1).

Against real etcd: cancels at random points of the hand-off, and at the two points
where the old hand-off could be split (the transfer committed, the follow-up's
tenure not yet kept alive), held there by an event the test controls.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from etcd_leases import EtcdLeaseProvider, HeldLease
from etcd_leases.testing import EtcdCluster
from etcd_leases.threads import ThreadMessages, Threads
from tests.conftest import unique_prefix

CANCELS = 40


class HandsOff:
    """A handler whose first run leaves its message, so the run ends in a hand-off."""

    def __init__(self) -> None:
        self.first_run_over = asyncio.Event()
        self.runs = 0

    async def __call__(self, thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        self.runs += 1
        if self.runs == 1:
            self.first_run_over.set()
            return
        async for message in messages:
            await messages.ack(message)


@pytest.fixture
async def provider(etcd: EtcdCluster) -> AsyncIterator[EtcdLeaseProvider]:
    provider = EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix())
    try:
        yield provider
    finally:
        await provider.close()


async def _cancelled(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_cancels_at_random_points_of_a_hand_off_leave_the_thread_free(
    provider: EtcdLeaseProvider,
) -> None:
    rng = random.Random(15)
    for attempt in range(CANCELS):
        handler = HandsOff()
        threads = Threads(provider, handler, ttl_ms=30_000)
        thread = f"cancel-{attempt}"
        await threads.send(thread, "left for the follow-up")
        running = asyncio.create_task(threads.run(thread))
        await handler.first_run_over.wait()
        # A hand-off is a few round trips to etcd: spread the cancels over them.
        await asyncio.sleep(rng.uniform(0, 0.01))
        await _cancelled(running)
        owner = await provider.get_lease_owner(threads.key(thread))
        assert owner is None, f"cancel {attempt}: {thread!r} still held by {owner!r}"
        if handler.runs == 1:  # the follow-up never ran: its message waits for the next
            assert len(await provider.inbox.pending(thread)) == 1


@pytest.mark.parametrize("step", ["transfer_lease", "renew_lease"])
async def test_a_cancel_between_transfer_and_adoption_leaves_the_thread_free(
    provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """The cancel lands while the hand-off waits, after ``step`` committed."""
    committed, go_on = asyncio.Event(), asyncio.Event()
    original: Callable[..., Awaitable[bool]] = getattr(provider, step)

    async def then_wait(*args: Any) -> bool:
        done = await original(*args)
        committed.set()
        await go_on.wait()
        return done

    handler = HandsOff()
    threads = Threads(provider, handler, ttl_ms=30_000)
    await threads.send("paused", "left for the follow-up")
    running = asyncio.create_task(threads.run("paused"))
    await handler.first_run_over.wait()
    monkeypatch.setattr(provider, step, then_wait)
    await committed.wait()
    running.cancel()
    await asyncio.sleep(0.05)  # the cancel has been delivered to the waiting hand-off
    go_on.set()
    await asyncio.gather(running, return_exceptions=True)
    assert running.cancelled()
    assert await provider.get_lease_owner(threads.key("paused")) is None
    assert len(await provider.inbox.pending("paused")) == 1
