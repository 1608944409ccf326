"""The keep-alive loop's watchdog: leases lost at their deadlines, rounds widened when due.

The watchdog's promises are about *when*: a lease is marked lost once its deadline has
passed, not a timer's granularity later; an unanswered round is widened a quarter of
the stall limit after it opened, not sooner. Each test here decides them by the order
of the event loop's timers (an earlier ``call_later`` runs first, however loaded the
host), never by a measured duration.
"""

from __future__ import annotations

import asyncio
import math
import time

from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.kept_lease import DEADLINE_PASSED, KeptLease
from etcd_leases.etcd.renewal_round import RenewalRound
from etcd_leases.etcd.renewal_schedule import RenewalSchedule
from etcd_leases.etcd.renewal_watchdog import RenewalWatchdog


class Calls:
    """What the watchdog called back: the leases it lost, when it asked to widen."""

    def __init__(self) -> None:
        self.lost: list[tuple[int, str]] = []
        self.widened_at: list[float] = []

    def lose(self, kept: KeptLease, reason: str) -> None:
        self.lost.append((kept.lease_id, reason))

    def widen(self) -> None:
        self.widened_at.append(time.monotonic())


def _watchdog(
    schedule: RenewalSchedule, calls: Calls, round_: RenewalRound | None = None
) -> RenewalWatchdog:
    return RenewalWatchdog(schedule, lambda: round_, calls.lose, calls.widen)


def _schedule(*leases: KeptLease) -> RenewalSchedule:
    schedule = RenewalSchedule()
    for kept in leases:
        schedule.add(kept, math.inf)  # never due for renewal: only deadlines matter here
    return schedule


def test_the_stall_limit_is_a_third_of_the_shortest_ttl_within_half_a_second_and_five() -> None:
    calls = Calls()
    assert _watchdog(_schedule(), calls).stall_after() == 5.0  # nothing kept
    assert _watchdog(_schedule(KeptLease(1, 3, 0.0)), calls).stall_after() == 1.0
    assert (
        _watchdog(_schedule(KeptLease(1, 3, 0.0), KeptLease(2, 9, 0.0)), calls).stall_after() == 1.0
    )
    assert _watchdog(_schedule(KeptLease(1, 1, 0.0)), calls).stall_after() == 0.5
    assert _watchdog(_schedule(KeptLease(1, 60, 0.0)), calls).stall_after() == 5.0


async def test_a_lease_is_lost_once_its_deadline_passes_and_not_a_timer_tick_later() -> None:
    now = time.monotonic()
    soon, later = KeptLease(1, 10, now + 0.05), KeptLease(2, 10, now + 60)
    calls = Calls()
    watchdog = _watchdog(_schedule(soon, later), calls)
    watchdog.arm(soon.valid_until)
    # This sleep's timer is later than the deadline's, so runs after it, however late.
    await asyncio.sleep(0.5)
    assert calls.lost == [(1, DEADLINE_PASSED)]
    watchdog.stop()


async def test_a_stopped_watchdog_never_calls_back() -> None:
    past = KeptLease(1, 10, time.monotonic() - 1)
    calls = Calls()
    watchdog = _watchdog(_schedule(past), calls)
    watchdog.arm(time.monotonic() + 0.05)
    watchdog.stop()  # the pending timer goes
    watchdog.arm(time.monotonic())  # and no new one is set: the loop closed
    await asyncio.sleep(0.3)
    assert calls.lost == []


async def test_an_unanswered_round_is_widened_when_due_and_not_before(client: EtcdClient) -> None:
    # A 15 s TTL makes the stall limit 5 s, so the round is due for widening 1.25 s
    # after it opened; the watchdog looks at it (and at its streams) well before then.
    calls = Calls()
    round_ = RenewalRound(
        client, lambda response, inflight: None, lambda i, t: None, lambda s: None, lambda s: None
    )
    watchdog = _watchdog(_schedule(KeptLease(1, 15, time.monotonic() + 60)), calls, round_)
    assert await round_.open(login_timeout=5.0) is None
    try:
        due = round_.opened_at + watchdog.stall_after() / 4
        assert watchdog.widen_at(round_) == due
        watchdog.arm(time.monotonic())  # too early: it looks, and waits for the due time
        await asyncio.sleep(due + 0.5 - time.monotonic())
        assert not round_.answered and not round_.over
        assert calls.widened_at, "the round was never widened"
        assert all(at >= due for at in calls.widened_at), (calls.widened_at, due)
    finally:
        watchdog.stop()
        await round_.close("the test is over")
