"""The keep-alive loop's watchdog: one timer for the earliest instant that matters.

Three things must happen on time whatever the streams do, so none of them waits on a
stream: a lease whose ``valid_until`` passes is marked lost then (not when a member
answers again); a stream with requests outstanding and no answer for the *stall
limit* is ended, since a frozen or leaderless member keeps its TCP connection open and
nothing else would tell us; a round no member has answered is widened every quarter
of that limit (see :mod:`.renewal_round`). One ``call_later`` handle serves them all,
rescheduled for the earliest, however many leases are kept.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from etcd_leases.etcd.kept_lease import DEADLINE_PASSED, KeptLease
from etcd_leases.etcd.renewal_round import RenewalRound
from etcd_leases.etcd.renewal_schedule import RenewalSchedule

__all__ = ["RenewalWatchdog"]

# The stall limit: a third of the shortest TTL kept, within these bounds.
_STALL_MIN_S = 0.5
_STALL_MAX_S = 5.0
# A round no member has answered is widened this often (a fraction of the stall
# limit): after a failover, the next stream opened answers within this much.
_WIDEN_EVERY = 4


class RenewalWatchdog:
    """Marks ``schedule``'s leases lost at their deadlines (``lose``), ends the stalled
    streams of ``current_round()``, and calls ``widen()`` when that round is due for
    more streams."""

    def __init__(
        self,
        schedule: RenewalSchedule,
        current_round: Callable[[], RenewalRound | None],
        lose: Callable[[KeptLease, str], None],
        widen: Callable[[], None],
    ) -> None:
        self._schedule = schedule
        self._current_round = current_round
        self._lose = lose
        self._widen = widen
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf
        self._stopped = False

    def stall_after(self) -> float:
        """The stall limit, in seconds."""
        return min(_STALL_MAX_S, max(_STALL_MIN_S, self._schedule.shortest_ttl() / 3))

    def widen_at(self, round_: RenewalRound) -> float:
        """When ``round_`` is to be widened (never once a member answered it)."""
        if round_.answered:
            return math.inf
        return round_.opened_at + self.stall_after() / _WIDEN_EVERY

    def arm(self, when: float) -> None:
        """Look at ``when`` (monotonic) at the latest."""
        if self._stopped or when >= self._at:
            return
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, when - time.monotonic())
        self._timer = asyncio.get_running_loop().call_later(delay, self._fire)
        self._at = when

    def stop(self) -> None:
        """For good: the loop closed."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self._at = math.inf
        now = time.monotonic()
        for kept in self._schedule.past_deadline(now):
            self._lose(kept, DEADLINE_PASSED)
        next_check = self._schedule.next_deadline()
        round_ = self._current_round()
        if round_ is not None:
            next_check = min(next_check, round_.end_stalled(now, self.stall_after()))
            if now >= self.widen_at(round_) and not round_.over:
                self._widen()
            else:
                next_check = min(next_check, self.widen_at(round_))
        if next_check < math.inf:
            self.arm(next_check)
