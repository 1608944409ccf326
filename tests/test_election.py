"""Leader election on the reference model and on every etcd."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import pytest

from etcd_leases import (
    BackendUnavailable,
    Election,
    HeldLease,
    InMemoryLeaseProvider,
    LeaseHeld,
    LeaseLost,
    LeaseValueError,
    ProviderClosed,
)
from etcd_leases.contract import AcquireResult, Keeper, OwnerState
from tests.conftest import Live


async def next_leaders(updates: asyncio.Queue[str | None], count: int) -> list[str | None]:
    return [await asyncio.wait_for(updates.get(), 5) for _ in range(count)]


async def test_campaign_resign_and_leader(live: Live) -> None:
    alice = Election(live.provider, "seat", "alice", 5000)
    bob = Election(live.another(), "seat", "bob", 5000)
    assert await alice.leader() is None
    lease = await alice.campaign()
    assert await bob.leader() == "alice" and lease.owner == "alice"
    assert await alice.campaign() is lease  # already leading
    with pytest.raises(LeaseHeld):
        await bob.campaign(timeout=0.3)
    bob_won = asyncio.create_task(bob.campaign())
    await asyncio.sleep(0.1)
    await alice.resign()
    await alice.resign()  # a no-op the second time
    assert (await asyncio.wait_for(bob_won, 5)).owner == "bob"
    assert await alice.leader() == "bob"
    await bob.resign()
    assert await alice.leader() is None


async def test_observe_reports_every_leader_and_the_empty_seat(live: Live) -> None:
    alice = Election(live.provider, "obs", "alice", 5000)
    bob = Election(live.another(), "obs", "bob", 5000)
    updates: asyncio.Queue[str | None] = asyncio.Queue()

    async def observe() -> None:
        async for leader in alice.observe():
            updates.put_nowait(leader)

    observer = asyncio.create_task(observe())
    assert await next_leaders(updates, 1) == [None]
    lease = await alice.campaign()
    await lease.transfer("bob")  # straight to bob: no empty seat in between
    async with live.another().adopt("obs", "bob", 5000):
        assert await next_leaders(updates, 2) == ["alice", "bob"]
    assert await next_leaders(updates, 1) == [None]
    await bob.campaign()
    await bob.resign()
    assert await next_leaders(updates, 2) == ["bob", None]
    observer.cancel()
    await asyncio.gather(observer, return_exceptions=True)


async def test_leadership_block_is_cancelled_when_the_seat_is_lost(live: Live) -> None:
    alice = Election(live.provider, "lead", "alice", 5000)
    reached_end = False
    usurper = live.another()
    with pytest.raises(LeaseLost):
        async with alice.leadership() as lease:
            # Not awaited here: this block is cancelled as soon as the loss is seen.
            transfer = asyncio.create_task(usurper.transfer_lease("lead", "alice", "usurper", 5000))
            await asyncio.sleep(5)  # cancelled long before this ends
            reached_end = True
    assert await transfer
    assert not reached_end and lease.lost.is_set()
    assert await alice.leader() == "usurper"  # alice did not release the usurper


async def test_leadership_block_that_ends_normally_resigns(live: Live) -> None:
    alice = Election(live.provider, "lead2", "alice", 5000)
    async with alice.leadership() as lease:
        assert await alice.leader() == "alice" and not lease.lost.is_set()
    assert await alice.leader() is None


async def test_run_recampaigns_after_a_loss(live: Live) -> None:
    alice = Election(live.provider, "runner", "alice", 5000)
    events: list[str] = []
    terms: asyncio.Queue[HeldLease] = asyncio.Queue()
    stop = asyncio.Event()

    async def lead(lease: HeldLease) -> None:
        events.append(f"start {lease.token}")
        terms.put_nowait(lease)
        await asyncio.Event().wait()  # lead until cancelled

    def stopped() -> None:
        events.append("stop")

    async def new_leader(leader: str | None) -> None:
        events.append(f"leader {leader}")

    runner = asyncio.create_task(alice.run(lead, stopped, new_leader, stop=stop))
    first = await asyncio.wait_for(terms.get(), 5)
    # Someone takes the seat from alice and lets it go: alice leads again.
    other = live.another()
    assert await other.transfer_lease("runner", "alice", "mallory", 5000)
    await asyncio.sleep(0.2)
    await other.release_lease("runner", "mallory")
    second = await asyncio.wait_for(terms.get(), 5)
    assert second.token > first.token
    stop.set()  # ends the current term and the run
    await asyncio.wait_for(runner, 5)
    assert await alice.leader() is None
    assert events.count("stop") == 2 and events[0] == "leader None"
    assert "leader mallory" in events and events.count("leader alice") == 2


async def test_run_raises_what_the_leaders_work_raised(live: Live) -> None:
    """The work's exception ends run (and the term), it is not swallowed or retried."""
    terms: list[int] = []
    stopped: list[None] = []

    async def lead(lease: HeldLease) -> None:
        terms.append(lease.token)
        raise RuntimeError("the work failed")

    alice = Election(live.provider, "failing", "alice", 5000)
    with pytest.raises(RuntimeError, match="the work failed"):
        await asyncio.wait_for(alice.run(lead, lambda: stopped.append(None)), 10)
    assert len(terms) == 1 and len(stopped) == 1
    assert await alice.leader() is None  # the seat was given back


async def test_a_candidate_whose_provider_closes_stops_waiting(live: Live) -> None:
    holder = Election(live.another(), "zombie", "holder", 10_000)
    await holder.campaign()
    provider = live.another() if live.endpoints else live.provider
    waiting = Election(provider, "zombie", "waiter", 10_000)
    campaign = asyncio.create_task(waiting.campaign())
    await asyncio.sleep(0.2)
    await provider.close()
    with pytest.raises(ProviderClosed):
        await asyncio.wait_for(campaign, 2)


async def test_resigning_ends_the_lease_for_anyone_watching_it(live: Live) -> None:
    alice = Election(live.provider, "quit", "alice", 5000)
    lease = await alice.campaign()
    await alice.resign()
    assert lease.lost.is_set() and lease.remaining() == 0
    with pytest.raises(LeaseLost):
        lease.check()


async def test_resign_from_outside_cancels_the_leadership_block(live: Live) -> None:
    alice = Election(live.provider, "quit2", "alice", 5000)
    entered = asyncio.Event()

    async def lead() -> None:
        async with alice.leadership():
            entered.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(lead())
    await entered.wait()
    await alice.resign()
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(task, 2)


async def test_cancelling_run_gives_the_seat_back_at_once(live: Live) -> None:
    """As client-go's ReleaseOnCancel: the next candidate leads within moments of the
    leader's run() being cancelled, not a TTL (30 s) later."""
    leading = asyncio.Event()

    async def lead(lease: HeldLease) -> None:
        leading.set()
        await asyncio.Event().wait()

    alice = asyncio.create_task(Election(live.provider, "seat", "alice", 30_000).run(lead))
    await asyncio.wait_for(leading.wait(), 5)
    bob = Election(live.another(), "seat", "bob", 30_000)
    campaign = asyncio.create_task(bob.campaign())
    await asyncio.sleep(0.1)  # bob is waiting for the seat
    alice.cancel()
    await asyncio.gather(alice, return_exceptions=True)
    lease = await asyncio.wait_for(campaign, 10)  # far below the TTL
    assert await bob.leader() == "bob" and not lease.lost.is_set()
    await bob.resign()


async def test_run_returns_when_the_leaders_work_returns(live: Live) -> None:
    """One term, not another campaign: the work's return ends run."""
    terms: list[int] = []

    async def lead(lease: HeldLease) -> None:
        terms.append(lease.token)

    alice = Election(live.provider, "once", "alice", 5000)
    await asyncio.wait_for(alice.run(lead), 10)
    assert len(terms) == 1
    assert await alice.leader() is None


async def test_run_campaigns_while_the_first_report_of_the_leader_is_slow(live: Live) -> None:
    """run waits a moment for on_new_leader's first report, not for ever: a slow
    report (here, one that waits for this candidate to lead) delays no campaign."""
    leading = asyncio.Event()
    reports: list[str | None] = []

    async def new_leader(leader: str | None) -> None:
        reports.append(leader)
        await leading.wait()

    async def lead(lease: HeldLease) -> None:
        leading.set()

    alice = Election(live.provider, "slow-report", "alice", 5000)
    await asyncio.wait_for(alice.run(lead, on_new_leader=new_leader), 10)
    assert leading.is_set() and reports[0] is None


async def test_run_returns_once_its_callbacks_have_finished(live: Live) -> None:
    """Neither the leader's work nor on_new_leader still runs once run has returned:
    a stop waits for the work's clean-up, and the leader watch's report is ended."""
    events: list[str] = []
    leading, reported = asyncio.Event(), asyncio.Event()
    stop = asyncio.Event()

    async def new_leader(leader: str | None) -> None:
        if leader == "alice":
            reported.set()
            try:
                await asyncio.Event().wait()
            finally:
                events.append("report ended")

    async def lead(lease: HeldLease) -> None:
        leading.set()
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.05)  # clean-up that takes a while
            events.append("work ended")

    alice = Election(live.provider, "tidy", "alice", 5000)

    async def run() -> list[str]:
        await alice.run(lead, on_new_leader=new_leader, stop=stop)
        return sorted(events)  # as run returns, before any other task runs

    runner = asyncio.create_task(run())
    await asyncio.wait_for(asyncio.gather(leading.wait(), reported.wait()), 5)
    stop.set()
    assert await asyncio.wait_for(runner, 5) == ["report ended", "work ended"]


async def test_a_stop_while_campaigning_leaves_no_campaign_behind(live: Live) -> None:
    other = live.another()
    await other.acquire_lease("taken", "bob", 5000)
    stop = asyncio.Event()

    async def lead(lease: HeldLease) -> None:
        pytest.fail("alice must not lead")

    alice = Election(live.provider, "taken", "alice", 5000)
    runner = asyncio.create_task(alice.run(lead, stop=stop))
    await asyncio.sleep(0.3)  # alice waits for the seat
    stop.set()
    await asyncio.wait_for(runner, 5)
    await other.release_lease("taken", "bob")
    await asyncio.sleep(0.3)  # a campaign left behind would take the seat now
    assert await other.get_lease_owner("taken") is None


class UnreachableAtFirst(InMemoryLeaseProvider):
    """The reference model, failing its first acquires as an unreachable etcd does."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def acquire_kept(  # type: ignore[override]
        self, key: str, owner: str, ttl_ms: int
    ) -> tuple[AcquireResult, Keeper | None]:
        if self.failures:
            self.failures -= 1
            raise BackendUnavailable("etcd: no answer (on purpose)")
        return await super().acquire_kept(key, owner, ttl_ms)


async def test_run_waits_out_an_unreachable_backend_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="etcd_leases")
    provider = UnreachableAtFirst(failures=3)
    terms: list[int] = []

    async def lead(lease: HeldLease) -> None:
        terms.append(lease.token)

    await asyncio.wait_for(Election(provider, "seat", "alice", 300).run(lead), 10)
    assert len(terms) == 1 and provider.failures == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "etcd_leases.election"]
    assert len(warnings) == 1 and "cannot campaign" in warnings[0], warnings


async def test_a_term_whose_work_ends_cancelled_is_followed_by_another(live: Live) -> None:
    """Work cancelled by something other than stop or a loss ends the term, not run:
    the candidate campaigns again, as after a loss."""
    terms: list[int] = []

    async def lead(lease: HeldLease) -> None:
        terms.append(lease.token)
        if len(terms) == 1:
            raise asyncio.CancelledError

    alice = Election(live.provider, "again", "alice", 5000)
    await asyncio.wait_for(alice.run(lead), 10)
    assert len(terms) == 2 and terms[1] > terms[0]


async def test_a_stop_while_waiting_out_an_unreachable_backend_ends_run() -> None:
    provider = UnreachableAtFirst(failures=1000)
    stop = asyncio.Event()

    async def lead(lease: HeldLease) -> None:
        pytest.fail("alice must not lead")

    runner = asyncio.create_task(Election(provider, "seat", "alice", 3000).run(lead, stop=stop))
    await asyncio.sleep(0.2)  # alice failed once and waits 1 s before trying again
    stop.set()
    await asyncio.wait_for(runner, 5)
    assert provider.failures > 0


class WatchBreaksOnce(InMemoryLeaseProvider):
    """The reference model, whose first watch breaks after its first report."""

    def __init__(self) -> None:
        super().__init__()
        self.broke = False

    async def watch_owner(self, key: str) -> AsyncGenerator[OwnerState, None]:
        async for state in super().watch_owner(key):
            yield state
            if not self.broke:
                self.broke = True
                raise BackendUnavailable("etcd: the watch broke (on purpose)")


async def test_leaders_are_reported_once_each_across_a_broken_watch() -> None:
    provider = WatchBreaksOnce()
    await provider.acquire_lease("seat", "bob", 5000)
    leaders: list[str | None] = []
    stop = asyncio.Event()

    def new_leader(leader: str | None) -> None:
        leaders.append(leader)
        if leader == "alice":
            stop.set()

    async def lead(lease: HeldLease) -> None:
        await asyncio.Event().wait()

    runner = asyncio.create_task(
        Election(provider, "seat", "alice", 5000).run(lead, on_new_leader=new_leader, stop=stop)
    )
    await asyncio.sleep(0.5)  # bob reported, the watch broken and watched again
    assert provider.broke
    await provider.release_lease("seat", "bob")
    await asyncio.wait_for(runner, 5)
    # (then maybe None: alice's resignation, if reported before run ended)
    assert leaders[:3] == ["bob", None, "alice"], leaders


def test_an_election_refuses_an_invalid_name_or_candidate() -> None:
    provider = InMemoryLeaseProvider()
    with pytest.raises(LeaseValueError, match=r"\bname\b"):
        Election(provider, "", "alice", 5000)
    with pytest.raises(LeaseValueError, match=r"\bcandidate\b"):
        Election(provider, "seat", "", 5000)
