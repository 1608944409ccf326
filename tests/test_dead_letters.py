"""Poison messages and hung handlers (issue 15, part 2), on the in-memory model and etcd:
delivery counts that survive takeovers, backoff, dead letters, the run deadline."""

from __future__ import annotations

import asyncio
import time

import pytest

from etcd_leases import EtcdLeaseProvider, HeldLease, LeaseProvider, LeaseValueError
from etcd_leases.threads import Message, ThreadMessages, Threads
from etcd_leases.threads.retries import Retries
from tests.conftest import ETCD_BINARIES, EtcdMembers, Live, eventually, unique_prefix


class Poisoned:
    """Acknowledges every message but ``poison``, which it leaves (or raises on)."""

    def __init__(self, *, raises: bool = False) -> None:
        self.raises = raises
        self.seen: list[tuple[str, int, float]] = []  # payload, attempt, when

    async def __call__(self, thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for message in messages:
            self.seen.append((message.text, message.attempt, time.monotonic()))
            if message.text == "poison":
                if self.raises:
                    raise RuntimeError("poison")
                return
            await messages.ack(message)

    def attempts(self, payload: str) -> list[int]:
        return [attempt for text, attempt, _ in self.seen if text == payload]


async def test_a_poison_message_goes_to_the_dead_letters_after_max_attempts(live: Live) -> None:
    handler = Poisoned()
    threads = Threads(live.provider, handler, ttl_ms=5000, max_attempts=3, backoff_s=0.05)
    await threads.send("t", "poison")
    await threads.send("t", "after")
    assert await threads.run("t")
    assert handler.attempts("poison") == [1, 2, 3]
    assert handler.attempts("after") == [1]  # only once the poison was out of the way
    assert [text for text, _, _ in handler.seen].index("after") == 3
    (letter,) = await threads.dead_letters("t")
    assert (letter.text, letter.seq, letter.attempts) == ("poison", 1, 3)
    assert await live.provider.inbox.pending("t") == []
    assert await live.provider.get_lease_owner(threads.key("t")) is None
    # Backoff: the second delivery 0.05 s after the first, the third 0.1 s after that.
    times = [when for text, _, when in handler.seen if text == "poison"]
    assert times[1] - times[0] >= 0.05 and times[2] - times[1] >= 0.1


async def test_a_dead_letter_can_be_retried_once_or_dropped(live: Live) -> None:
    handler = Poisoned()
    threads = Threads(live.provider, handler, ttl_ms=5000, max_attempts=1, backoff_s=0)
    await threads.send("t", "poison")
    await threads.send("t", "poison")
    await threads.run("t")
    first, second = await threads.dead_letters("t")
    retried = await threads.retry_dead_letter(first)
    assert retried.seq == 3 and not retried.duplicate
    assert (await threads.retry_dead_letter(first)).duplicate  # a repeat stores nothing
    assert [m.seq for m in await live.provider.inbox.pending("t")] == [3]
    assert await threads.dead_letters("t") == [second]
    assert await threads.drop_dead_letter(second)
    assert not await threads.drop_dead_letter(second)
    assert await threads.dead_letters("t") == []


async def test_a_dead_letter_retried_with_run_is_delivered_at_once(live: Live) -> None:
    handler = Poisoned()
    threads = Threads(live.provider, handler, ttl_ms=5000, max_attempts=1, backoff_s=0)
    await threads.send("t", "poison")
    await threads.run("t")
    (letter,) = await threads.dead_letters("t")
    retried = await threads.retry_dead_letter(letter, run=True)
    assert handler.attempts("poison") == [1, 1]  # delivered anew, and left again
    (again,) = await threads.dead_letters("t")
    assert (again.seq, again.attempts) == (retried.seq, 1)


@pytest.mark.parametrize("version", ETCD_BINARIES)
async def test_a_dead_letter_under_a_root_with_an_0xff_byte_is_retried_once(
    version: str, etcd_members: EtcdMembers
) -> None:
    """A lease prefix without a trailing slash puts the inboxes under a root ending in an
    0xFF byte (so that no inbox key falls under a lease key): the dead letters' ids hold
    that byte, and retrying one, twice, still stores it once."""
    endpoints = etcd_members.get(ETCD_BINARIES[version]).endpoints
    async with EtcdLeaseProvider(endpoints, prefix=unique_prefix().rstrip("/")) as provider:
        threads = Threads(provider, Poisoned(), ttl_ms=5000, max_attempts=1, backoff_s=0)
        await threads.send("t", "poison")
        await threads.run("t")
        (letter,) = await threads.dead_letters("t")
        assert "\udcff" in letter.id  # the root's 0xFF byte, kept as is
        retried = await threads.retry_dead_letter(letter)
        assert (await threads.retry_dead_letter(letter)).duplicate
        assert [m.seq for m in await provider.inbox.pending("t")] == [retried.seq]


async def test_a_message_left_behind_another_is_counted_from_the_next_run(live: Live) -> None:
    """Only the message first in line of a run is counted (one write per run): one handed
    later and left unacknowledged is handed once more than ``max_attempts``."""
    handler = Poisoned()
    threads = Threads(live.provider, handler, ttl_ms=5000, max_attempts=1, backoff_s=0)
    await threads.send("t", "first")
    await threads.send("t", "poison")
    await threads.run("t")
    assert handler.attempts("first") == [1]
    assert handler.attempts("poison") == [1, 1]  # behind "first", then first in line
    (letter,) = await threads.dead_letters("t")
    assert (letter.text, letter.attempts) == ("poison", 1)


async def test_the_delivery_count_survives_a_takeover(live: Live) -> None:
    """A handler that raises ends its run; each next run, here or in another client,
    counts on from where the last one stopped."""
    handler = Poisoned(raises=True)
    options = {"ttl_ms": 5000, "max_attempts": 4, "backoff_s": 0.0}
    one = Threads(live.provider, handler, **options)  # type: ignore[arg-type]
    two = Threads(live.another(), handler, **options)  # type: ignore[arg-type]
    await one.send("t", "poison")
    for threads in (one, two, one, two):
        with pytest.raises(RuntimeError):
            await threads.run("t")
    assert handler.attempts("poison") == [1, 2, 3, 4]
    assert await two.run("t")  # the fifth delivery is not made: dead-lettered
    assert [letter.attempts for letter in await one.dead_letters("t")] == [4]


async def owner_other_than(
    provider: LeaseProvider, key: str, these: set[str | None], within: float = 10.0
) -> str | None:
    """The owner of ``key`` once it is none of ``these``; fail after ``within`` s."""
    deadline = time.monotonic() + within
    while (owner := await provider.get_lease_owner(key)) in these:
        assert time.monotonic() < deadline, f"{key!r} still held by {owner!r}"
        await asyncio.sleep(0.01)
    return owner


async def test_an_abort_ends_the_wait_before_a_retry(live: Live) -> None:
    """A run waiting out the backoff before delivering a message again is aborted at once:
    it hands the thread on without waiting the 30 s."""
    owners: list[str] = []

    async def leave(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        owners.append(lease.owner)  # and leave the message unacknowledged

    threads = Threads(live.provider, leave, ttl_ms=60_000, max_attempts=3, backoff_s=30)
    key = threads.key("t")
    await threads.send("t", "poison")
    running = asyncio.create_task(threads.run("t"))
    try:
        await eventually(lambda: len(owners) == 1, "the first delivery")
        first = owners[0]
        # The follow-up run counts the second delivery, then waits 30 s before it.
        waiting = await owner_other_than(live.provider, key, {None, first})
        assert await threads.abort("t")
        await owner_other_than(live.provider, key, {waiting})
        assert owners == [first]  # the aborted run never delivered
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def test_a_hung_handler_is_cancelled_at_the_run_deadline(live: Live) -> None:
    cancelled: list[Message] = []

    async def hangs(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for message in messages:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(message)
                raise

    threads = Threads(
        live.provider, hangs, ttl_ms=5000, max_attempts=2, backoff_s=0, run_deadline_s=0.2
    )
    await threads.send("t", "hangs")
    started = time.monotonic()
    assert await asyncio.wait_for(threads.run("t"), 30)
    assert time.monotonic() - started >= 0.4
    assert [m.attempt for m in cancelled] == [1, 2]
    assert [letter.attempts for letter in await threads.dead_letters("t")] == [2]
    assert await live.provider.get_lease_owner(threads.key("t")) is None


def test_the_wait_before_a_retry_doubles_from_backoff_s_up_to_max_backoff_s() -> None:
    retries = Retries(max_attempts=9, backoff_s=0.1, max_backoff_s=1.0)
    waits = [retries.backoff(attempt) for attempt in range(1, 8)]
    assert waits == pytest.approx([0.0, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0])  # none before the first


@pytest.mark.parametrize("options", [{"max_attempts": 0}, {"backoff_s": -1}, {"run_deadline_s": 0}])
async def test_retry_options_are_checked(live: Live, options: dict[str, float]) -> None:
    with pytest.raises(LeaseValueError):
        Threads(live.provider, Poisoned(), **options)  # type: ignore[arg-type]


async def test_without_max_attempts_deliveries_are_not_counted(live: Live) -> None:
    handler = Poisoned()
    threads = Threads(live.provider, handler, ttl_ms=5000, max_attempts=None)
    await threads.send("t", "poison")
    running = asyncio.create_task(threads.run("t"))
    for _ in range(3000):  # redelivered for ever, each time as a first delivery
        if len(handler.seen) >= 10:
            break
        await asyncio.sleep(0.01)
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    assert len(handler.seen) >= 10
    assert set(handler.attempts("poison")) == {1}
    assert await threads.dead_letters("t") == []
    assert len(await live.provider.inbox.pending("t")) == 1
