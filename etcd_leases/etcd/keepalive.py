"""One ``LeaseKeepAlive`` stream that keeps every lease of a provider alive.

etcd renews a lease when a member reads a keep-alive request for it on a
``LeaseKeepAlive`` stream. Renewals are not raft writes, and one stream can carry
every lease of a process: the Go client does this, renewing each lease at a third of
its TTL. :class:`KeepAliveLoop` does the same with a fixed number of moving parts,
however many leases it keeps:

- a *sender* task writes the renewals that are due, taken from a heap of due times,
  and opens the stream again (on the next endpoint) when it breaks;
- a *reader* task reads the answers and moves each lease's ``valid_until`` forward;
- one *watchdog* timer (a single ``call_later`` handle, rescheduled for the earliest
  instant that matters) marks a lease lost the moment its ``valid_until`` passes,
  from a second heap, and cancels a stream on which nothing has been answered for
  too long.

Loss is detected by the timer, not by the sender, because a write can block: once a
member is frozen (``SIGSTOP``), gRPC flow control stops taking messages after a few
thousand and the sender waits inside ``write`` while deadlines pass.

Time is judged on our own clock (``time.monotonic()``) and conservatively. An answer
proves the lease alive for the TTL it reports *from the moment the answered request
was sent*: etcd cannot have renewed it earlier than that, so ``valid_until`` is never
later than the server's own deadline. A lease whose ``valid_until`` passes without an
answer is lost for good, even if an answer turns up afterwards: its holder may already
have acted on the loss.
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
from collections.abc import Callable

import grpc
import grpc.aio

from etcd_leases.errors import BackendUnavailable, LeaseError, LeaseValueError, ProviderClosed
from etcd_leases.etcd.client import EtcdClient, is_no_leader, to_lease_error
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

__all__ = [
    "DEADLINE_PASSED",
    "LEASE_NOT_FOUND",
    "PROVIDER_CLOSED",
    "KeepAliveLoop",
    "KeptLease",
]

_log = logging.getLogger(__name__)

#: ``lost_reason`` when etcd answered that the lease does not exist (revoked, expired).
LEASE_NOT_FOUND = "lease not found"
#: ``lost_reason`` when ``valid_until`` passed before any renewal was answered.
DEADLINE_PASSED = "deadline passed without a renewal"
#: ``lost_reason`` of the leases still kept when the loop (or its client) is closed.
PROVIDER_CLOSED = "provider closed"

# Renew at a third of the TTL (as the Go client does), but never more often than
# this: a 1 s lease is renewed about three times a second, not in a tight loop.
_MIN_INTERVAL_S = 0.3
# Reopening a broken stream: immediately after a stream that worked, then waiting
# 50 ms, 100 ms, ... up to 1 s while endpoints keep failing.
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 1.0
# A stream with requests outstanding and no answer for a third of the shortest TTL
# (within these bounds) is given up for another member: a frozen or leaderless
# member keeps the TCP connection open, so nothing else would tell us.
_STALL_MIN_S = 0.5
_STALL_MAX_S = 5.0
# Hand the event loop back every so many writes of a burst.
_YIELD_EVERY = 256
# The heaps drop entries of released and lost leases lazily; rebuild them when such
# entries outnumber the live ones by this much, so churn cannot grow them forever.
_COMPACT_SLACK = 1024
# etcd's error for an expired auth token (etcdserver/api/v3rpc/rpctypes).
_INVALID_TOKEN = "invalid auth token"

_Entry = tuple[float, int, "KeptLease"]
# A one-shot renewal's answer: when its request was sent, and the TTL etcd answered.
Renewal = tuple[float, int]
# A request written and not answered yet: its send time, and who waits for its answer.
_Inflight = tuple[float, "asyncio.Future[Renewal] | None"]
_Stream = grpc.aio.StreamStreamCall[pb.LeaseKeepAliveRequest, pb.LeaseKeepAliveResponse]


def _run_callback(fn: Callable[[KeptLease], None], kept: KeptLease) -> None:
    # Callbacks run inside the loop's own bookkeeping (the watchdog timer, the
    # reader): one that raises must not stop the others or the loop.
    try:
        fn(kept)
    except Exception:
        _log.exception("loss callback %r of lease %x failed", fn, kept.lease_id)


def _cancelling() -> bool:
    """True when the current task itself is being cancelled.

    gRPC raises ``CancelledError`` into whoever waits on a call that was cancelled
    locally (by us, or by the channel closing); only a cancellation of the task
    must propagate, the other kind just means the stream is over.
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class KeptLease:
    """A lease a :class:`KeepAliveLoop` renews, and what is known about it.

    ``valid_until`` (``time.monotonic()``) is the instant until which the lease is
    known to be alive: the send time of the last keep-alive etcd answered plus the
    TTL it answered. ``lost`` is set once and for all when the lease is gone or can
    no longer be vouched for; ``lost_reason`` then says why.
    """

    __slots__ = (
        "_callbacks",
        "_interval",
        "_request",
        "_tracked",
        "lease_id",
        "lost",
        "lost_reason",
        "ttl_s",
        "valid_until",
    )

    def __init__(self, lease_id: int, ttl_s: int, valid_until: float) -> None:
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self.valid_until = valid_until
        self.lost = asyncio.Event()
        self.lost_reason: str | None = None
        # A dict, so a holder that is done can take its callback back in O(1).
        self._callbacks: dict[Callable[[KeptLease], None], None] = {}
        # True while its loop renews it: neither released nor lost.
        self._tracked = True
        self._interval = max(ttl_s / 3, _MIN_INTERVAL_S)
        # Built once: a lease is renewed thousands of times.
        self._request = pb.LeaseKeepAliveRequest(ID=lease_id)

    def remaining(self) -> float:
        """Seconds the lease is still known to be alive; 0 once lost."""
        if self.lost.is_set():
            return 0.0
        return max(0.0, self.valid_until - time.monotonic())

    def add_loss_callback(self, fn: Callable[[KeptLease], None]) -> None:
        """Call ``fn(self)`` once, when ``lost`` is set (right away if it already is).

        ``fn`` runs inside the event loop's bookkeeping: it must be quick and must not
        block. An exception it raises is logged, not propagated.
        """
        if self.lost.is_set():
            _run_callback(fn, self)
        else:
            self._callbacks[fn] = None

    def remove_loss_callback(self, fn: Callable[[KeptLease], None]) -> None:
        """Forget ``fn`` (added by :meth:`add_loss_callback`), if it has not run."""
        self._callbacks.pop(fn, None)

    def _set_lost(self, reason: str) -> None:
        if self.lost.is_set():
            return
        self._tracked = False
        # The reason first: whoever wakes up on ``lost`` reads it.
        self.lost_reason = reason
        self.lost.set()
        callbacks, self._callbacks = self._callbacks, {}
        for fn in callbacks:
            _run_callback(fn, self)

    def __repr__(self) -> str:
        state = f"lost: {self.lost_reason}" if self.lost.is_set() else f"{self.remaining():.3f} s"
        return f"<KeptLease {self.lease_id:x} ttl={self.ttl_s}s {state}>"


class KeepAliveLoop:
    """Keeps leases alive over one ``LeaseKeepAlive`` stream of ``client``.

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
        # How many kept leases have each TTL: the shortest decides the stall limit.
        self._ttls: Counter[int] = Counter()
        # The requests not answered yet on the current stream, oldest first, per lease
        # ID (not per KeptLease: an answer can arrive for a request sent before the
        # lease was released and kept again).
        self._inflight: dict[int, deque[_Inflight]] = {}
        # One-shot renewals (renew_once) waiting to be written.
        self._once: deque[tuple[int, asyncio.Future[Renewal]]] = deque()
        self._wake = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        self._stream: _Stream | None = None
        # Why the watchdog cancelled the stream, for the log.
        self._stream_failure: str | None = None
        self._answered = False  # the current stream answered at least once
        self._outstanding = 0  # requests written on the current stream, not answered
        self._progress_at = 0.0  # last answer, or first write after a quiet spell
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
        self._endpoint = 0  # the client's endpoint the current stream is on

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
        """Keep-alive requests written so far (for metrics and tests)."""
        return self._requests_sent

    @property
    def answers_received(self) -> int:
        """Keep-alive answers read so far (for metrics and tests)."""
        return self._answers_received

    @property
    def last_member_id(self) -> int | None:
        """The etcd member that sent the last answer: where the stream is."""
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
        if self._renewals[0][2] is kept or self._stream is None:
            # Due before whatever the sender sleeps towards, or the sender is
            # waiting to reopen the stream.
            self._wake.set()
        self._arm_watchdog(valid_until)
        return kept

    async def renew_once(self, lease_id: int, timeout: float) -> Renewal:
        """Renew ``lease_id`` once over the shared stream, kept or not: (send time, TTL).

        The TTL is 0 when etcd says the lease is gone. A request left unanswered by a
        broken stream is sent again on the next one. Raises :class:`BackendUnavailable`
        when no answer came within ``timeout`` seconds.
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
        """Stop the tasks and the stream; leases still kept are lost. Idempotent.

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
            requests = self._inflight.get(kept.lease_id)
            if requests is not None and not requests:
                del self._inflight[kept.lease_id]
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
        waiting += [a for requests in self._inflight.values() for _, a in requests if a is not None]
        self._inflight.clear()
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
        interval = max(min(self._ttls, default=math.inf) / 3, _MIN_INTERVAL_S)
        if self._kept and not self._silence_logged and silence > interval:
            self._silence_logged = True
            _log.warning(
                "etcd has not answered keep-alives for %.1f s, more than a renewal "
                "interval (%s); %d leases at risk",
                silence,
                reason,
                len(self._kept),
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
        next_check = self._check_stall(now)
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

    def _check_stall(self, now: float) -> float:
        """Cancel a stream that stopped answering; when to look again."""
        stream = self._stream
        if stream is None or self._outstanding == 0:
            return math.inf
        limit = self._stall_after()
        if now - self._progress_at < limit:
            return self._progress_at + limit
        # Cancelling wakes the reader, and the sender even inside a blocked write;
        # the sender then opens a stream to the next endpoint.
        self._stream_failure = f"no keep-alive answered for {now - self._progress_at:.2f} s"
        self._outstanding = 0
        stream.cancel()
        return math.inf

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
        """The sender: one stream after another until closed."""
        failures = 0
        while not self._closed:
            try:
                reason = await self._serve_stream()
            except ProviderClosed:
                self._shut(PROVIDER_CLOSED)
                return
            except Exception:
                # A bug, not a stream failure: log it, keep going. The watchdog still
                # marks leases lost on time if renewals stop.
                _log.exception("keep-alive stream failed unexpectedly")
                reason = "unexpected error"
            if self._closed:
                return
            if self._client.closed:  # the provider closed the client under us
                self._shut(PROVIDER_CLOSED)
                return
            failures = 0 if self._answered else failures + 1
            _log.info("etcd keep-alive stream ended (%s); reopening", reason)
            self._log_silence(reason)
            # Pass this member over while another may serve us.
            self._client.failed(self._endpoint, no_leader=is_no_leader(reason))
            if failures:
                # A keep() cuts the wait short: its caller just had a grant
                # answered, so some member is reachable again.
                self._wake.clear()
                delay = min(_BACKOFF_MAX_S, _BACKOFF_MIN_S * 2 ** (failures - 1))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()

    async def _serve_stream(self) -> str:
        """Open a stream, renew over it until it breaks; why it ended."""
        self._answered = False
        try:
            self._endpoint = self._client.preferred()
            metadata = await self._client.metadata(self._endpoint)
            stream = self._client.keep_alive_stream(metadata, self._endpoint)
        except grpc.aio.AioRpcError as exc:
            return self._describe(exc)
        except ProviderClosed:
            raise
        except LeaseError as exc:
            return str(exc)
        except asyncio.CancelledError:
            # A login call cancelled by the channel closing, not us: _run then
            # finds the client closed.
            if _cancelling():
                raise
            return "the login call was cancelled"
        self._stream = stream
        self._stream_failure = None
        # Requests of the old stream will never be answered here: one-shots go again.
        for lease_id, requests in self._inflight.items():
            self._once.extendleft(
                (lease_id, answer) for _, answer in reversed(requests) if answer is not None
            )
        self._inflight.clear()
        self._outstanding = 0
        self._renew_all_now()
        reader = asyncio.get_running_loop().create_task(
            self._read(stream), name="etcd-leases keep-alive reader"
        )
        try:
            reason = await self._send(stream, reader)
        finally:
            self._stream = None
            self._outstanding = 0
            stream.cancel()
            reader.cancel()
            # Wait for it, so no answer of this stream is processed once the next
            # stream's bookkeeping starts; _read returns its errors, never raises them.
            await asyncio.wait([reader])
        if not reader.cancelled():
            reason = reader.result() or reason
        return reason

    def _renew_all_now(self) -> None:
        """On a new stream, renew every kept lease at once, most urgent first."""
        now = time.monotonic()
        urgent_first = sorted(self._kept.values(), key=lambda kept: kept.valid_until)
        # Equal due times and increasing tie-breakers: already a heap.
        self._renewals[:] = [(now, next(self._order), kept) for kept in urgent_first]

    async def _send(self, stream: _Stream, reader: asyncio.Task[str]) -> str:
        """Write renewals as they come due; why the stream ended."""
        while True:
            # Cleared before looking at the heap: a keep() from here on wakes us.
            self._wake.clear()
            if reader.done() or self._closed:
                return self._stream_failure or "the keep-alive stream ended"
            written = 0
            while self._once:
                lease_id, answer = self._once.popleft()
                if answer.done():  # its caller gave up
                    continue
                request = pb.LeaseKeepAliveRequest(ID=lease_id)
                if failure := await self._write(stream, lease_id, request, answer):
                    return failure
                written += 1
            now = time.monotonic()
            while self._renewals and self._renewals[0][0] <= now:
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
                if failure := await self._write(stream, kept.lease_id, kept._request, None):
                    return failure
                written += 1
                if written % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
                if reader.done() or self._closed:
                    break
            if reader.done() or self._closed:
                continue
            timeout = self._renewals[0][0] - time.monotonic() if self._renewals else None
            if timeout is not None and timeout <= 0:
                continue
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _write(
        self,
        stream: _Stream,
        lease_id: int,
        request: pb.LeaseKeepAliveRequest,
        answer: asyncio.Future[Renewal] | None,
    ) -> str | None:
        """Write one request; why the stream ended, or ``None`` if it was written."""
        sent_at = time.monotonic()
        requests = self._inflight.get(lease_id)
        if requests is None:
            requests = self._inflight[lease_id] = deque()
        # Recorded before the write: etcd cannot renew before we send.
        requests.append((sent_at, answer))
        if self._outstanding == 0:
            self._progress_at = sent_at
            self._arm_watchdog(sent_at + self._stall_after())
        self._outstanding += 1
        self._requests_sent += 1
        try:
            await stream.write(request)
        except grpc.aio.AioRpcError as exc:
            return self._describe(exc)
        except asyncio.InvalidStateError:  # the call already ended
            return self._stream_failure or "the keep-alive stream ended"
        except asyncio.CancelledError:
            if _cancelling():
                raise
            return self._stream_failure or "the keep-alive stream was cancelled"
        return None

    async def _read(self, stream: _Stream) -> str:
        """The reader: apply answers until the stream ends; why it ended."""
        try:
            while True:
                response = await stream.read()
                if not isinstance(response, pb.LeaseKeepAliveResponse):
                    return "etcd closed the keep-alive stream"
                self._on_answer(response)
        except grpc.aio.AioRpcError as exc:
            return self._describe(exc)
        except asyncio.CancelledError:
            if _cancelling():
                raise
            return self._stream_failure or "the keep-alive stream was cancelled"
        except Exception:
            # Never let the reader die with an error nobody retrieves.
            _log.exception("the keep-alive reader failed")
            return "unexpected error in the keep-alive reader"
        finally:
            self._wake.set()  # the sender notices the stream is over

    def _on_answer(self, response: pb.LeaseKeepAliveResponse) -> None:
        now = time.monotonic()
        if self._silence_logged:
            self._silence_logged = False
            _log.info("etcd answers keep-alives again, after %.1f s", now - self._answered_at)
        self._answered_at = now
        self._answers_received += 1
        self._answered = True
        self._progress_at = now
        if self._outstanding > 0:
            self._outstanding -= 1
        self._last_member_id = response.header.member_id
        lease_id = response.ID
        # etcd answers one stream's requests in order: this answers the oldest
        # request still unanswered for this lease.
        sent_at: float | None = None
        requests = self._inflight.get(lease_id)
        if requests:
            sent_at, answer = requests.popleft()
            if answer is not None and not answer.done():
                answer.set_result((sent_at, max(0, response.TTL)))
        kept = self._kept.get(lease_id)
        if kept is None:
            if requests is not None and not requests:
                del self._inflight[lease_id]
            return
        if response.TTL <= 0:
            self._lose(kept, LEASE_NOT_FOUND)
        elif now >= kept.valid_until:
            # Too late: the holder may already have seen remaining() reach 0.
            self._lose(kept, DEADLINE_PASSED)
        elif sent_at is not None:
            kept.valid_until = max(kept.valid_until, sent_at + response.TTL)

    def _describe(self, exc: grpc.aio.AioRpcError) -> str:
        if _INVALID_TOKEN in (exc.details() or ""):
            self._client.invalidate_token(self._endpoint)
        return str(to_lease_error(exc))
