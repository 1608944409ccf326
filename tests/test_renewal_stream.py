"""RenewalStream against a real etcd: what it sends, what it remembers, how it ends.

The keep-alive loop relies on a stream for three things: each answer comes with the
request it answers (its send time, and who waits for it); a renewal still queued, or
written twice and not answered, is not sent again, while one-shot renewals always are;
and a stream that ends (by us, or by its member) says why once, and hands back the
one-shots it never answered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeAlias

import grpc
import grpc.aio
import pytest

from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.lease_ids import new_lease_id
from etcd_leases.etcd.renewal_stream import (
    _BUSY,
    LANES,
    Inflight,
    Renewal,
    RenewalStream,
    cancelling,
)
from etcd_leases.etcd.rpc_errors import is_no_leader
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.testing import EtcdCluster
from tests.conftest import (
    HeldKeepAliveAnswers,
    KeepAliveCall,
    Records,
    enable_auth,
    etcd_error,
    eventually,
)

KeepAliveStreamCall: TypeAlias = grpc.aio.StreamStreamCall[
    pb.LeaseKeepAliveRequest, pb.LeaseKeepAliveResponse
]


class Events:
    """What a stream called back, in order."""

    def __init__(self) -> None:
        self.answers: list[tuple[pb.LeaseKeepAliveResponse, Inflight | None, float]] = []
        self.sent: list[tuple[int, float]] = []
        self.waiting: list[float] = []
        self.ended: list[RenewalStream] = []

    def on_answer(
        self, stream: RenewalStream, response: pb.LeaseKeepAliveResponse, inflight: Inflight | None
    ) -> None:
        self.answers.append((response, inflight, time.monotonic()))

    def on_sent(self, stream: RenewalStream, lease_id: int, sent_at: float) -> None:
        self.sent.append((lease_id, sent_at))

    def on_waiting(self, stream: RenewalStream) -> None:
        self.waiting.append(time.monotonic())

    def on_end(self, stream: RenewalStream) -> None:
        self.ended.append(stream)


async def _open_or_why(
    client: EtcdClient, events: Events, endpoint: int = 0, login_timeout: float = 5.0
) -> RenewalStream | str:
    return await RenewalStream.open(
        client,
        endpoint,
        events.on_answer,
        events.on_sent,
        events.on_waiting,
        events.on_end,
        login_timeout=login_timeout,
    )


async def _open(client: EtcdClient, events: Events, endpoint: int = 0) -> RenewalStream:
    stream = await _open_or_why(client, events, endpoint)
    assert isinstance(stream, RenewalStream), stream
    return stream


def _wrap_calls(
    client: EtcdClient,
    monkeypatch: pytest.MonkeyPatch,
    wrap: Callable[[KeepAliveStreamCall], KeepAliveCall],
) -> None:
    """The client's keep-alive calls from now on, each as ``wrap`` makes it."""
    open_call = client.keep_alive_stream
    monkeypatch.setattr(client, "keep_alive_stream", lambda *args: wrap(open_call(*args)))


def _request(lease_id: int) -> pb.LeaseKeepAliveRequest:
    return pb.LeaseKeepAliveRequest(ID=lease_id)


async def _granted(client: EtcdClient, count: int = 1, ttl_s: int = 10) -> list[int]:
    lease_ids = [new_lease_id() for _ in range(count)]
    for lease_id in lease_ids:
        await client.grant(ttl_s, lease_id)
    return lease_ids


async def test_each_answer_comes_with_the_request_it_answers(client: EtcdClient) -> None:
    # One lease per lane and then some: every lease is answered on its own lane, its
    # answers in the order of its requests.
    lease_ids = await _granted(client, LANES + 2)
    events = Events()
    stream = await _open(client, events)
    try:
        before = time.monotonic()
        for lease_id in lease_ids:
            assert stream.send(lease_id, _request(lease_id), None)
        answer: asyncio.Future[Renewal] = asyncio.get_running_loop().create_future()
        assert stream.send(lease_ids[0], _request(lease_ids[0]), answer)
        await eventually(lambda: len(events.answers) == len(lease_ids) + 1, "every answer")
        assert stream.answered and stream.outstanding == 0
        assert sorted(r.ID for r, _, _ in events.answers) == sorted([*lease_ids, lease_ids[0]])
        for response, inflight, answered_at in events.answers:
            assert inflight is not None, response.ID
            sent_at, _ = inflight
            assert before <= sent_at <= answered_at
            assert response.TTL == 10
        # Each write reported as it was made, with the send time its answer came with.
        assert sorted(events.sent) == sorted(
            (r.ID, inflight[0]) for r, inflight, _ in events.answers if inflight
        )
        # The first lease's two requests, each answered as itself: the renewal, and the
        # one-shot (on another lane if one opened between them).
        firsts = [inflight for r, inflight, _ in events.answers if lease_ids[0] == r.ID]
        waiters = [inflight[1] for inflight in firsts if inflight]
        assert len(waiters) == 2 and None in waiters and answer in waiters
        assert stream.unanswered() == []
    finally:
        stream.end("the test is over", failed=False)
        await stream.wait_ended()


async def test_a_stream_opens_lanes_as_its_requests_back_up(client: EtcdClient) -> None:
    """Renewals answered as they come keep to one call (each costs the member a stream);
    a burst backs up on it, and the stream spreads the rest over more calls, up to
    LANES, every request still answered with its own send time."""
    lease_ids = await _granted(client, 400)
    events = Events()
    stream = await _open(client, events)
    try:
        for count, lease_id in enumerate(lease_ids[:5], start=1):  # each answered first

            def answered(count: int = count) -> bool:
                return len(events.answers) == count

            assert stream.send(lease_id, _request(lease_id), None)
            await eventually(answered, "the answer")
        assert len(list(stream._open_lanes())) == 1
        for lease_id in lease_ids:
            assert stream.send(lease_id, _request(lease_id), None)
        opened = len(list(stream._open_lanes()))
        assert 1 < opened <= LANES
        await eventually(lambda: len(events.answers) == 405, "every answer")
        assert all(inflight is not None for _, inflight, _ in events.answers)
        assert sorted(r.ID for r, _, _ in events.answers[5:]) == sorted(lease_ids)
    finally:
        stream.end("the test is over", failed=False)
        await stream.wait_ended()
    for lease_id in lease_ids:
        await client.revoke(lease_id)


async def test_a_stream_opens_a_lane_when_its_requests_wait_for_answers(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member slow to answer backs requests up as written and unanswered, not queued:
    those count too, so the stream opens another lane once more than _BUSY wait, and
    spreads the leases over the lanes open (a lease moves only when one opens)."""
    waiting = await _granted(client, _BUSY + 1)
    beyond = new_lease_id() | 3  # lane 1 of two (lane 3 of LANES)
    await client.grant(10, beyond)
    flowing = asyncio.Event()
    _wrap_calls(client, monkeypatch, lambda call: HeldKeepAliveAnswers(call, flowing))
    events = Events()
    stream = await _open(client, events)
    try:
        for count, lease_id in enumerate(waiting, start=1):  # each written first

            def written(count: int = count) -> bool:
                return stream.outstanding == count

            assert stream.send(lease_id, _request(lease_id), None)
            await eventually(written, "the renewal written")
        assert len(list(stream._open_lanes())) == 1
        assert stream.send(beyond, _request(beyond), None)
        assert len(list(stream._open_lanes())) == 2 and stream._lanes[1] is not None
        flowing.set()
        await eventually(lambda: len(events.answers) == _BUSY + 2, "every answer")
    finally:
        stream.end("the test is over", failed=False)
        await stream.wait_ended()
    for lease_id in [*waiting, beyond]:
        await client.revoke(lease_id)


async def test_a_stall_may_start_when_a_request_is_written_with_none_outstanding(
    client: EtcdClient,
) -> None:
    (lease_id,) = await _granted(client)
    events = Events()
    stream = await _open(client, events)
    try:
        assert stream.progress_at == 0.0 and stream.outstanding == 0  # nothing sent yet
        assert not stream.answered and not stream.ended and not stream.failed
        stream.send(lease_id, _request(lease_id), None)
        await eventually(lambda: len(events.answers) == 1, "the answer")
        assert len(events.waiting) == 1
        (_, inflight, answered_at) = events.answers[0]
        assert inflight is not None
        assert events.waiting[0] >= inflight[0]  # from the request's send time on
        # No request outstanding: the stream's progress is its last answer.
        assert inflight[0] < stream.progress_at <= answered_at
        stream.send(lease_id, _request(lease_id), None)
        await eventually(lambda: len(events.answers) == 2, "the second answer")
        assert len(events.waiting) == 2  # the first was answered: a new stall may start
    finally:
        stream.end("the test is over", failed=False)
        await stream.wait_ended()


async def test_a_queued_renewal_is_not_queued_twice_but_a_one_shot_always_is(
    client: EtcdClient,
) -> None:
    (lease_id,) = await _granted(client)
    events = Events()
    stream = await _open(client, events)
    loop = asyncio.get_running_loop()
    first: asyncio.Future[Renewal] = loop.create_future()
    second: asyncio.Future[Renewal] = loop.create_future()
    given_up: asyncio.Future[Renewal] = loop.create_future()
    try:
        # All of this before the stream's writer runs: each stays queued.
        assert stream.send(lease_id, _request(lease_id), None)
        assert not stream.send(lease_id, _request(lease_id), None)
        assert stream.send(lease_id, _request(lease_id), first)
        assert stream.send(lease_id, _request(lease_id), second)
        assert stream.send(lease_id, _request(lease_id), given_up)
        given_up.cancel()  # its caller gave up: it is never sent
        assert stream.unanswered() == [(lease_id, first), (lease_id, second)]
        await eventually(lambda: len(events.answers) == 3, "three answers")
        # Written, the renewal may be queued again; answered after any given-up one
        # (a lane's answers come in order), so the answers now are all there are.
        assert stream.send(lease_id, _request(lease_id), None)
        await eventually(lambda: len(events.answers) == 4, "the last answer")
        assert [inflight[1] if inflight else "?" for _, inflight, _ in events.answers] == [
            None,
            first,
            second,
            None,
        ]
    finally:
        stream.end("the test is over", failed=False)
        await stream.wait_ended()


async def test_a_lease_with_two_renewals_waiting_for_answers_gets_no_third(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The member is slow to answer: a lease whose lane waits for the answers of two of
    its renewals is not sent a third there (a member answering slower than renewals
    fall due would be sent a backlog growing as long as that lasts); two, so a round
    trip of up to two renewal intervals still renews it in time. A one-shot always is
    sent: its caller waits for an answer of its own."""
    (lease_id,) = await _granted(client)
    flowing = asyncio.Event()
    _wrap_calls(client, monkeypatch, lambda call: HeldKeepAliveAnswers(call, flowing))
    events = Events()
    stream = await _open(client, events)
    one_shot: asyncio.Future[Renewal] = asyncio.get_running_loop().create_future()
    try:
        assert stream.send(lease_id, _request(lease_id), None)
        await eventually(lambda: stream.outstanding == 1, "the first renewal written")
        assert stream.send(lease_id, _request(lease_id), None)
        await eventually(lambda: stream.outstanding == 2, "the second renewal written")
        assert not stream.send(lease_id, _request(lease_id), None)
        assert stream.send(lease_id, _request(lease_id), one_shot)
        await eventually(lambda: stream.outstanding == 3, "the one-shot written")
        flowing.set()
        await eventually(lambda: len(events.answers) == 3, "the three answers")
        assert stream.send(lease_id, _request(lease_id), None)  # answered: due again
        await eventually(lambda: len(events.answers) == 4, "the next answer")
        assert [inflight[1] if inflight else "?" for _, inflight, _ in events.answers] == [
            None,
            None,
            one_shot,
            None,
        ]
    finally:
        stream.end("the test is over", failed=False)
        await stream.wait_ended()


async def test_ending_a_stream_says_why_once_and_keeps_its_unanswered_one_shots(
    client: EtcdClient,
) -> None:
    lease_id = new_lease_id() & ~1  # lane 0 of two
    other_id = lease_id + 1  # lane 1 of two
    for granted in (lease_id, other_id):
        await client.grant(10, granted)
    events = Events()
    stream = await _open(client, events)
    loop = asyncio.get_running_loop()
    waiting: list[asyncio.Future[Renewal]] = [loop.create_future() for _ in range(_BUSY + 1)]
    other: asyncio.Future[Renewal] = loop.create_future()
    for answer in waiting:  # queued on lane 0, none written yet: the next opens lane 1
        assert stream.send(lease_id, _request(lease_id), answer)
    assert stream.send(other_id, _request(other_id), other)
    assert stream._lanes[1] is not None and not stream.ended
    stream.end("enough", failed=False)
    stream.end("twice", failed=True)  # ended already: nothing changes
    assert stream.ended and stream.failure == "enough" and stream.failed is False
    assert events.ended == [stream]
    await stream.wait_ended()
    assert all(task.done() for task in asyncio.all_tasks() if "keep-alive" in task.get_name())
    unanswered = sorted(stream.unanswered(), key=lambda pair: pair[0])
    # Every lane's, for the next round.
    assert unanswered == [*((lease_id, answer) for answer in waiting), (other_id, other)]
    assert not stream.send(lease_id, _request(lease_id), None)
    assert events.answers == []


async def test_a_stream_whose_member_dies_ends_failed_with_etcds_error(etcd_binary: str) -> None:
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        client = EtcdClient(etcd.endpoints, timeout=5)
        try:
            (lease_id,) = await _granted(client)
            events = Events()
            stream = await _open(client, events)
            stream.send(lease_id, _request(lease_id), None)
            await eventually(lambda: len(events.answers) == 1, "the answer")
            await asyncio.to_thread(etcd.members[0].kill)
            await eventually(lambda: stream.ended, "the stream ended")
            assert stream.failed
            assert stream.failure is not None and stream.failure.startswith("etcd: UNAVAILABLE")
            assert events.ended == [stream]
            await stream.wait_ended()
        finally:
            await client.close()


async def test_a_stream_whose_channel_closes_ends_as_cancelled(etcd_binary: str) -> None:
    # The client closing under a stream (not our task being cancelled) just ends it.
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        client = EtcdClient(etcd.endpoints, timeout=5)
        events = Events()
        stream = await _open(client, events)
        await client.close()
        await eventually(lambda: stream.ended, "the stream ended")
        assert stream.failure == "the keep-alive stream was cancelled" and stream.failed
        assert events.ended == [stream]
        await stream.wait_ended()


class FailingWrites(HeldKeepAliveAnswers):
    """A keep-alive call whose writes fail with ``error``, its answers held back: the
    writer meets the failure, not the reader."""

    def __init__(self, call: KeepAliveStreamCall, error: BaseException) -> None:
        super().__init__(call, asyncio.Event())
        self._error = error

    async def write(self, request: pb.LeaseKeepAliveRequest) -> None:
        raise self._error


@pytest.mark.parametrize(
    ("error", "failure"),
    [
        (
            etcd_error(grpc.StatusCode.UNAVAILABLE, "write failed (test)"),
            "etcd: UNAVAILABLE: write failed (test)",
        ),
        (asyncio.InvalidStateError(), "the keep-alive stream ended"),
        (asyncio.CancelledError(), "the keep-alive stream was cancelled"),
    ],
    ids=["etcd-error", "call-over", "call-cancelled"],
)
async def test_a_write_that_fails_ends_the_stream_failed_and_says_why(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch, error: BaseException, failure: str
) -> None:
    """A write fails (etcd's error; the call already over; the call cancelled, not our
    task): the stream ends, the member blamed, with the reason, told once."""
    (lease_id,) = await _granted(client)
    _wrap_calls(client, monkeypatch, lambda call: FailingWrites(call, error))
    events = Events()
    stream = await _open(client, events)
    assert stream.send(lease_id, _request(lease_id), None)
    await eventually(lambda: stream.ended, "the stream ended")
    assert (stream.failure, stream.failed) == (failure, True)
    assert events.ended == [stream]
    await stream.wait_ended()


class ClosedAnswers(KeepAliveCall):
    """A keep-alive call the server ends cleanly (no error status) once written to."""

    async def read(self) -> object:
        return grpc.aio.EOF  # type: ignore[attr-defined]  # (not in grpc-stubs)


async def test_a_stream_the_server_closes_cleanly_ends_failed(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd ends keep-alive streams with an error status (a member stopped gracefully
    gives UNAVAILABLE); a clean end, which a proxy or a later etcd may send, ends the
    stream all the same, the member blamed."""
    (lease_id,) = await _granted(client)
    _wrap_calls(client, monkeypatch, ClosedAnswers)
    events = Events()
    stream = await _open(client, events)
    assert stream.send(lease_id, _request(lease_id), None)
    await eventually(lambda: stream.ended, "the stream ended")
    assert (stream.failure, stream.failed) == ("etcd closed the keep-alive stream", True)
    assert events.ended == [stream] and events.answers == []
    await stream.wait_ended()


async def test_an_answer_handler_that_raises_ends_the_stream_and_is_logged(
    client: EtcdClient, no_background_task_fails: Records
) -> None:
    (lease_id,) = await _granted(client)
    ended: list[RenewalStream] = []

    def on_answer(
        stream: RenewalStream, response: pb.LeaseKeepAliveResponse, inflight: Inflight | None
    ) -> None:
        raise RuntimeError("a bug in the handler")

    stream = await RenewalStream.open(
        client, 0, on_answer, lambda s, i, t: None, lambda s: None, ended.append, login_timeout=5.0
    )
    assert isinstance(stream, RenewalStream)
    stream.send(lease_id, _request(lease_id), None)
    await eventually(lambda: stream.ended, "the stream ended")
    assert stream.failure == "unexpected error in the keep-alive reader" and stream.failed
    assert ended == [stream]
    (record,) = no_background_task_fails.records
    assert record.name == "etcd_leases.etcd.keepalive"
    assert record.getMessage() == "the keep-alive reader failed"
    assert record.exc_info and str(record.exc_info[1]) == "a bug in the handler"
    no_background_task_fails.records.clear()  # failed on purpose
    await stream.wait_ended()


async def test_a_stream_on_a_member_without_a_leader_ends_at_once(etcd_binary: str) -> None:
    # Streams ask a member to refuse them when it has no leader ("hasleader"), rather
    # than hold their renewals until an election that may never come.
    with EtcdCluster(3, binary=etcd_binary) as cluster:
        alone, *others = cluster.members
        client = EtcdClient([alone.endpoint], timeout=5, member_sync_interval=None)
        events = Events()
        for member in others:
            await asyncio.to_thread(member.pause)
        try:
            stream = await _open(client, events)
            await eventually(lambda: stream.ended, "the stream refused")
            assert stream.failed and stream.failure is not None
            assert is_no_leader(stream.failure), stream.failure
            await stream.wait_ended()
        finally:
            for member in others:
                await asyncio.to_thread(member.resume)
            await client.close()


async def test_a_login_etcd_refuses_is_the_reason_the_stream_did_not_open(
    etcd_binary: str,
) -> None:
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        enable_auth(etcd)
        client = EtcdClient(etcd.endpoints, timeout=5, username="app", password="wrong")
        try:
            opened = await _open_or_why(client, Events())
            assert isinstance(opened, str) and "authentication failed" in opened, opened
            assert opened.startswith("etcd: INVALID_ARGUMENT"), opened
        finally:
            await client.close()


async def test_a_member_that_never_answers_the_login_is_given_up(etcd_binary: str) -> None:
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        enable_auth(etcd)
        client = EtcdClient(etcd.endpoints, timeout=5, username="app", password="apppw")
        await client.auth.metadata(0)  # connected and logged in; then the token is refused
        client.auth.invalidate(0)
        await asyncio.to_thread(etcd.members[0].pause)
        try:
            opened = await _open_or_why(client, Events(), login_timeout=0.5)
            assert opened == "no login answer in 0.50 s"
        finally:
            await asyncio.to_thread(etcd.members[0].resume)
            await client.close()


async def test_a_login_cut_short_by_the_client_closing_is_a_reason_not_an_error(
    etcd_binary: str,
) -> None:
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        enable_auth(etcd)
        client = EtcdClient(etcd.endpoints, timeout=5, username="app", password="apppw")
        await client.auth.metadata(0)
        client.auth.invalidate(0)
        await asyncio.to_thread(etcd.members[0].pause)
        try:
            events = Events()
            opening = asyncio.create_task(
                RenewalStream.open(
                    client,
                    0,
                    events.on_answer,
                    events.on_sent,
                    events.on_waiting,
                    events.on_end,
                    login_timeout=30,
                )
            )
            await asyncio.sleep(0)  # its first step: up to the login call, then waits
            assert not opening.done()
            await client.close()
            assert await opening == "the login call was cancelled"
        finally:
            await asyncio.to_thread(etcd.members[0].resume)


async def test_cancelling_is_true_only_in_a_task_being_cancelled() -> None:
    assert not cancelling()
    seen: list[bool] = []

    async def cancelled() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append(cancelling())
            raise

    task = asyncio.create_task(cancelled())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [True]
