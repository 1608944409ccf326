"""The keep-alive loop: every lease of a provider renewed over ``LeaseKeepAlive`` streams.

etcd renews a lease when a member reads a keep-alive request for it on a
``LeaseKeepAlive`` stream. Renewals are not raft writes, and one stream can carry
every lease of a process: the Go client does this, renewing each lease at a third of
its TTL. :class:`KeepAliveLoop` does the same with a fixed number of moving parts,
however many leases it keeps:

- a *sender* task takes the renewals that are due from a heap of due times and
  sends them on the streams of the current *round*;
- a :class:`RenewalRound` opens a stream on every member at once and keeps the first
  that answers; the round ends when its streams have all ended, and the next round
  opens streams on every member again;
- one *watchdog* timer (:mod:`.renewal_watchdog`) marks a lease lost the moment its
  ``valid_until`` passes, from a second heap, ends a stream on which nothing has been
  answered for too long, and has a round no member answered yet widened.

Why every member at once: see :mod:`etcd_leases.etcd.renewal_round`.

Loss is detected by the timer, not by the sender. Time is judged on our own clock
(``time.monotonic()``) and conservatively: an answer proves the lease alive for the
TTL it reports *from the moment the answered request was sent* (see
:mod:`etcd_leases.etcd.kept_lease`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

from etcd_leases.errors import BackendUnavailable, LeaseValueError, ProviderClosed
from etcd_leases.etcd.backoff import Backoff
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.kept_lease import (
    DEADLINE_PASSED,
    LEASE_NOT_FOUND,
    MIN_INTERVAL_S,
    PROVIDER_CLOSED,
    KeptLease,
)
from etcd_leases.etcd.renewal_round import RenewalRound
from etcd_leases.etcd.renewal_schedule import RenewalSchedule
from etcd_leases.etcd.renewal_stream import Inflight, Renewal, RenewalStream
from etcd_leases.etcd.renewal_watchdog import RenewalWatchdog
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

__all__ = ["KeepAliveLoop", "Renewal"]

_log = logging.getLogger(__name__)

# How long a login may take when a round opens streams.
_LOGIN_TIMEOUT_S = 0.5
# Hand the event loop back every so many renewals of a burst.
_YIELD_EVERY = 256


class KeepAliveLoop:
    """Keeps leases alive over ``LeaseKeepAlive`` streams of ``client``.

    Call its methods from the event loop that runs the client. The tasks start with
    the first :meth:`keep`; :meth:`close` ends them for good.
    """

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._schedule = RenewalSchedule()
        # One-shot renewals (renew_once) waiting to be sent.
        self._once: deque[tuple[int, asyncio.Future[Renewal]]] = deque()
        self._wake = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        self._round: RenewalRound | None = None
        self._widen = False  # the watchdog asks the sender to widen the round
        # The last answer (or the first keep() after none were kept), and whether the
        # silence since has been logged.
        self._answered_at = 0.0
        self._silence_logged = False
        self._watchdog = RenewalWatchdog(
            self._schedule, lambda: self._round, self._lose, self._ask_to_widen
        )
        self._closed = False
        self._requests_sent = 0
        self._answers_received = 0
        self._last_member_id: int | None = None

    # The public surface.

    @property
    def kept_count(self) -> int:
        """How many leases are being renewed."""
        return len(self._schedule)

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
        return self._schedule.get(lease_id) is not None

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
        if not self._schedule:
            self._answered_at = now
        existing = self._schedule.get(lease_id)
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
        self._schedule.add(kept, first_renewal=max(now, valid_until - ttl_s + kept._interval))
        self._start()
        if self._schedule.is_next_renewal(kept) or self._round is None or self._round.over:
            # Due before whatever the sender sleeps towards, or the sender is
            # waiting to open streams again.
            self._wake.set()
        self._watchdog.arm(valid_until)
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
        self._lose(kept, reason)

    def release(self, kept: KeptLease) -> None:
        """Stop renewing ``kept`` without marking it lost: its holder is done with it."""
        self._schedule.remove(kept)

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

    def _lose(self, kept: KeptLease, reason: str) -> None:
        self._schedule.remove(kept)
        kept._set_lost(reason)

    def _shut(self, reason: str) -> None:
        """Mark the loop closed and every kept lease lost; the tasks then stop."""
        if self._closed:
            return
        self._closed = True
        self._watchdog.stop()
        kept = self._schedule.clear()
        waiting = [answer for _, answer in self._once]
        if self._round is not None:
            waiting += [answer for _, answer in self._round.unanswered()]
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
        interval = max(self._schedule.shortest_ttl() / 3, MIN_INTERVAL_S)
        if self._schedule and not self._silence_logged and silence > interval:
            self._silence_logged = True
            _log.warning(
                "etcd has answered no keep-alive for %.1f s, more than a renewal interval; "
                "%d lease(s) at risk (%s)",
                silence,
                len(self._schedule),
                reason,
            )

    def _ask_to_widen(self) -> None:
        self._widen = True
        self._wake.set()

    # The streams' callbacks.

    def _on_answer(self, response: pb.LeaseKeepAliveResponse, inflight: Inflight | None) -> None:
        now = time.monotonic()
        if self._silence_logged:
            self._silence_logged = False
            _log.info("etcd answers keep-alives again, after %.1f s", now - self._answered_at)
        self._answered_at = now
        self._answers_received += 1
        self._last_member_id = response.header.member_id
        sent_at: float | None = None
        if inflight is not None:
            sent_at, answer = inflight
            if answer is not None and not answer.done():
                answer.set_result((sent_at, max(0, response.TTL)))
            for observe in self._client.keepalive_observers:
                observe(now - sent_at)
        kept = self._schedule.get(response.ID)
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
        self._watchdog.arm(stream.progress_at + self._watchdog.stall_after())

    def _on_end(self, stream: RenewalStream) -> None:
        self._wake.set()  # the sender looks whether the round is over

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
        # A round that got no answer is followed by the next after 50 ms, 100 ms, ... up
        # to 1 s (less the round's own duration) while members keep failing.
        backoff = Backoff()
        while not self._closed:
            started = time.monotonic()
            try:
                answered, reason = await self._renew_in_a_round()
            except ProviderClosed:
                self._shut(PROVIDER_CLOSED)
                return
            except Exception:
                # A bug, not a stream failure: log it, keep going. The watchdog still
                # marks leases lost on time if renewals stop.
                _log.exception("keep-alive round failed unexpectedly")
                answered, reason = False, "unexpected error"
            if self._closed:
                return
            if self._client.closed:  # the provider closed the client under us
                self._shut(PROVIDER_CLOSED)
                return
            _log.info("etcd keep-alive streams ended (%s); opening new ones", reason)
            self._log_silence(f"the last streams ended: {reason}")
            if answered:
                backoff.reset()
            else:
                # A keep() cuts the wait short: its caller just had a grant
                # answered, so some member is reachable again.
                self._wake.clear()
                delay = backoff.failed() - (time.monotonic() - started)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, delay)):
                        await self._wake.wait()

    async def _renew_in_a_round(self) -> tuple[bool, str]:
        """Open a round of streams, renew over them until all ended; whether a member
        answered, and why the round ended."""
        round_ = RenewalRound(
            self._client, self._on_answer, self._schedule.sent, self._on_waiting, self._on_end
        )
        cannot_open = await round_.open(login_timeout=_LOGIN_TIMEOUT_S)
        if self._closed:
            await round_.close("the loop closed")
            return False, PROVIDER_CLOSED
        if cannot_open is not None:
            return False, cannot_open
        self._round = round_
        self._schedule.renew_all_now()  # new streams: every lease, most urgent first
        self._watchdog.arm(self._watchdog.widen_at(round_))
        try:
            await self._send(round_)
        finally:
            # Requests of this round will never be answered: one-shots go again.
            self._once.extendleft(reversed(await round_.close("the round ended")))
            self._round = None
            self._widen = False
        return round_.answered, round_.failure or "the keep-alive streams ended"

    async def _send(self, round_: RenewalRound) -> None:
        """Send renewals as they come due, until the round's streams have all ended."""
        while True:
            # Cleared before looking at the heap: a keep() from here on wakes us.
            self._wake.clear()
            if round_.over or self._closed:
                return
            if self._widen:
                self._widen = False
                if not round_.answered:
                    # A round nobody answers never ends: warn from here too.
                    self._log_silence("no member has answered the streams open; opening more")
                    await round_.open(login_timeout=_LOGIN_TIMEOUT_S)
                    self._schedule.renew_all_now()
                    self._watchdog.arm(self._watchdog.widen_at(round_))
                    continue
            while self._once:
                lease_id, answer = self._once.popleft()
                if not answer.done():  # else its caller gave up
                    self._requests_sent += round_.send(
                        lease_id, pb.LeaseKeepAliveRequest(ID=lease_id), answer
                    )
            sent = 0
            while (kept := self._schedule.pop_due(time.monotonic())) is not None:
                sent_at = time.monotonic()
                if sent_at >= kept.valid_until:
                    self._lose(kept, DEADLINE_PASSED)
                    continue
                # Due again an interval after it is written (see RenewalSchedule.sent),
                # and after now if it never is; answered or not: an unanswered lease
                # is retried at the same pace until its deadline.
                self._schedule.renew_again_at(kept, sent_at + kept._interval)
                self._requests_sent += round_.send(kept.lease_id, kept._request, None)
                sent += 1
                if sent % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
                    if round_.over or self._closed:
                        break
            due = self._schedule.next_renewal_at()
            timeout = None if due is None else due - time.monotonic()
            if timeout is not None and timeout <= 0:
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
