"""Holding a lease, on the reference model and on every etcd: renewal, loss, waiting, fencing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

import pytest

from etcd_leases import (
    BackendUnavailable,
    EtcdLeaseProvider,
    InMemoryLeaseProvider,
    LeaseHeld,
    LeaseLost,
    LeaseTypeError,
    LeaseValueError,
    NoopLeaseProvider,
    ProviderClosed,
    hold,
)
from etcd_leases.contract import Keeper, OwnerState
from etcd_leases.hold import _give_backs
from tests.conftest import FakeClock, Live, eventually


async def wait_for(event: asyncio.Event, seconds: float) -> float:
    """How long ``event`` took to be set (fails after ``seconds``)."""
    started = time.monotonic()
    await asyncio.wait_for(event.wait(), seconds)
    return time.monotonic() - started


async def test_hold_acquires_keeps_and_releases(live: Live) -> None:
    p = live.provider
    async with p.hold("job", "alice", 1000) as lease:
        assert (lease.key, lease.owner, lease.ttl_ms) == ("job", "alice", 1000)
        assert 0 < lease.remaining() <= 1.0
        await asyncio.sleep(3.5)  # several TTLs: renewals keep it
        assert not lease.lost.is_set() and lease.remaining() > 0
        lease.check()
        again = await p.acquire_lease("job", "alice", 1000)
        assert again.token == lease.token
    assert await p.get_lease_owner("job") is None


async def test_hold_refuses_a_held_key_naming_the_holder(live: Live) -> None:
    await live.provider.acquire_lease("busy", "bob", 5000)
    with pytest.raises(LeaseHeld) as caught:
        async with live.provider.hold("busy", "alice", 5000):
            pytest.fail("must not get here")
    assert (caught.value.key, caught.value.holder) == ("busy", "bob")
    with pytest.raises(LeaseHeld) as caught:
        async with live.provider.hold("busy", "alice", 5000, wait=0.3):
            pytest.fail("must not get here")
    assert (caught.value.key, caught.value.holder) == ("busy", "bob")  # after waiting too


async def test_waiter_takes_a_released_key_at_once(live: Live) -> None:
    other = live.another()
    await other.acquire_lease("queue", "bob", 10_000)
    got_it = asyncio.Event()
    took: list[float] = []

    async def waiter() -> None:
        async with live.provider.hold("queue", "alice", 10_000, wait=True) as lease:
            took.append(time.monotonic())
            got_it.set()
            assert lease.owner == "alice"

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0.3)
    assert not got_it.is_set()
    released = time.monotonic()
    await other.release_lease("queue", "bob")
    await asyncio.wait_for(task, 5)
    # Within half the TTL (the wait above): the release was seen, not the TTL waited out.
    print(f"takeover {1000 * (took[0] - released):.1f} ms after the release")


async def test_waiter_takes_a_key_whose_holder_died(live: Live) -> None:
    await live.another().acquire_lease("orphan", "dead", 1000)  # never renewed
    async with live.provider.hold("orphan", "alice", 5000, wait=10) as lease:
        assert lease.owner == "alice"


async def test_loss_by_transfer_is_seen_at_once(live: Live) -> None:
    async with live.provider.hold("seat", "alice", 5000) as lease:
        moved = time.monotonic()
        assert await live.another().transfer_lease("seat", "alice", "mallory", 5000)
        await wait_for(lease.lost, 2.5)  # half the TTL: not a renewal's failure
        print(f"loss seen {1000 * (time.monotonic() - moved):.1f} ms after the transfer")
        assert "mallory" in (lease.lost_reason or "")  # told what became of the key
        assert lease.remaining() == 0
        with pytest.raises(LeaseLost):
            lease.check()
    assert await live.provider.get_lease_owner("seat") == "mallory"  # not released by alice


async def test_loss_by_release_elsewhere_is_seen(live: Live) -> None:
    async with live.provider.hold("seat2", "alice", 5000) as lease:
        await live.another().release_lease("seat2", "alice")
        await wait_for(lease.lost, 2.5)
        assert not await lease.put("seat2/data", "late")


async def test_a_holders_own_transfer_is_logged_as_info_not_as_a_loss(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    # The key's watch may report the hand-off before the transaction's answer: it
    # must not be taken for a loss. Several rounds, as that order is up to timing.
    caplog.set_level(logging.INFO, logger="etcd_leases")
    for round in range(10):
        async with live.provider.hold(f"handed{round}", "alice", 5000) as lease:
            await lease.transfer("bob")
        await live.provider.release_lease(f"handed{round}", "bob")
    await asyncio.sleep(0.1)  # loss loggers run once the loss is seen
    records = [r for r in caplog.records if r.name == "etcd_leases.hold"]
    assert [r.levelno for r in records] == [logging.INFO] * 10, [r.getMessage() for r in records]
    assert "'alice' handed 'handed0' (token" in records[0].getMessage()


async def test_a_transfer_that_fails_raises_and_hands_nothing_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The backend says the tenure is over (it expired on the backend's clock) before
    the holder's own clock or a watch told it: the transfer raises, the lease is lost
    (a loss, logged as one), and the would-be new owner has nothing."""
    caplog.set_level(logging.INFO, logger="etcd_leases")
    clock = FakeClock()
    provider = InMemoryLeaseProvider(clock=clock)
    async with provider.hold("baton", "alice", 60_000) as lease:
        clock.now += 61  # past the TTL for the backend; the holder has 60 s left
        assert lease.remaining() > 50 and not lease.lost.is_set()
        with pytest.raises(LeaseLost):
            await lease.transfer("bob")
        assert lease.lost.is_set() and "bob" not in (lease.lost_reason or "")
        await asyncio.sleep(0.05)  # the loss logger runs
    assert await provider.get_lease_owner("baton") is None
    records = [r for r in caplog.records if r.name == "etcd_leases.hold"]
    assert [r.levelno for r in records] == [logging.WARNING], [r.getMessage() for r in records]


async def test_a_transfer_to_an_invalid_owner_is_refused_and_keeps_the_lease(live: Live) -> None:
    async with live.provider.hold("kept", "alice", 5000) as lease:
        with pytest.raises(LeaseValueError, match=r"\bto_owner\b"):
            await lease.transfer("")
        assert not lease.lost.is_set()
        assert await live.provider.get_lease_owner("kept") == "alice"


async def test_a_transfer_gives_the_new_owner_the_ttl_asked_for() -> None:
    clock = FakeClock()
    provider = InMemoryLeaseProvider(clock=clock)
    async with provider.hold("baton", "alice", 60_000) as lease:
        await lease.transfer("bob", ttl_ms=2000)
    clock.now += 1.5
    assert await provider.get_lease_owner("baton") == "bob"
    clock.now += 1
    assert await provider.get_lease_owner("baton") is None  # 2 s, not alice's 60 s


async def test_an_adopted_tenure_is_valid_for_its_ttl_from_the_adoption(live: Live) -> None:
    await live.provider.acquire_lease("adopted", "bob", 30_000)
    assert await live.provider.transfer_lease("adopted", "bob", "alice", 30_000)
    async with live.provider.adopt("adopted", "alice", 5000) as lease:
        assert 4 < lease.remaining() <= 5.0


async def test_transfer_and_adopt_without_a_gap(live: Live) -> None:
    states: list[tuple[str | None, int | None]] = []
    watching = asyncio.Event()

    async def watch() -> None:
        async for state in live.provider.watch_owner("baton"):
            states.append((state.owner, state.token))
            watching.set()

    async with live.provider.hold("baton", "alice", 5000) as lease:
        watcher = asyncio.create_task(watch())
        await watching.wait()
        await lease.transfer("bob")
        assert lease.lost.is_set() and "bob" in (lease.lost_reason or "")
        async with live.another().adopt("baton", "bob", 5000) as adopted:
            assert adopted.token > lease.token and adopted.owner == "bob"
            await adopted.transfer("carol")
    async with live.provider.adopt("baton", "carol", 5000) as last:
        assert last.token > adopted.token
    await asyncio.sleep(0.2)
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    owners = [owner for owner, _ in states]
    assert owners == ["alice", "bob", "carol", None], states  # never free between holders
    with pytest.raises(LeaseLost):
        async with live.provider.adopt("baton", "dave", 5000):
            pytest.fail("dave was never handed the key")


async def test_fenced_writes_apply_only_during_the_tenure(live: Live) -> None:
    async with live.provider.hold("fence", "alice", 5000) as lease:
        assert await lease.put("fence/state", "v1")
        assert await live.provider.get_value("fence/state") == b"v1"
        assert await live.another().transfer_lease("fence", "alice", "bob", 5000)
        # Even before alice's keeper hears of it, etcd refuses her write.
        assert not await live.provider.put_fenced(
            "fence", "alice", lease.token, "fence/state", b"stale"
        )
        assert not await lease.put("fence/state", "stale")
        assert not await lease.delete("fence/state")
    assert await live.provider.get_value("fence/state") == b"v1"
    async with live.provider.adopt("fence", "bob", 5000) as bob:
        assert await bob.put("fence/state", b"v2")
        assert await bob.delete("fence/state")
    assert await live.provider.get_value("fence/state") is None


async def test_a_one_second_tenure_writes_and_deletes(live: Live) -> None:
    """Less than a second of validity left is still validity: the writes go through."""
    async with live.provider.hold("short", "alice", 1000) as lease:
        assert 0 < lease.remaining() <= 1.0
        assert await lease.put("short/state", "ü")
        assert await live.provider.get_value("short/state") == "ü".encode()
        assert await lease.delete("short/state")
    assert await live.provider.get_value("short/state") is None


async def test_release_with_ends_the_tenure_only_when_the_release_applied(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="etcd_leases")
    async with live.provider.hold("inbox", "alice", 5000) as lease:
        assert not await lease.release_with(_answer(False))
        assert not lease.lost.is_set() and lease.remaining() > 0
        assert await live.provider.get_lease_owner("inbox") == "alice"

        async def release() -> bool:
            await live.provider.release_lease("inbox", "alice")
            return True

        assert await lease.release_with(release)
        assert lease.lost.is_set()
        assert lease.remaining() == 0
        # A taker in between is not released by the block's end.
        assert (await live.another().acquire_lease("inbox", "bob", 5000)).acquired
    assert await live.provider.get_lease_owner("inbox") == "bob"
    await asyncio.sleep(0.1)  # a loss logger would have run
    assert not [r for r in caplog.records if r.name == "etcd_leases.hold"]


async def test_a_release_that_did_not_apply_leaves_later_losses_logged(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="etcd_leases")
    async with live.provider.hold("inbox", "alice", 5000) as lease:
        assert not await lease.release_with(_answer(False))
        assert await live.another().transfer_lease("inbox", "alice", "bob", 5000)
        await wait_for(lease.lost, 5)
        await asyncio.sleep(0.05)  # the loss logger runs
    records = [r for r in caplog.records if r.name == "etcd_leases.hold"]
    assert [r.levelno for r in records] == [logging.WARNING], [r.getMessage() for r in records]


async def test_a_loss_the_holder_did_not_cause_is_logged_as_a_warning(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="etcd_leases")

    def records() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "etcd_leases.hold"]

    async with live.provider.hold("taken", "alice", 5000) as lease:
        assert await live.another().transfer_lease("taken", "alice", "bob", 5000)
        await wait_for(lease.lost, 5)
        await eventually(lambda: bool(records()), "the loss logged")
    assert [r.levelno for r in records()] == [logging.WARNING]
    assert f"'alice' lost 'taken' (token {lease.token}): " in records()[0].getMessage()


class TransferUnanswered(InMemoryLeaseProvider):
    """The reference model, with its transfers failing as an unreachable etcd's do."""

    async def transfer_lease(self, key: str, from_owner: str, to_owner: str, ttl_ms: int) -> bool:
        raise BackendUnavailable("etcd: no answer (test)")


async def test_a_loss_after_a_transfer_that_raised_is_logged_as_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A transfer that raised handed nothing on: a later loss is a loss."""
    caplog.set_level(logging.INFO, logger="etcd_leases")

    def records() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "etcd_leases.hold"]

    provider = TransferUnanswered()
    async with provider.hold("baton", "alice", 5000) as lease:
        with pytest.raises(BackendUnavailable):
            await lease.transfer("bob")
        assert await InMemoryLeaseProvider.transfer_lease(provider, "baton", "alice", "carol", 5000)
        await wait_for(lease.lost, 5)
        await eventually(lambda: bool(records()), "the loss logged")
    assert [r.levelno for r in records()] == [logging.WARNING]


async def test_a_key_held_on_etcd_costs_no_task_of_its_own(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """100,000 held keys must not mean 100,000 tasks: etcd's keeper calls the holder
    back on a loss (a task per key is a third of what such a process allocates)."""
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(etcd_provider.hold("warm", "me", 5000))
        before = len(asyncio.all_tasks())  # the session's and the watch's are running
        for i in range(50):
            await stack.enter_async_context(etcd_provider.hold(f"k{i}", "me", 5000))
        assert len(asyncio.all_tasks()) - before < 25


class SlowToKeep(InMemoryLeaseProvider):
    """The reference model, with keep_lease taking a while (so it can be cancelled)."""

    async def keep_lease(  # type: ignore[override]
        self, key: str, owner: str, token: int, ttl_ms: int, valid_until: float
    ) -> Keeper:
        await asyncio.sleep(0.3)
        return await super().keep_lease(key, owner, token, ttl_ms, valid_until)


async def test_an_adopt_cancelled_before_keeping_gives_the_key_back() -> None:
    provider = SlowToKeep()
    await provider.acquire_lease("k", "bob", 30_000)
    assert await provider.transfer_lease("k", "bob", "alice", 30_000)
    entering = asyncio.create_task(provider.adopt("k", "alice", 30_000).__aenter__())
    await asyncio.sleep(0.1)  # renewed and read, not yet kept
    entering.cancel()
    await asyncio.gather(entering, return_exceptions=True)
    await asyncio.sleep(0.05)  # the give-back runs in the background
    assert await provider.get_lease_owner("k") is None
    assert not _give_backs  # done, and forgotten


async def test_check_says_who_lost_what_and_why(live: Live) -> None:
    async with live.provider.hold("over", "alice", 5000) as lease:
        pass
    with pytest.raises(LeaseLost) as caught:
        lease.check()
    assert str(caught.value) == f"'alice' lost 'over': {lease.lost_reason}"
    assert lease.lost_reason


class SlowToRenew(InMemoryLeaseProvider):
    """The reference model, with renewals answered late (etcd slow to answer)."""

    async def renew_lease(self, key: str, owner: str, ttl_ms: int) -> bool:
        await asyncio.sleep(2)
        return await super().renew_lease(key, owner, ttl_ms)


async def test_check_raises_once_the_ttl_ran_out_with_no_renewal_answered() -> None:
    # The backend's clock stands still: for it the tenure lasts; the holder's runs out.
    async with SlowToRenew(clock=FakeClock()).hold("slow", "alice", 300) as lease:
        await asyncio.sleep(0.4)  # past the TTL; the renewal sent at 0.1 s is unanswered
        assert not lease.lost.is_set()
        with pytest.raises(LeaseLost) as caught:
            lease.check()
        assert str(caught.value) == (
            "'alice' lost 'slow': its TTL ran out with no renewal answered"
        )


class SlowToStopWatching(InMemoryLeaseProvider):
    """The reference model, with a watch that takes a while to close."""

    async def watch_owner(self, key: str) -> AsyncGenerator[OwnerState, None]:
        try:
            async for state in super().watch_owner(key):
                yield state
        finally:
            await asyncio.sleep(0.3)


async def test_a_waiter_cancelled_as_it_stops_watching_gives_the_key_back() -> None:
    """It had taken the key, and was cancelled before its hold began."""
    provider = SlowToStopWatching()
    await provider.acquire_lease("k", "bob", 30_000)
    entering = asyncio.create_task(provider.hold("k", "alice", 30_000, wait=True).__aenter__())
    await asyncio.sleep(0.1)  # alice is waiting
    await provider.release_lease("k", "bob")
    await asyncio.sleep(0.1)  # taken by alice, the watch closing
    assert await provider.get_lease_owner("k") == "alice"
    entering.cancel()
    results = await asyncio.gather(entering, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError), results
    await asyncio.sleep(0.05)  # the give-back runs in the background
    assert await provider.get_lease_owner("k") is None
    assert not _give_backs


def _answer(applied: bool) -> Callable[[], Awaitable[bool]]:
    async def release() -> bool:
        return applied

    return release


async def test_a_held_lease_shows_its_key_owner_token_and_state(live: Live) -> None:
    async with live.provider.hold("shown", "alice", 5000) as lease:
        assert re.fullmatch(
            rf"<HeldLease 'shown' by 'alice' token={lease.token} [0-9]\.[0-9]{{3}}s left>",
            repr(lease),
        ), repr(lease)
    assert repr(lease) == f"<HeldLease 'shown' by 'alice' token={lease.token} lost>"


async def test_closing_the_provider_stops_waiters_and_loses_holds(live: Live) -> None:
    other = live.another()
    await other.acquire_lease("c", "bob", 10_000)
    provider = live.provider if live.endpoints is None else live.another()
    waiter = asyncio.create_task(hold(provider, "c", "alice", 10_000, wait=True).__aenter__())
    async with provider.hold("d", "alice", 10_000) as lease:
        await asyncio.sleep(0.2)
        await provider.close()
        with pytest.raises(ProviderClosed):
            await asyncio.wait_for(waiter, 2)
        await wait_for(lease.lost, 2.5)
        # Lost: the fenced writes answer False at once, without asking the backend
        # (a closed provider would raise).
        assert await lease.put("d/state", b"late") is False
        assert await lease.delete("d/state") is False


async def test_hold_needs_a_holding_provider() -> None:
    with pytest.raises(LeaseTypeError) as caught:
        async with hold(NoopLeaseProvider(), "k", "a", 1000):
            pass
    assert str(caught.value) == (
        "NoopLeaseProvider cannot hold leases: it needs watch_owner, keep_lease, "
        "put_fenced, delete_fenced and get_value (see HoldingProvider)"
    )


async def test_hold_block_end_marks_the_lease_lost(live: Live) -> None:
    async with live.provider.hold("over", "alice", 5000) as lease:
        pass
    assert lease.lost.is_set() and lease.remaining() == 0
    assert lease.lost_reason == "released by its holder"
    assert not await lease.put("over/data", "late")


async def test_wait_is_a_bool_or_a_number_of_seconds() -> None:
    provider = InMemoryLeaseProvider()
    await provider.acquire_lease("busy", "bob", 5000)
    for wait in (False, 0):  # refused at once: bob's release just after is not waited for
        attempt = asyncio.create_task(provider.hold("busy", "alice", 5000, wait=wait).__aenter__())
        await asyncio.sleep(0.1)
        assert attempt.done()
        with pytest.raises(LeaseHeld):
            await attempt
    for invalid in (-1, "soon"):
        with pytest.raises(LeaseValueError, match="wait must be a bool or a number of seconds"):
            async with provider.hold("busy", "alice", 5000, wait=invalid):  # type: ignore[arg-type]
                pytest.fail("must not get here")
    # One second is waited: bob's release within it lets alice in.
    attempt = asyncio.create_task(provider.hold("busy", "alice", 5000, wait=1).__aenter__())
    await asyncio.sleep(0.2)
    await provider.release_lease("busy", "bob")
    lease = await asyncio.wait_for(attempt, 5)
    assert lease.owner == "alice"
    await lease._finish()


class SlowToRelease(InMemoryLeaseProvider):
    """The reference model, with releases taking a while (so they can be cancelled)."""

    async def release_lease(self, key: str, owner: str) -> None:
        await asyncio.sleep(0.3)
        await super().release_lease(key, owner)


async def test_a_task_cancelled_while_its_hold_releases_ends_cancelled() -> None:
    """The release runs to its end; the cancel is then raised, not swallowed."""
    provider = SlowToRelease()
    steps: list[str] = []

    async def work() -> None:
        async with provider.hold("k", "alice", 5000):
            steps.append("held")
        steps.append("went on after the cancel")

    task = asyncio.create_task(work())
    await asyncio.sleep(0.1)  # held, and releasing
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled() and steps == ["held"]
    assert await provider.get_lease_owner("k") is None


async def test_cancelling_the_holding_task_gives_the_key_back_at_once(live: Live) -> None:
    """As client-go's ReleaseOnCancel: a successor waiting on the key takes it within
    moments of the holder's task being cancelled, not a TTL later."""
    holder = await _holding_task(live, "job")
    successor = asyncio.create_task(_hold_once(live.another(), "job", "bob"))
    await asyncio.sleep(0.1)  # bob is waiting on the key
    cancelled_at = time.monotonic()
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)
    took = await asyncio.wait_for(successor, 10) - cancelled_at
    print(f"successor took the key {took * 1000:.0f} ms after the holder was cancelled")
    assert took < 10  # the wait_for above bounds it; a TTL would be 30 s


async def _holding_task(live: Live, key: str) -> asyncio.Task[None]:
    """A task in which alice holds ``key`` (30 s TTL) until cancelled, once it holds it."""
    held = asyncio.Event()

    async def work() -> None:
        async with live.provider.hold(key, "alice", 30_000):
            held.set()
            await asyncio.Event().wait()

    holder = asyncio.create_task(work())
    await asyncio.wait_for(held.wait(), 5)
    return holder


async def _hold_once(provider: object, key: str, owner: str) -> float:
    """Wait for ``key`` and take it; when it was taken."""
    async with hold(provider, key, owner, 30_000, wait=True):
        return time.monotonic()


async def test_cancelling_twice_still_gives_the_key_back(live: Live) -> None:
    """A shutdown may cancel again while the release is under way (asyncio.run does)."""
    holder = await _holding_task(live, "job")
    holder.cancel()
    await asyncio.sleep(0)  # the release has started
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)
    deadline = time.monotonic() + 5
    while await live.provider.get_lease_owner("job") is not None:
        assert time.monotonic() < deadline, "the key was not given back"
        await asyncio.sleep(0.02)
