"""The keep-alive loop's two heaps: what is due for renewal, and whose deadline passed.

A plain data structure (no etcd, no event loop): what the loop relies on is the order
things come out in, the boundaries (due *at* ``now`` is due), and that a lease released
or kept anew is never handed out again.
"""

from __future__ import annotations

import math
import time

import pytest

from etcd_leases.etcd.kept_lease import KeptLease
from etcd_leases.etcd.renewal_schedule import RenewalSchedule


def _kept(lease_id: int, ttl_s: int = 10, valid_until: float = 100.0) -> KeptLease:
    return KeptLease(lease_id, ttl_s, valid_until)


def test_a_kept_lease_is_found_by_id_and_counted_until_removed() -> None:
    schedule = RenewalSchedule()
    first, second = _kept(1), _kept(2)
    schedule.add(first, 5.0)
    schedule.add(second, 6.0)
    assert len(schedule) == 2
    assert schedule.get(1) is first and schedule.get(2) is second
    assert schedule.get(3) is None
    schedule.remove(first)
    assert len(schedule) == 1 and schedule.get(1) is None
    assert not first._tracked and second._tracked


def test_removing_a_lease_kept_anew_under_the_same_id_keeps_the_new_one() -> None:
    schedule = RenewalSchedule()
    old, new = _kept(7, ttl_s=10), _kept(7, ttl_s=20)
    schedule.add(old, 5.0)
    schedule.add(new, 6.0)  # the same lease kept again: the newer object is the one kept
    schedule.remove(old)
    assert schedule.get(7) is new and len(schedule) == 1
    assert not old._tracked and new._tracked
    # The old one's TTL was never counted off: the new one's remains.
    assert schedule.shortest_ttl() == 10
    never_kept = _kept(8)
    schedule.remove(never_kept)
    assert len(schedule) == 1 and not never_kept._tracked


def test_the_shortest_ttl_is_of_the_leases_still_kept() -> None:
    schedule = RenewalSchedule()
    assert schedule.shortest_ttl() == math.inf
    short_a, short_b, long = _kept(1, ttl_s=3), _kept(2, ttl_s=3), _kept(3, ttl_s=30)
    for kept in (long, short_a, short_b):
        schedule.add(kept, 0.0)
    assert schedule.shortest_ttl() == 3
    schedule.remove(short_a)
    assert schedule.shortest_ttl() == 3  # one more lease has that TTL
    schedule.remove(short_b)
    assert schedule.shortest_ttl() == 30
    schedule.remove(long)
    assert schedule.shortest_ttl() == math.inf


def test_renewals_come_out_when_due_earliest_first_and_due_at_now_is_due() -> None:
    schedule = RenewalSchedule()
    late, early = _kept(1), _kept(2)
    schedule.add(late, 20.0)
    schedule.add(early, 10.0)
    assert schedule.next_renewal_at() == 10.0
    assert schedule.is_next_renewal(early) and not schedule.is_next_renewal(late)
    assert schedule.pop_due(9.99) is None
    assert schedule.pop_due(10.0) is early
    assert schedule.next_renewal_at() == 20.0
    assert schedule.pop_due(30.0) is late
    assert schedule.pop_due(30.0) is None
    assert schedule.next_renewal_at() is None
    assert not schedule.is_next_renewal(late)
    schedule.renew_again_at(early, 40.0)
    assert schedule.next_renewal_at() == 40.0
    assert schedule.pop_due(40.0) is early


def test_a_renewal_is_due_again_an_interval_after_it_was_written() -> None:
    # Queued at +10 and +11 (due again a 1 s interval after queueing) but written only
    # at +10.6: due at +11.6, not sooner; a write reported late never brings it
    # forward, nor one of a lease not kept; a new round makes it due at once again.
    now = time.monotonic()
    schedule = RenewalSchedule()
    kept = _kept(1, ttl_s=3)
    schedule.add(kept, now + 10)
    assert schedule.pop_due(now + 10) is kept
    schedule.renew_again_at(kept, now + 11)
    schedule.sent(1, now + 10.6)
    schedule.sent(1, now + 9)
    schedule.sent(2, now + 20)
    assert schedule.pop_due(now + 11.5) is None
    assert schedule.next_renewal_at() == now + 11.6
    assert schedule.pop_due(now + 11.6) is kept
    # A lease due later than its entry says is passed over for the next one due.
    other = _kept(2, ttl_s=3)
    schedule.renew_again_at(kept, now + 12)
    schedule.add(other, now + 12.1)
    schedule.sent(1, now + 11.7)
    assert schedule.pop_due(now + 12.5) is other
    assert schedule.pop_due(now + 12.7) is kept
    schedule.renew_again_at(kept, now + 12.6)
    schedule.sent(1, now + 12)
    schedule.renew_all_now()
    assert schedule.pop_due(time.monotonic()) is kept
    assert schedule.pop_due(now + 20) is other
    assert schedule.pop_due(now + 20) is None  # one entry each, not one per report


def test_a_released_lease_is_skipped_when_its_renewal_comes_up() -> None:
    schedule = RenewalSchedule()
    released, kept = _kept(1), _kept(2)
    schedule.add(released, 10.0)
    schedule.add(kept, 11.0)
    schedule.remove(released)
    assert schedule.pop_due(10.5) is None
    assert schedule.pop_due(11.0) is kept
    # Behind the released lease's entry, in the same pop: the lease still kept.
    other = _kept(3)
    schedule.add(released, 20.0)
    schedule.remove(released)
    schedule.add(other, 21.0)
    assert schedule.pop_due(21.0) is other


def test_renew_all_now_makes_every_lease_due_the_most_urgent_first() -> None:
    schedule = RenewalSchedule()
    leases = [_kept(1, valid_until=300.0), _kept(2, valid_until=100.0), _kept(3, valid_until=200.0)]
    for kept in leases:
        schedule.add(kept, 1e9)  # none due for ages
    before = time.monotonic()
    schedule.renew_all_now()
    due_at = schedule.next_renewal_at()
    assert due_at is not None and before <= due_at <= time.monotonic()
    out = [schedule.pop_due(due_at) for _ in leases]
    assert [kept.lease_id for kept in out if kept is not None] == [2, 3, 1]
    assert schedule.pop_due(due_at) is None  # the old entries are gone, not just behind


def test_a_passed_deadline_is_reported_once_a_renewed_lease_is_looked_at_again() -> None:
    schedule = RenewalSchedule()
    # Deadlines below the heaps' tie-breakers, so only the deadline can decide; the
    # renewed and the released lease come up before the one that passed.
    renewed, released, passes = (
        _kept(1, valid_until=1.0),
        _kept(2, valid_until=1.0),
        _kept(3, valid_until=1.0),
    )
    later = _kept(4, valid_until=5.0)
    for kept in (renewed, released, passes, later):
        schedule.add(kept, 0.0)
    schedule.remove(released)
    renewed.valid_until = 3.0  # renewed since its deadline entry was pushed
    assert schedule.next_deadline() == 1.0
    assert schedule.past_deadline(0.99) == []
    assert schedule.past_deadline(1.0) == [passes]  # at the deadline: passed
    assert schedule.past_deadline(1.0) == []  # reported once
    assert schedule.next_deadline() == 3.0  # the renewed lease's new deadline
    assert schedule.past_deadline(3.0) == [renewed]
    assert schedule.next_deadline() == 5.0
    assert schedule.past_deadline(6.0) == [later]
    assert schedule.next_deadline() == math.inf


def test_clear_hands_back_every_kept_lease_and_leaves_nothing_due() -> None:
    schedule = RenewalSchedule()
    leases = [_kept(1, ttl_s=5), _kept(2, ttl_s=7)]
    for kept in leases:
        schedule.add(kept, 0.0)
    assert sorted(k.lease_id for k in schedule.clear()) == [1, 2]
    assert len(schedule) == 0 and schedule.get(1) is None
    assert schedule.next_renewal_at() is None and schedule.pop_due(math.inf) is None
    assert schedule.next_deadline() == math.inf and schedule.past_deadline(math.inf) == []
    assert schedule.shortest_ttl() == math.inf


@pytest.mark.parametrize("leases", [1100, 1101])
def test_churn_cannot_grow_the_heaps_they_are_rebuilt_past_twice_the_live_plus_1024(
    leases: int,
) -> None:
    """Entries of removed leases stay until they come up, or until they outnumber the
    live ones: more entries than ``2 * live + 1024`` and the heaps keep only the live.
    Two sizes, so the rule's every constant decides the count (1100: the rebuild comes
    at 37 live leases; 1101: at 38)."""
    schedule = RenewalSchedule()
    kept = [_kept(lease_id) for lease_id in range(leases)]
    for lease in kept:
        schedule.add(lease, float(lease.lease_id))
    renewals, deadlines = schedule._renewals, schedule._deadlines
    rebuilt_at = (leases - 1024 - 1) // 2  # the most live leases for which entries > 2*live+1024
    for live in range(leases - 1, rebuilt_at, -1):
        schedule.remove(kept[live])
        assert len(renewals) == len(deadlines) == leases, live
    schedule.remove(kept[rebuilt_at])
    # In place, so whoever holds the lists sees the rebuilt ones.
    assert schedule._renewals is renewals and schedule._deadlines is deadlines
    assert len(renewals) == len(deadlines) == rebuilt_at
    assert schedule.pop_due(math.inf) is kept[0]  # still a heap, the earliest first
    assert [entry[2] for entry in sorted(deadlines)] == kept[:rebuilt_at]
