"""``LeaseKeepAlive`` streams to one etcd member, and what they have not answered.

A member answers a stream's requests in order, one at a time: a follower forwards
each renewal to the leader and waits for it, so a follower whose leader froze holds
every later request of the stream behind the stuck one. A :class:`RenewalStream`
therefore never blocks its sender: requests go into a queue that a writer task of
its own drains, writing as fast as gRPC takes them. The time each request is written
(etcd cannot renew before it) is remembered until its answer. A lease whose renewal
is still queued on its lane is not queued twice, and one with two renewals waiting
there for their answers gets no third: a member answering slower than the renewals
fall due would be sent a backlog growing for as long as that lasts. Two, not one: the
keep-alive loop renews every third of the TTL, answered or not, so a lease survives
round trips of up to two thirds of its TTL (with one, a third).

gRPC takes one message at a time per call, each a round trip through its polling
thread: on a loaded host every round trip waits for both threads to get the CPU, so
the calls in flight, not the CPU spent, bound the rate. A stream therefore spreads its
leases over several calls (*lanes*) to the same member: one at first, one more for
each request whose lane has more than :data:`_BUSY` requests queued or unanswered,
up to :data:`LANES` (a burst of 400 opens 26-28). A lease
goes on lane ``lease_id % lanes open``, so it moves only when a lane opens; each lane
matches its own answers to its own requests, in order. 5,000 leases of 3 s beside two
CPU hogs on 2 cores were renewed 2,500-3,600 times a second over a fixed 4 lanes,
too few for their TTLs; over up to 32, 4,100-4,400. A process with few leases keeps
one lane: each costs the member a stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

import grpc
import grpc.aio

from etcd_leases.etcd.auth import Metadata
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.rpc_errors import is_invalid_token, to_lease_error
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

__all__ = ["Inflight", "Renewal", "RenewalStream", "cancelling"]

# A one-shot renewal's answer: when its request was sent, and the TTL etcd answered.
Renewal = tuple[float, int]
# A request sent and not answered yet: its send time, and who waits for its answer.
Inflight = tuple[float, "asyncio.Future[Renewal] | None"]
_Call = grpc.aio.StreamStreamCall[pb.LeaseKeepAliveRequest, pb.LeaseKeepAliveResponse]
AnswerHandler = Callable[["RenewalStream", pb.LeaseKeepAliveResponse, Inflight | None], None]
SentHandler = Callable[["RenewalStream", int, float], None]
StreamHandler = Callable[["RenewalStream"], None]
_Queued = tuple[int, pb.LeaseKeepAliveRequest, "asyncio.Future[Renewal] | None"]

_log = logging.getLogger("etcd_leases.etcd.keepalive")

# Hand the event loop back every so many writes of a burst.
_YIELD_EVERY = 256
# The most gRPC calls a stream spreads its leases over.
LANES = 32
# The most renewals of one lease a lane waits on the answers of (see above).
_INFLIGHT_PER_LEASE = 2
# Requests waiting on a lane (queued, or written and not answered) past which the
# stream opens another lane.
_BUSY = 32


def cancelling() -> bool:
    """True when the current task itself is being cancelled.

    gRPC raises ``CancelledError`` into whoever waits on a call that was cancelled
    locally (by us, or by the channel closing); only a cancellation of the task
    must propagate, the other kind just means the stream is over.
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _Lane:
    """One gRPC call of a stream: its queue, and its requests not answered yet."""

    def __init__(self, call: _Call) -> None:
        self.call = call
        self.queue: deque[_Queued] = deque()
        self.queued_renewals: set[int] = set()  # leases with a renewal in the queue
        self.queued = asyncio.Event()
        # Per lease ID, oldest first: etcd answers a call's requests in order.
        self.inflight: dict[int, deque[Inflight]] = {}
        self.outstanding = 0
        self.progress_at = 0.0  # the last answer, or the first request after a quiet spell
        self.tasks: tuple[asyncio.Task[None], ...] = ()


class RenewalStream:
    """``LeaseKeepAlive`` calls (lanes) on endpoint ``endpoint`` of a client.

    ``on_answer(stream, response, inflight)`` runs for every answer, with the request
    it answers (``None`` if unknown); ``on_sent(stream, lease_id, sent_at)`` as each
    request is written; ``on_waiting(stream)`` when one is written with none outstanding
    on its lane (a stall may start); ``on_end(stream)`` once when the stream ends, for
    whatever reason (``failure`` then says why, ``failed`` whether the member is to
    blame). A lane that fails ends the whole stream.
    """

    def __init__(
        self,
        client: EtcdClient,
        endpoint: int,
        metadata: Metadata,
        on_answer: AnswerHandler,
        on_sent: SentHandler,
        on_waiting: StreamHandler,
        on_end: StreamHandler,
    ) -> None:
        self.endpoint = endpoint
        self._client = client
        self._metadata = metadata
        self._on_answer = on_answer
        self._on_sent = on_sent
        self._on_waiting = on_waiting
        self._on_end = on_end
        self._lanes: list[_Lane | None] = [None] * LANES
        self._spread = 1  # the lanes leases are spread over
        #: Whether the stream answered at least once.
        self.answered = False
        #: Why the stream ended, once it has.
        self.failure: str | None = None
        #: Whether the member is to blame for the end.
        self.failed = False

    @classmethod
    async def open(
        cls,
        client: EtcdClient,
        endpoint: int,
        on_answer: AnswerHandler,
        on_sent: SentHandler,
        on_waiting: StreamHandler,
        on_end: StreamHandler,
        login_timeout: float,
    ) -> RenewalStream | str:
        """A stream on ``endpoint`` with its first lane open, or why it could not be opened."""
        try:
            # A frozen member never answers a login: give up on it for this round.
            async with asyncio.timeout(login_timeout):
                metadata = await client.auth.metadata(endpoint)
            stream = cls(client, endpoint, metadata, on_answer, on_sent, on_waiting, on_end)
            stream._lane(0)
        except TimeoutError:
            return f"no login answer in {login_timeout:.2f} s"
        except grpc.aio.AioRpcError as exc:
            return str(to_lease_error(exc))
        except asyncio.CancelledError:
            # A login call cancelled by the channel closing, not us.
            if cancelling():
                raise
            return "the login call was cancelled"
        return stream

    @property
    def ended(self) -> bool:
        return self.failure is not None

    @property
    def outstanding(self) -> int:
        """Requests written and not answered."""
        return sum(lane.outstanding for lane in self._open_lanes())

    @property
    def progress_at(self) -> float:
        """Since when the stream has been waiting: the oldest progress of a lane with
        requests outstanding (the last answer of any lane when none is)."""
        lanes = list(self._open_lanes())
        waiting = [lane.progress_at for lane in lanes if lane.outstanding]
        if waiting:
            return min(waiting)
        return max((lane.progress_at for lane in lanes), default=0.0)

    def send(
        self,
        lease_id: int,
        request: pb.LeaseKeepAliveRequest,
        answer: asyncio.Future[Renewal] | None,
    ) -> bool:
        """Queue ``request`` (a renewal of a lease, or a one-shot whose ``answer`` waits);
        whether it was queued (not when the stream ended, or a renewal of the lease
        is still queued on its lane, or two wait there for their answers)."""
        if self.ended:
            return False
        lane = self._lane(lease_id % self._spread)
        if len(lane.queue) + lane.outstanding > _BUSY and self._spread < LANES:
            self._spread += 1
            lane = self._lane(lease_id % self._spread)
        if answer is None:
            if (
                lease_id in lane.queued_renewals
                or len(lane.inflight.get(lease_id, ())) >= _INFLIGHT_PER_LEASE
            ):
                return False
            lane.queued_renewals.add(lease_id)
        lane.queue.append((lease_id, request, answer))
        lane.queued.set()
        return True

    def unanswered(self) -> list[tuple[int, asyncio.Future[Renewal]]]:
        """The one-shot renewals given to this stream and not answered, whose callers
        still wait."""
        waiting: list[tuple[int, asyncio.Future[Renewal] | None]] = []
        for lane in self._open_lanes():
            waiting += [(lease_id, answer) for lease_id, _, answer in lane.queue]
            waiting += [
                (lease_id, answer)
                for lease_id, requests in lane.inflight.items()
                for _, answer in requests
            ]
        return [
            (lease_id, answer)
            for lease_id, answer in waiting
            if answer is not None and not answer.done()
        ]

    def end(self, reason: str, *, failed: bool) -> None:
        """End the stream (idempotent); ``failed``: the member did not serve us."""
        if self.ended:
            return
        self.failure = reason
        self.failed = failed
        current = asyncio.current_task()
        for lane in self._open_lanes():
            lane.call.cancel()
            for task in lane.tasks:
                if task is not current:
                    task.cancel()
        self._on_end(self)

    async def wait_ended(self) -> None:
        """Return once the tasks of every lane are over."""
        tasks = [task for lane in self._open_lanes() for task in lane.tasks]
        if tasks:
            await asyncio.wait(tasks)

    def _open_lanes(self) -> Iterator[_Lane]:
        return (lane for lane in self._lanes if lane is not None)

    def _lane(self, index: int) -> _Lane:
        lane = self._lanes[index]
        if lane is None:
            lane = self._lanes[index] = _Lane(
                self._client.keep_alive_stream(self._metadata, self.endpoint)
            )
            loop = asyncio.get_running_loop()
            lane.tasks = (
                loop.create_task(self._write_all(lane), name="etcd-leases keep-alive writer"),
                loop.create_task(self._read_all(lane), name="etcd-leases keep-alive reader"),
            )
        return lane

    async def _write_all(self, lane: _Lane) -> None:
        written = 0
        try:
            while True:
                while not lane.queue:
                    lane.queued.clear()
                    await lane.queued.wait()
                lease_id, request, answer = lane.queue.popleft()
                if answer is None:
                    lane.queued_renewals.discard(lease_id)
                elif answer.done():
                    continue  # its caller gave up
                self._sent(lane, lease_id, answer)
                await lane.call.write(request)
                written += 1
                if written % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        except grpc.aio.AioRpcError as exc:
            self.end(self._describe(exc), failed=True)
        except asyncio.InvalidStateError:  # the call already ended
            self.end("the keep-alive stream ended", failed=True)
        except asyncio.CancelledError:
            if cancelling():
                raise
            self.end("the keep-alive stream was cancelled", failed=True)

    async def _read_all(self, lane: _Lane) -> None:
        try:
            while True:
                response = await lane.call.read()
                if not isinstance(response, pb.LeaseKeepAliveResponse):
                    self.end("etcd closed the keep-alive stream", failed=True)
                    return
                self._answer(lane, response)
        except grpc.aio.AioRpcError as exc:
            self.end(self._describe(exc), failed=True)
        except asyncio.CancelledError:
            if cancelling():
                raise
            self.end("the keep-alive stream was cancelled", failed=True)
        except Exception:
            # Never let the reader die with an error nobody retrieves.
            _log.exception("the keep-alive reader failed")
            self.end("unexpected error in the keep-alive reader", failed=True)

    def _sent(self, lane: _Lane, lease_id: int, answer: asyncio.Future[Renewal] | None) -> None:
        # Recorded before the write: etcd cannot renew before we send.
        sent_at = time.monotonic()
        requests = lane.inflight.get(lease_id)
        if requests is None:
            requests = lane.inflight[lease_id] = deque()
        requests.append((sent_at, answer))
        lane.outstanding += 1
        self._on_sent(self, lease_id, sent_at)
        if lane.outstanding == 1:
            lane.progress_at = sent_at
            self._on_waiting(self)

    def _answer(self, lane: _Lane, response: pb.LeaseKeepAliveResponse) -> None:
        self.answered = True
        lane.progress_at = time.monotonic()
        if lane.outstanding > 0:
            lane.outstanding -= 1
        inflight: Inflight | None = None
        requests = lane.inflight.get(response.ID)
        if requests:
            inflight = requests.popleft()
            if not requests:
                del lane.inflight[response.ID]
        self._on_answer(self, response, inflight)

    def _describe(self, exc: grpc.aio.AioRpcError) -> str:
        if is_invalid_token(exc):
            self._client.auth.invalidate(self.endpoint)
        return str(to_lease_error(exc))
