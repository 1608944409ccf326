"""When each kept lease is renewed next, and when its deadline comes: two heaps.

The keep-alive loop keeps thousands of leases with a fixed number of moving parts: the
sender pops the renewals that are due from one heap, and one timer looks at the
earliest deadline of the other. Entries are never moved: a lease whose renewal or
deadline was put off after its entry was pushed is pushed again at the new time when
the entry comes up, and entries of released or lost leases are dropped as they come up
(or all at once, when they outnumber the live ones, so churn cannot grow the heaps
forever).

A lease is due again an interval after its renewal is *written*, not after the sender
queued it: when the streams write slower than renewals fall due (a loaded host), the
renewals asked for then slow down to what the streams write, and each lease still gets
one an interval plus the queue's wait apart. Counted from the queueing, every lease
came due again while still queued, was passed over for a whole interval more, and
some went longer than their TTL between renewals (5,000 leases of 3 s, written 3,300
times a second: 24-70 lost in 10 s, where 2,300 a second would keep them all).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter

from etcd_leases.etcd.kept_lease import KeptLease

__all__ = ["RenewalSchedule"]

# Rebuild the heaps when entries of leases no longer kept outnumber the live ones by
# this much.
_COMPACT_SLACK = 1024

_Entry = tuple[float, int, KeptLease]


class RenewalSchedule:
    """The kept leases, by ID, with their next renewal and deadline."""

    def __init__(self) -> None:
        self._kept: dict[int, KeptLease] = {}
        # (due time, tie-breaker, lease): when each lease is to be renewed next.
        self._renewals: list[_Entry] = []
        # (time, tie-breaker, lease): when to look at each lease's valid_until again.
        self._deadlines: list[_Entry] = []
        self._order = itertools.count()
        # How many kept leases have each TTL: the shortest decides the stall limits.
        self._ttls: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, lease_id: int) -> KeptLease | None:
        return self._kept.get(lease_id)

    def shortest_ttl(self) -> float:
        """The shortest TTL kept, in seconds (infinite when none is)."""
        return min(self._ttls, default=math.inf)

    def add(self, kept: KeptLease, first_renewal: float) -> None:
        """Keep ``kept``: renewed from ``first_renewal`` on, checked at its deadline."""
        self._kept[kept.lease_id] = kept
        self._ttls[kept.ttl_s] += 1
        self.renew_again_at(kept, first_renewal)
        heapq.heappush(self._deadlines, (kept.valid_until, next(self._order), kept))

    def remove(self, kept: KeptLease) -> None:
        """Stop keeping ``kept`` (a no-op for a lease not kept, or kept anew since)."""
        # First, so a rebuild of the heaps below drops its entries too.
        kept._tracked = False
        if self._kept.get(kept.lease_id) is kept:
            del self._kept[kept.lease_id]
            self._ttls[kept.ttl_s] -= 1
            if self._ttls[kept.ttl_s] <= 0:
                del self._ttls[kept.ttl_s]
            self._compact()

    def clear(self) -> list[KeptLease]:
        """Stop keeping every lease; those that were kept."""
        kept = list(self._kept.values())
        self._kept.clear()
        self._ttls.clear()
        self._renewals.clear()
        self._deadlines.clear()
        return kept

    def is_next_renewal(self, kept: KeptLease) -> bool:
        return bool(self._renewals) and self._renewals[0][2] is kept

    def renew_all_now(self) -> None:
        """Every kept lease due at once (new streams), most urgent first."""
        now = time.monotonic()
        urgent_first = sorted(self._kept.values(), key=lambda kept: kept.valid_until)
        for kept in urgent_first:
            kept._renew_at = now
        # Equal due times and increasing tie-breakers: already a heap.
        self._renewals[:] = [(now, next(self._order), kept) for kept in urgent_first]

    def next_renewal_at(self) -> float | None:
        return self._renewals[0][0] if self._renewals else None

    def pop_due(self, now: float) -> KeptLease | None:
        """A kept lease whose renewal is due at ``now`` (taken off the heap), or ``None``."""
        heap = self._renewals
        while heap and heap[0][0] <= now:
            due, _, kept = heapq.heappop(heap)
            if not kept._tracked:
                continue
            if kept._renew_at > due:  # written since: due later
                heapq.heappush(heap, (kept._renew_at, next(self._order), kept))
                continue
            return kept
        return None

    def renew_again_at(self, kept: KeptLease, when: float) -> None:
        """Renew ``kept`` at ``when`` (a lease popped by :meth:`pop_due`, or just added)."""
        kept._renew_at = when
        heapq.heappush(self._renewals, (when, next(self._order), kept))

    def sent(self, lease_id: int, sent_at: float) -> None:
        """A renewal of ``lease_id`` was written at ``sent_at``: the next is due an
        interval after (see above)."""
        kept = self._kept.get(lease_id)
        if kept is not None:
            kept._renew_at = max(kept._renew_at, sent_at + kept._interval)

    def past_deadline(self, now: float) -> list[KeptLease]:
        """The kept leases whose ``valid_until`` has passed by ``now`` (their deadline
        entries taken off; a lease renewed since its entry was pushed is pushed again)."""
        heap, passed = self._deadlines, []
        while heap and heap[0][0] <= now:
            _, _, kept = heapq.heappop(heap)
            if not kept._tracked:
                continue
            if kept.valid_until > now:
                heapq.heappush(heap, (kept.valid_until, next(self._order), kept))
                continue
            passed.append(kept)
        return passed

    def next_deadline(self) -> float:
        return self._deadlines[0][0] if self._deadlines else math.inf

    def _compact(self) -> None:
        # In place: the sender holds no reference to the lists across an await, but
        # replacing them would still be one more thing to get right.
        live = len(self._kept)
        for heap in (self._renewals, self._deadlines):
            if len(heap) > 2 * live + _COMPACT_SLACK:
                heap[:] = [entry for entry in heap if entry[2]._tracked]
                heapq.heapify(heap)
