"""A round of keep-alive streams: one on every member at once, the first to answer serves.

The member a stream is on may answer nothing while a quorum is up elsewhere. A frozen
member keeps its connections open; a follower whose leader froze forwards a renewal to
it and holds every later request of the stream behind that one. Trying members one
after another costs a stall limit each, and with the frozen leader next in line, two
of them (issue 14) exceed what is left of a 3 s TTL. Keep-alives are idempotent, so
sending them to every member costs nothing but a few messages, and the first member
that answers proves it reaches the leader: the round's other streams end then, and
unary calls follow that member too.

A stream with requests outstanding and no answer for the stall limit ends; the round
is over when all its streams have ended, and the keep-alive loop opens the next.

A round no member has answered yet is *widened* every so often: a fresh stream on every
member, beside the ones still waiting. A follower that forwarded a renewal to a frozen
leader keeps waiting on it after the others elected a new leader (until etcd's request
timeout, seconds); its older streams cannot answer, a new one can. Without widening, a
round opened just before the election waited a whole stall limit, and the leases, whose
first stall had already cost one, ran out (issue 14, under load).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.renewal_stream import Inflight, Renewal, RenewalStream
from etcd_leases.etcd.rpc_errors import is_no_leader
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

__all__ = ["RenewalRound"]

AnswerHandler = Callable[[pb.LeaseKeepAliveResponse, Inflight | None], None]
SentHandler = Callable[[int, float], None]
StreamHandler = Callable[[RenewalStream], None]


class RenewalRound:
    """The streams of one round, on every member that opened one."""

    def __init__(
        self,
        client: EtcdClient,
        on_answer: AnswerHandler,
        on_sent: SentHandler,
        on_waiting: StreamHandler,
        on_end: StreamHandler,
    ) -> None:
        """``on_answer(response, inflight)`` runs for every answer; ``on_sent(lease_id,
        sent_at)`` for every request written once a member answered (the requests of
        a round not answered yet may sit unread on a frozen member); ``on_waiting(stream)``
        when a stream may start to stall, ``on_end(stream)`` when one has ended."""
        self._client = client
        self._on_answer = on_answer
        self._on_sent = on_sent
        self._on_waiting = on_waiting
        self._on_end = on_end
        # The streams still open: one per member until one answers.
        self.streams: list[RenewalStream] = []
        self._all: list[RenewalStream] = []
        #: Whether a member answered in this round.
        self.answered = False
        #: Why the last stream that failed did, if one did.
        self.failure: str | None = None
        #: When streams were last opened on every member.
        self.opened_at = 0.0

    async def open(self, login_timeout: float) -> str | None:
        """Open a stream on every member; ``None``, or why none could be opened.

        Called again on a round that is not over, it widens it: the new streams get
        the one-shot renewals the others have not answered (renewals are the caller's).
        """
        waiting = self.unanswered()
        opening = [
            asyncio.ensure_future(
                RenewalStream.open(
                    self._client,
                    index,
                    self._answer,
                    self._sent,
                    self._on_waiting,
                    self._ended,
                    login_timeout=login_timeout,
                )
            )
            for index in range(len(self._client.endpoints))
        ]
        try:
            opened = await asyncio.gather(*opening)
        except BaseException:
            # Cancelled (the loop closes): end the streams that opened, which nobody
            # would end otherwise (their calls outlive the event loop).
            for task in opening:
                if not task.cancelled() and task.done() and task.exception() is None:
                    stream = task.result()
                    if isinstance(stream, RenewalStream):
                        stream.end("the round was given up", failed=False)
            raise
        self.opened_at = time.monotonic()
        new = [stream for stream in opened if isinstance(stream, RenewalStream)]
        self._all += new
        if not new:
            return "; ".join(str(reason) for reason in opened)
        if self.answered:  # while these opened: the round has its member
            for stream in new:
                stream.end("another member answered first", failed=False)
            return None
        self.streams += new
        for lease_id, answer in waiting:
            for stream in new:
                stream.send(lease_id, pb.LeaseKeepAliveRequest(ID=lease_id), answer)
        return None

    @property
    def over(self) -> bool:
        return not self.streams

    def send(
        self,
        lease_id: int,
        request: pb.LeaseKeepAliveRequest,
        answer: asyncio.Future[Renewal] | None,
    ) -> int:
        """Send to every open stream; to how many it went."""
        return sum(stream.send(lease_id, request, answer) for stream in self.streams)

    def end_stalled(self, now: float, limit: float) -> float:
        """End the streams that waited ``limit`` s for an answer; when to look again."""
        next_check = math.inf
        for stream in list(self.streams):
            if stream.outstanding == 0:
                continue
            if now - stream.progress_at < limit:
                next_check = min(next_check, stream.progress_at + limit)
            else:
                silent = now - stream.progress_at
                stream.end(f"a stream went {silent:.2f} s without an answer", failed=True)
        return next_check

    async def close(self, reason: str) -> list[tuple[int, asyncio.Future[Renewal]]]:
        """End every stream; the one-shot renewals they leave unanswered (callers wait)."""
        for stream in self._all:
            stream.end(reason, failed=False)
        await asyncio.gather(*(stream.wait_ended() for stream in self._all))
        return self.unanswered(self._all)

    def unanswered(
        self, streams: list[RenewalStream] | None = None
    ) -> list[tuple[int, asyncio.Future[Renewal]]]:
        """The one-shot renewals ``streams`` (the open ones by default) left unanswered,
        each once."""
        again = {
            id(answer): (lease_id, answer)
            for stream in (self.streams if streams is None else streams)
            for lease_id, answer in stream.unanswered()
        }
        return list(again.values())

    def _answer(
        self, stream: RenewalStream, response: pb.LeaseKeepAliveResponse, inflight: Inflight | None
    ) -> None:
        self.answered = True
        if len(self.streams) > 1:
            # The first member to answer this round serves it; calls follow it too.
            for other in list(self.streams):
                if other is not stream:
                    other.end("another member answered first", failed=False)
            self._client.members.answered(stream.endpoint)
        self._on_answer(response, inflight)

    def _sent(self, stream: RenewalStream, lease_id: int, sent_at: float) -> None:
        if self.answered:
            self._on_sent(lease_id, sent_at)

    def _ended(self, stream: RenewalStream) -> None:
        if stream in self.streams:
            self.streams.remove(stream)
        if stream.failed and stream.failure is not None:
            self.failure = stream.failure
            # Pass this member over in calls while another may serve them.
            self._client.members.failed(stream.endpoint, no_leader=is_no_leader(stream.failure))
        self._on_end(stream)
