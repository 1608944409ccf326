"""RenewalRound against a real etcd: a stream on every member, the first to answer serves.

What the keep-alive loop relies on: the first member to answer keeps its stream and
becomes the client's preferred member, the others' streams end without blame; a stream
silent past the stall limit ends with blame; a round widened while unanswered gives its
new streams the one-shot renewals still waiting; closing hands those back, each once.
"""

from __future__ import annotations

import asyncio
import time

from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.lease_ids import new_lease_id
from etcd_leases.etcd.renewal_round import RenewalRound
from etcd_leases.etcd.renewal_stream import Inflight, Renewal, RenewalStream
from etcd_leases.etcd.rpc_errors import is_no_leader
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.testing import EtcdCluster, EtcdMember
from tests.conftest import enable_auth, eventually

ANOTHER_ANSWERED = "another member answered first"


class Events:
    """What a round called back."""

    def __init__(self) -> None:
        self.answers: list[tuple[pb.LeaseKeepAliveResponse, Inflight | None]] = []
        self.sent: list[tuple[int, float]] = []
        self.ended: list[RenewalStream] = []

    def on_answer(self, response: pb.LeaseKeepAliveResponse, inflight: Inflight | None) -> None:
        self.answers.append((response, inflight))

    def on_sent(self, lease_id: int, sent_at: float) -> None:
        self.sent.append((lease_id, sent_at))

    def on_end(self, stream: RenewalStream) -> None:
        self.ended.append(stream)

    def round(self, client: EtcdClient) -> RenewalRound:
        return RenewalRound(client, self.on_answer, self.on_sent, lambda stream: None, self.on_end)


async def _end_all(round_: RenewalRound, client: EtcdClient, *frozen: EtcdMember) -> None:
    """Close the round and the client; resume the members the test froze."""
    await round_.close("the test is over")
    for member in frozen:
        await asyncio.to_thread(member.resume)
    await client.close()


def _request(lease_id: int) -> pb.LeaseKeepAliveRequest:
    return pb.LeaseKeepAliveRequest(ID=lease_id)


async def _granted(client: EtcdClient) -> int:
    lease_id = new_lease_id()
    await client.grant(10, lease_id)
    return lease_id


async def test_the_first_member_to_answer_serves_the_round_and_is_preferred(
    etcd_cluster: EtcdCluster,
) -> None:
    # A follower, preferred until now, is frozen: another member answers first.
    leader = etcd_cluster.leader()
    frozen = next(m for m in etcd_cluster.members if m is not leader)
    frozen_index = etcd_cluster.members.index(frozen)
    client = EtcdClient(etcd_cluster.endpoints, timeout=5)
    events = Events()
    round_ = events.round(client)
    try:
        lease_id = await _granted(client)
        client.members.answered(frozen_index)
        await asyncio.to_thread(frozen.pause)
        assert await round_.open(login_timeout=5.0) is None
        assert len(round_.streams) == 3 and not round_.over and not round_.answered
        assert round_.send(lease_id, _request(lease_id), None) == 3
        await eventually(lambda: round_.answered, "an answer")
        (serving,) = round_.streams
        assert serving.endpoint != frozen_index
        assert client.members.preferred() == serving.endpoint
        assert [response.ID for response, _ in events.answers] == [lease_id]
        assert len(events.ended) == 2 and serving not in events.ended
        assert all(s.failure == ANOTHER_ANSWERED and not s.failed for s in events.ended)
        assert round_.failure is None
        # Only a round's first answer moves the calls: later ones leave a failover of
        # the calls alone (else they flap back with every renewal).
        elsewhere = client.members.failed(serving.endpoint)
        assert round_.send(lease_id, _request(lease_id), None) == 1
        await eventually(lambda: len(events.answers) == 2, "the second answer")
        assert client.members.preferred() == elsewhere != serving.endpoint
        # Streams opened for a round that has its member end at once.
        assert await round_.open(login_timeout=5.0) is None
        assert round_.streams == [serving] and len(events.ended) == 5
        assert all(s.failure == ANOTHER_ANSWERED for s in events.ended)
    finally:
        await _end_all(round_, client, frozen)


async def test_closing_a_round_hands_back_its_unanswered_one_shots_once(
    etcd_cluster: EtcdCluster,
) -> None:
    client = EtcdClient(etcd_cluster.endpoints, timeout=5)
    events = Events()
    round_ = events.round(client)
    try:
        lease_id = await _granted(client)
        assert await round_.open(login_timeout=5.0) is None
        preferred = client.members.preferred()
        waiting: asyncio.Future[Renewal] = asyncio.get_running_loop().create_future()
        # Sent to all three streams; closed before their writers run.
        assert round_.send(lease_id, _request(lease_id), waiting) == 3
        assert await round_.close("closed") == [(lease_id, waiting)]
        assert round_.over and len(events.ended) == 3
        assert all(s.failure == "closed" and not s.failed for s in events.ended)
        # Nobody failed: no member is blamed.
        assert round_.failure is None and client.members.preferred() == preferred
        assert events.answers == []
    finally:
        await client.close()


async def test_a_stream_silent_past_the_stall_limit_ends_with_blame(
    etcd_cluster: EtcdCluster,
) -> None:
    # The last member's stream waits on a renewal; the streams before it wait on nothing.
    frozen = etcd_cluster.members[2]
    client = EtcdClient(etcd_cluster.endpoints, timeout=5)
    events = Events()
    round_ = events.round(client)
    try:
        lease_id = await _granted(client)
        assert await round_.open(login_timeout=5.0) is None
        idle_a, idle_b, stalled = round_.streams
        assert round_.end_stalled(time.monotonic() + 100, 1.0) == float("inf")  # nothing sent
        await asyncio.to_thread(frozen.pause)
        stalled.send(lease_id, _request(lease_id), None)
        await eventually(lambda: stalled.outstanding == 1, "the renewal written")
        since = stalled.progress_at
        # The instants are given: no waiting, no timing decides it.
        assert round_.end_stalled(since + 0.99, 1.0) == since + 1.0
        assert not stalled.ended and round_.failure is None
        assert round_.end_stalled(since + 1.0, 1.0) == float("inf")
        assert stalled.ended and stalled.failed and round_.streams == [idle_a, idle_b]
        assert stalled.failure == "a stream went 1.00 s without an answer"
        assert round_.failure == stalled.failure and events.ended == [stalled]
    finally:
        await _end_all(round_, client, frozen)


async def test_a_widened_round_sends_the_waiting_one_shots_on_its_new_streams(
    etcd_binary: str,
) -> None:
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        client = EtcdClient(etcd.endpoints, timeout=5)
        events = Events()
        round_ = events.round(client)
        try:
            lease_id = await _granted(client)
            assert await round_.open(login_timeout=5.0) is None
            await asyncio.to_thread(etcd.members[0].pause)
            waiting: asyncio.Future[Renewal] = asyncio.get_running_loop().create_future()
            round_.send(lease_id, _request(lease_id), waiting)
            (first,) = round_.streams
            await eventually(lambda: first.outstanding == 1, "the one-shot written")
            assert await round_.open(login_timeout=5.0) is None  # widened
            assert len(round_.streams) == 2
            (new,) = (s for s in round_.streams if s is not first)
            assert new.unanswered() == [(lease_id, waiting)]
            assert round_.unanswered() == [(lease_id, waiting)]  # once, though on both
            await asyncio.to_thread(etcd.members[0].resume)
            await eventually(lambda: round_.answered, "an answer")
            assert len(round_.streams) == 1
            assert all(inflight and inflight[1] is waiting for _, inflight in events.answers)
        finally:
            await _end_all(round_, client, etcd.members[0])


async def test_writes_are_reported_once_a_member_answered_the_round(client: EtcdClient) -> None:
    """The keep-alive loop puts a lease's next renewal off an interval from each write
    reported: a write to a member that may never read it (before the round's first
    answer, say to a frozen one) must not put off the renewal a widened round sends."""
    events = Events()
    round_ = events.round(client)
    try:
        lease_id = await _granted(client)
        assert await round_.open(login_timeout=5.0) is None
        assert round_.send(lease_id, _request(lease_id), None) == 1
        await eventually(lambda: round_.answered, "an answer")
        assert events.sent == []  # written before the round's first answer
        before = time.monotonic()
        assert round_.send(lease_id, _request(lease_id), None) == 1
        await eventually(lambda: len(events.answers) == 2, "the second answer")
        _, inflight = events.answers[1]
        assert inflight is not None and before <= inflight[0]
        assert events.sent == [(lease_id, inflight[0])]
    finally:
        await _end_all(round_, client)


async def test_closing_a_widened_round_ends_its_first_streams_too(client: EtcdClient) -> None:
    events = Events()
    round_ = events.round(client)
    assert await round_.open(login_timeout=5.0) is None
    assert await round_.open(login_timeout=5.0) is None  # nothing answered: widened
    first, new = round_.streams
    assert await round_.close("closed") == []
    assert first.ended and new.ended and events.ended == [first, new]


async def test_a_round_no_member_could_open_says_why_for_each(etcd_cluster: EtcdCluster) -> None:
    enable_auth(etcd_cluster)
    client = EtcdClient(etcd_cluster.endpoints, timeout=5, username="app", password="apppw")
    for index in range(3):  # connected and logged in; then the tokens are refused
        await client.auth.metadata(index)
        client.auth.invalidate(index)
    for member in etcd_cluster.members:
        await asyncio.to_thread(member.pause)
    events = Events()
    round_ = events.round(client)
    try:
        why = await round_.open(login_timeout=0.5)
        assert why == "; ".join(["no login answer in 0.50 s"] * 3)
        assert round_.over and not round_.answered
    finally:
        for member in etcd_cluster.members:
            await asyncio.to_thread(member.resume)
        await client.close()


async def test_a_member_without_a_leader_is_passed_over_only_briefly(etcd_binary: str) -> None:
    """A stream refused for want of a leader cools its member down for calls for half a
    second, not the five of a failed member: the member serves again as soon as an
    election gives it a leader."""
    with EtcdCluster(3, binary=etcd_binary) as cluster:
        alone, *others = cluster.members
        client = EtcdClient([alone.endpoint], timeout=5, member_sync_interval=None)
        for member in others:
            await asyncio.to_thread(member.pause)
        events = Events()
        round_ = events.round(client)
        try:
            await round_.open(login_timeout=5.0)
            await eventually(lambda: len(events.ended) == 1, "the stream refused")
            refused_at = time.monotonic()
            (stream,) = events.ended
            assert stream.failure is not None and is_no_leader(stream.failure)
            cool_until = client.members._cool_until[0]
            assert 0.0 < cool_until <= refused_at + 0.5  # set, and for 0.5 s
        finally:
            await _end_all(round_, client, *others)


async def test_a_member_whose_login_hangs_holds_back_only_its_own_stream(
    etcd_cluster: EtcdCluster,
) -> None:
    # etcd's simple tokens are each member's own: each stream logs in on its member.
    enable_auth(etcd_cluster)
    client = EtcdClient(etcd_cluster.endpoints, timeout=5, username="app", password="apppw")
    for index in range(3):
        await client.auth.metadata(index)
    client.auth.invalidate(2)
    frozen = etcd_cluster.members[2]
    await asyncio.to_thread(frozen.pause)
    events = Events()
    round_ = events.round(client)
    try:
        assert client.members.preferred() != 2
        assert await round_.open(login_timeout=0.5) is None
        assert [stream.endpoint for stream in round_.streams] == [0, 1]
    finally:
        await _end_all(round_, client, frozen)
