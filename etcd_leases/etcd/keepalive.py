"""The keep-alive loop: every lease of a provider renewed over ``LeaseKeepAlive`` streams.

etcd renews a lease when a member reads a keep-alive request for it on a
``LeaseKeepAlive`` stream. Renewals are not raft writes, and one stream can carry
every lease of a process: the Go client does this, renewing each lease at a third of
its TTL. :class:`KeepAliveLoop` does the same with a fixed number of moving parts,
however many leases it keeps:

- a *sender* task takes the renewals that are due from a heap of due times and
  sends them on the streams of the current *round*;
- a round opens a stream (:class:`RenewalStream`) on every member at once and keeps
  the first that answers; the round ends when its streams have all ended, and the
  next round opens streams on every member again;
- one *watchdog* timer (a single ``call_later`` handle, rescheduled for the earliest
  instant that matters) marks a lease lost the moment its ``valid_until`` passes,
  from a second heap, and ends a stream on which nothing has been answered for too
  long.

Why every member at once: the member a stream is on may answer nothing while a
quorum is up elsewhere. A frozen member keeps its connections open; a follower whose
leader froze forwards a renewal to it and holds every later request of the stream
behind that one. Trying members one after another costs a stall limit each, and with
the frozen leader next in line, two of them (issue 14) exceed what is left of a 3 s
TTL. Keep-alives are idempotent, so sending them to every member costs nothing but a
few messages, and the first member that answers proves it reaches the leader.

Loss is detected by the timer, not by the sender. Time is judged on our own clock
(``time.monotonic()``) and conservatively: an answer proves the lease alive for the
TTL it reports *from the moment the answered request was sent* (see
:mod:`etcd_leases.etcd.kept_lease`).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import time
from collections import Counter, deque

from etcd_leases.errors import BackendUnavailable, LeaseValueError, ProviderClosed
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.kept_lease import (
    DEADLINE_PASSED,
    LEASE_NOT_FOUND,
    MIN_INTERVAL_S,
    PROVIDER_CLOSED,
    KeptLease,
)
from etcd_leases.etcd.renewal_stream import Inflight, Renewal, RenewalStream
from etcd_leases.etcd.rpc_errors import is_no_leader
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

__all__ = ["KeepAliveLoop", "Renewal"]

_log = logging.getLogger(__name__)

# A round that got no answer is followed by the next after 50 ms, 100 ms, ... up to
# 1 s (less the round's own duration) while members keep failing.
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 1.0
# A stream with requests outstanding and no answer for a third
# of the shortest TTL (within these bounds), is given up: a frozen or leaderless
# member keeps the TCP connection open, so nothing else would tell us.
_STALL_MIN_S = 0.5
_STALL_MAX_S = 5.0
# The heaps drop entries of released and lost leases lazily; rebuild them when such
# entries outnumber the live ones by this much, so churn cannot grow them forever.
_COMPACT_SLACK = 1024
# Hand the event loop back every so many renewals of a burst.
_YIELD_EVERY = 256

_Entry = tuple[float, int, KeptLease]


class KeepAliveLoop:
    """Keeps leases alive over ``LeaseKeepAlive`` streams of ``client``.

    Call its methods from the event loop that runs the client. The tasks start with
    the first :meth:`keep`; :meth:`close` ends them for good.
    """

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._kept: dict[int, KeptLease] = {}
        # (due time, tie-breaker, lease): when each lease is to be renewed next.
        self._renewals: list[_Entry] = []
        # (time, tie-breaker, lease): when to look at each lease's valid_until again.
        # Entries are not moved when a renewal extends valid_until; when one comes up
        # early, it is pushed again at the lease's current valid_until.
        self._deadlines: list[_Entry] = []
        self._order = itertools.count()
        # How many kept leases have each TTL: the shortest decides the stall limits.
        self._ttls: Counter[int] = Counter()
        # One-shot renewals (renew_once) waiting to be sent.
        self._once: deque[tuple[int, asyncio.Future[Renewal]]] = deque()
        self._wake = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        # The current round's streams still open: one per member until one answers.
        self._streams: list[RenewalStream] = []
        self._round_answered = False
        self._round_failure: str | None = None
        # The last answer (or the first keep() after none were kept), and whether the
        # silence since has been logged.
        self._answered_at = 0.0
        self._silence_logged = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._watchdog_at = math.inf
        self._closed = False
        self._requests_sent = 0
        self._answers_received = 0
        self._last_member_id: int | None = None

    # The public surface.

    @property
    def kept_count(self) -> int:
        """How many leases are being renewed."""
        return len(self._kept)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def requests_sent(self) -> int:
        """Keep-alive requests sent so far, one per stream (for metrics and tests)."""
        return self._requests_sent

    @property
    def answers_received(self) -> int:
        """Keep-alive answers read so far (for metrics and tests)."""
        return self._answers_received

    @property
    def last_member_id(self) -> int | None:
        """The etcd member that sent the last answer: where the renewals go."""
        return self._last_member_id

    def is_kept(self, lease_id: int) -> bool:
        """Whether ``lease_id`` is being renewed."""
        return lease_id in self._kept

    def keep(self, lease_id: int, ttl_s: int, valid_until: float) -> KeptLease:
        """Start renewing ``lease_id``, granted for ``ttl_s`` seconds.

        ``valid_until`` is the caller's proof: the send time of its grant (or last
        keep-alive) plus the TTL granted. The first renewal goes out a third of the
        TTL after ``valid_until - ttl_s``. Keeping a lease that is kept already
        returns the same :class:`KeptLease` (releasing it stops it for everyone).
        A lease whose ``valid_until`` has passed comes back lost.
        """
        if self._closed or self._client.closed:
            raise ProviderClosed("the provider is closed")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 1:
            raise LeaseValueError(f"ttl_s must be a positive int, got {ttl_s!r}")
        asyncio.get_running_loop()  # fail here, not in a timer, when called off the loop
        now = time.monotonic()
        if not self._kept:
            self._answered_at = now
        existing = self._kept.get(lease_id)
        if existing is not None:
            if now < existing.valid_until:
                existing.valid_until = max(existing.valid_until, valid_until)
                return existing
            # Its deadline passed and the watchdog has not run yet: that tenure is over.
            self._lose(existing, DEADLINE_PASSED)
        kept = KeptLease(lease_id, ttl_s, valid_until)
        if valid_until <= now:
            kept._set_lost(DEADLINE_PASSED)
            return kept
        self._kept[lease_id] = kept
        self._ttls[ttl_s] += 1
        first = max(now, valid_until - ttl_s + kept._interval)
        heapq.heappush(self._renewals, (first, next(self._order), kept))
        heapq.heappush(self._deadlines, (valid_until, next(self._order), kept))
        self._start()
        if self._renewals[0][2] is kept or not self._streams:
            # Due before whatever the sender sleeps towards, or the sender is
            # waiting to open streams again.
            self._wake.set()
        self._arm_watchdog(valid_until)
        return kept

    async def renew_once(self, lease_id: int, timeout: float) -> Renewal:
        """Renew ``lease_id`` once, kept or not: (send time, TTL).

        The TTL is 0 when etcd says the lease is gone. A request left unanswered by a
        round is sent again in the next. Raises :class:`BackendUnavailable` when no
        answer came within ``timeout`` seconds.
        """
        return await self.answer(self.request_renewal(lease_id), lease_id, timeout)

    def request_renewal(self, lease_id: int) -> asyncio.Future[Renewal]:
        """Queue a one-shot renewal of ``lease_id``; its answer (see :meth:`answer`)."""
        if self._closed or self._client.closed:
            raise ProviderClosed("the provider is closed")
        answer: asyncio.Future[Renewal] = asyncio.get_running_loop().create_future()
        self._once.append((lease_id, answer))
        self._start()
        self._wake.set()
        return answer

    @staticmethod
    async def answer(answer: asyncio.Future[Renewal], lease_id: int, timeout: float) -> Renewal:
        """Wait for a requested renewal's answer: (send time, TTL; 0 if gone)."""
        try:
            async with asyncio.timeout(timeout):
                return await answer
        except TimeoutError:
            raise BackendUnavailable(
                f"etcd: a keep-alive of lease {lease_id:x} was not answered in {timeout:.1f} s"
            ) from None
        finally:
            answer.cancel()  # a no-op once answered; else the sender skips it

    def mark_lost(self, kept: KeptLease, reason: str) -> None:
        """An external loss (say, a watch saw the key change): stop renewing, set lost."""
        self._untrack(kept)
        kept._set_lost(reason)

    def release(self, kept: KeptLease) -> None:
        """Stop renewing ``kept`` without marking it lost: its holder is done with it."""
        self._untrack(kept)

    async def close(self) -> None:
        """Stop the tasks and the streams; leases still kept are lost. Idempotent.

        After it, :meth:`keep` raises :class:`ProviderClosed`.
        """
        self._shut(PROVIDER_CLOSED)
        task = self._sender
        if task is None or task is asyncio.current_task():
            return
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # retrieved here; _sender_done has logged it

    # Bookkeeping shared by the tasks and the timer.

    def _untrack(self, kept: KeptLease) -> None:
        if self._kept.get(kept.lease_id) is kept:
            del self._kept[kept.lease_id]
            self._ttls[kept.ttl_s] -= 1
            if self._ttls[kept.ttl_s] <= 0:
                del self._ttls[kept.ttl_s]
            self._compact()
        kept._tracked = False

    def _lose(self, kept: KeptLease, reason: str) -> None:
        self._untrack(kept)
        kept._set_lost(reason)

    def _compact(self) -> None:
        # In place: the sender holds no reference to the lists across an await, but
        # replacing them would still be one more thing to get right.
        live = len(self._kept)
        for heap in (self._renewals, self._deadlines):
            if len(heap) > 2 * live + _COMPACT_SLACK:
                heap[:] = [entry for entry in heap if entry[2]._tracked]
                heapq.heapify(heap)

    def _shut(self, reason: str) -> None:
        """Mark the loop closed and every kept lease lost; the tasks then stop."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        kept = list(self._kept.values())
        self._kept.clear()
        self._ttls.clear()
        self._renewals.clear()
        self._deadlines.clear()
        waiting = [answer for _, answer in self._once]
        waiting += [answer for stream in self._streams for _, answer in stream.unanswered()]
        self._once.clear()
        for answer in waiting:
            if not answer.done():
                answer.set_exception(ProviderClosed("the provider is closed"))
        for lease in kept:
            lease._set_lost(reason)
        self._wake.set()

    def _log_silence(self, reason: str) -> None:
        """Warn, once per outage, when etcd has been silent longer than a renewal interval."""
        silence = time.monotonic() - self._answered_at
        interval = max(min(self._ttls, default=math.inf) / 3, MIN_INTERVAL_S)
        if self._kept and not self._silence_logged and silence > interval:
            self._silence_logged = True
            _log.warning(
                "etcd has answered no keep-alive for %.1f s, more than a renewal interval; "
                "%d lease(s) at risk (the last streams ended: %s)",
                silence,
                len(self._kept),
                reason,
            )

    def _stall_after(self) -> float:
        shortest = min(self._ttls, default=3 * _STALL_MAX_S)
        return min(_STALL_MAX_S, max(_STALL_MIN_S, shortest / 3))

    # The watchdog: one timer for the earliest deadline or stall check.

    def _arm_watchdog(self, when: float) -> None:
        if self._closed or when >= self._watchdog_at:
            return
        if self._watchdog is not None:
            self._watchdog.cancel()
        delay = max(0.0, when - time.monotonic())
        self._watchdog = asyncio.get_running_loop().call_later(delay, self._on_watchdog)
        self._watchdog_at = when

    def _on_watchdog(self) -> None:
        self._watchdog = None
        self._watchdog_at = math.inf
        if self._closed:
            return
        now = time.monotonic()
        self._expire(now)
        next_check = self._check_stalls(now)
        if self._deadlines:
            next_check = min(next_check, self._deadlines[0][0])
        if next_check < math.inf:
            self._arm_watchdog(next_check)

    def _expire(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, kept = heapq.heappop(heap)
            if not kept._tracked:
                continue
            if kept.valid_until > now:  # renewed since this entry was pushed
                heapq.heappush(heap, (kept.valid_until, next(self._order), kept))
                continue
            self._lose(kept, DEADLINE_PASSED)

    def _check_stalls(self, now: float) -> float:
        """End the streams that stopped answering; when to look again."""
        next_check = math.inf
        limit = self._stall_after()
        for stream in list(self._streams):
            if stream.outstanding == 0:
                continue
            if now - stream.progress_at < limit:
                next_check = min(next_check, stream.progress_at + limit)
            else:
                silent = now - stream.progress_at
                stream.end(f"a stream went {silent:.2f} s without an answer", failed=True)
        return next_check

    # The streams' callbacks.

    def _on_answer(
        self, stream: RenewalStream, response: pb.LeaseKeepAliveResponse, inflight: Inflight | None
    ) -> None:
        now = time.monotonic()
        if self._silence_logged:
            self._silence_logged = False
            _log.info("etcd answers keep-alives again, after %.1f s", now - self._answered_at)
        self._answered_at = now
        self._answers_received += 1
        self._round_answered = True
        self._last_member_id = response.header.member_id
        if len(self._streams) > 1:
            # The first member to answer this round serves it; calls follow it too.
            for other in list(self._streams):
                if other is not stream:
                    other.end("another member answered first", failed=False)
            self._client.members.answered(stream.endpoint)
        sent_at: float | None = None
        if inflight is not None:
            sent_at, answer = inflight
            if answer is not None and not answer.done():
                answer.set_result((sent_at, max(0, response.TTL)))
            for observe in self._client.keepalive_observers:
                observe(now - sent_at)
        kept = self._kept.get(response.ID)
        if kept is None:
            return
        if response.TTL <= 0:
            self._lose(kept, LEASE_NOT_FOUND)
        elif now >= kept.valid_until:
            # Too late: the holder may already have seen remaining() reach 0.
            self._lose(kept, DEADLINE_PASSED)
        elif sent_at is not None:
            kept.valid_until = max(kept.valid_until, sent_at + response.TTL)

    def _on_waiting(self, stream: RenewalStream) -> None:
        self._arm_watchdog(stream.progress_at + self._stall_after())

    def _on_end(self, stream: RenewalStream) -> None:
        if stream in self._streams:
            self._streams.remove(stream)
        if stream.failed and stream.failure is not None:
            self._round_failure = stream.failure
            # Pass this member over in calls while another may serve them.
            self._client.members.failed(stream.endpoint, no_leader=is_no_leader(stream.failure))
        self._wake.set()

    # The tasks.

    def _start(self) -> None:
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(
                self._run(), name="etcd-leases keep-alive sender"
            )
            self._sender.add_done_callback(self._sender_done)

    def _sender_done(self, task: asyncio.Task[None]) -> None:
        # _run handles every error of a stream; reaching here with one is a bug.
        # Retrieve it (never "exception was never retrieved") and let the holders know.
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            _log.error("the keep-alive loop failed", exc_info=exc)
            self._shut(f"keep-alive loop failed: {exc!r}")

    async def _run(self) -> None:
        """The sender: one round after another until closed."""
        failures = 0
        while not self._closed:
            started = time.monotonic()
            try:
                reason = await self._round()
            except ProviderClosed:
                self._shut(PROVIDER_CLOSED)
                return
            except Exception:
                # A bug, not a stream failure: log it, keep going. The watchdog still
                # marks leases lost on time if renewals stop.
                _log.exception("keep-alive round failed unexpectedly")
                reason = "unexpected error"
            if self._closed:
                return
            if self._client.closed:  # the provider closed the client under us
                self._shut(PROVIDER_CLOSED)
                return
            failures = 0 if self._round_answered else failures + 1
            _log.info("etcd keep-alive streams ended (%s); opening new ones", reason)
            self._log_silence(reason)
            if failures:
                # A keep() cuts the wait short: its caller just had a grant
                # answered, so some member is reachable again.
                self._wake.clear()
                delay = min(_BACKOFF_MAX_S, _BACKOFF_MIN_S * 2 ** (failures - 1))
                delay -= time.monotonic() - started
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, delay)):
                        await self._wake.wait()

    async def _round(self) -> str:
        """Open a stream on every member, renew over them until all ended; why."""
        self._round_answered = False
        self._round_failure = None
        opened = await asyncio.gather(
            *(
                RenewalStream.open(
                    self._client,
                    index,
                    self._on_answer,
                    self._on_waiting,
                    self._on_end,
                    login_timeout=_STALL_MIN_S,
                )
                for index in range(len(self._client.endpoints))
            )
        )
        streams = [stream for stream in opened if isinstance(stream, RenewalStream)]
        if self._closed:
            for stream in streams:
                stream.end("the loop closed", failed=False)
            return PROVIDER_CLOSED
        if not streams:
            return "; ".join(str(reason) for reason in opened)
        self._streams = list(streams)
        self._renew_all_now()
        try:
            await self._send()
        finally:
            for stream in streams:
                stream.end("the round ended", failed=False)
            await asyncio.gather(*(stream.wait_ended() for stream in streams))
            self._streams = []
            # Requests of this round will never be answered: one-shots go again.
            again = {
                id(answer): (lease_id, answer)
                for s in streams
                for lease_id, answer in s.unanswered()
            }
            self._once.extendleft(reversed(list(again.values())))
        return self._round_failure or "the keep-alive streams ended"

    def _renew_all_now(self) -> None:
        """On new streams, renew every kept lease at once, most urgent first."""
        now = time.monotonic()
        urgent_first = sorted(self._kept.values(), key=lambda kept: kept.valid_until)
        # Equal due times and increasing tie-breakers: already a heap.
        self._renewals[:] = [(now, next(self._order), kept) for kept in urgent_first]

    async def _send(self) -> None:
        """Send renewals as they come due, until the round's streams have all ended."""
        while True:
            # Cleared before looking at the heap: a keep() from here on wakes us.
            self._wake.clear()
            if not self._streams or self._closed:
                return
            while self._once:
                lease_id, answer = self._once.popleft()
                if not answer.done():  # else its caller gave up
                    self._send_to_all(lease_id, pb.LeaseKeepAliveRequest(ID=lease_id), answer)
            sent = 0
            while self._renewals and self._renewals[0][0] <= time.monotonic():
                _, _, kept = heapq.heappop(self._renewals)
                if not kept._tracked:
                    continue
                sent_at = time.monotonic()
                if sent_at >= kept.valid_until:
                    self._lose(kept, DEADLINE_PASSED)
                    continue
                # Scheduled from the send, answered or not: an unanswered lease is
                # retried at the same pace until its deadline.
                heapq.heappush(self._renewals, (sent_at + kept._interval, next(self._order), kept))
                self._send_to_all(kept.lease_id, kept._request, None)
                sent += 1
                if sent % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
                    if not self._streams or self._closed:
                        break
            timeout = self._renewals[0][0] - time.monotonic() if self._renewals else None
            if timeout is not None and timeout <= 0:
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    def _send_to_all(
        self,
        lease_id: int,
        request: pb.LeaseKeepAliveRequest,
        answer: asyncio.Future[Renewal] | None,
    ) -> None:
        for stream in self._streams:
            if stream.send(lease_id, request, answer):
                self._requests_sent += 1
