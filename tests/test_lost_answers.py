"""Writes that etcd applies but whose answer never comes back (issue 6, section 3).

``lose_answers`` lets the next transactions reach etcd and be applied for real, then
throws their answers away as a deadline that passed would: the caller cannot tell
whether they landed. Every call must still report the truth, with no double owner,
no false loss and no leaked lease.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import grpc
import grpc.aio
import pytest
from google.protobuf.message import Message

from etcd_leases import BackendUnavailable, EtcdLeaseProvider
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.txn import delete, put
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.send_ids import SendId
from etcd_leases.testing import EtcdCluster, free_ports
from tests.conftest import (
    BROKEN_STREAM_ERRORS,
    assert_books_name_no_gone_lease,
    assert_freed,
    assert_no_lease_leaked,
    etcd_error,
    past_one_shot,
    settled,
)


class LoseAnswers:
    """``lose_answers(n)``: the next ``n`` transactions apply, but their answers are
    lost; ``lost`` counts the answers thrown away, so a test can tell its losses
    happened (a call that sent fewer transactions would pass without them).
    ``lose_answers(n, meanwhile)`` awaits ``meanwhile(request)`` between a
    transaction's landing and the loss of its answer: what others did in between."""

    def __init__(self) -> None:
        self.to_lose = 0
        self.lost = 0
        self.meanwhile: Callable[[pb.TxnRequest], Awaitable[None]] | None = None
        self.error = lost_answer

    def __call__(
        self,
        count: int,
        meanwhile: Callable[[pb.TxnRequest], Awaitable[None]] | None = None,
        error: Callable[[], grpc.aio.AioRpcError] | None = None,
    ) -> None:
        """``error``: what gRPC raises in place of each answer (a passed deadline)."""
        self.to_lose = count
        self.meanwhile = meanwhile
        self.error = error or lost_answer


def lost_answer() -> grpc.aio.AioRpcError:
    """What gRPC raises when a call's deadline passes before etcd's answer came."""
    return etcd_error(grpc.StatusCode.DEADLINE_EXCEEDED, "the answer was lost (test)")


@pytest.fixture
def lose_answers(etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch) -> LoseAnswers:
    """See :class:`LoseAnswers`."""
    client: EtcdClient = etcd_provider.client
    original = client._attempt
    losses = LoseAnswers()

    async def attempt(
        index: int, path: str, request: Message, response_type: type[Message], deadline_s: float
    ) -> Message:
        response = await original(index, path, request, response_type, deadline_s)
        if path.endswith("/Txn") and losses.to_lose > 0:
            losses.to_lose -= 1
            losses.lost += 1
            if losses.meanwhile is not None:
                assert isinstance(request, pb.TxnRequest)
                await losses.meanwhile(request)
            raise losses.error()
        return response

    monkeypatch.setattr(client, "_attempt", attempt)
    return losses


async def lease_of(provider: EtcdLeaseProvider, key: str) -> int:
    kv = await provider.client.range(provider.etcd_key(key))
    assert kv is not None
    return kv.lease


async def test_acquire(etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers) -> None:
    p = etcd_provider
    before = set(await p.client.leases())
    lose_answers(2)
    result = await p.acquire_lease("k", "alice", 5000)
    assert lose_answers.lost == 2
    kv = await p.client.range(p.etcd_key("k"))
    assert result.acquired and kv is not None and result.token == kv.mod_revision
    assert kv.version == 1  # created once
    await assert_no_lease_leaked(p, before | {kv.lease})
    assert (await p.acquire_lease("k", "bob", 5000)).owner == "alice"


async def test_release(etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers) -> None:
    p = etcd_provider
    await past_one_shot(p)  # a release that revokes its lease sends no Txn
    await p.acquire_lease("k", "alice", 5000)
    lease = await lease_of(p, "k")
    lose_answers(1)
    await p.release_lease("k", "alice")
    assert lose_answers.lost == 1
    assert await p.get_lease_owner("k") is None
    await assert_freed(p, lease, or_expiring=True)


async def test_renew_with_another_ttl(
    etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers
) -> None:
    p = etcd_provider
    await p.acquire_lease("k", "alice", 5000)
    old = await lease_of(p, "k")
    lose_answers(1)
    assert await p.renew_lease("k", "alice", 8000)  # moves the tenure to a new lease
    assert lose_answers.lost == 1
    new = await lease_of(p, "k")
    assert new != old and (await p.client.time_to_live(new)).grantedTTL == 8
    await assert_freed(p, old)


async def test_transfer(etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers) -> None:
    p = etcd_provider
    await p.acquire_lease("k", "alice", 5000)
    old = await lease_of(p, "k")
    lose_answers(2)
    assert await p.transfer_lease("k", "alice", "bob", 5000)
    assert lose_answers.lost == 2
    assert await p.get_lease_owner("k") == "bob"
    await assert_freed(p, old)
    assert not await p.transfer_lease("k", "alice", "carol", 5000)


async def test_fenced_put(etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers) -> None:
    """It raised BackendUnavailable though it had applied; now it says True, applied once."""
    p = etcd_provider
    result = await p.acquire_lease("k", "alice", 5000)
    assert result.token is not None
    data = p.prefix + "data"
    lose_answers(2)
    assert await p.put_fenced("k", "alice", result.token, data, b"v1")
    assert lose_answers.lost == 2
    kv = await p.client.range(data.encode())
    assert kv is not None and kv.value == b"v1" and kv.version == 1  # landed once


async def test_fenced_delete(etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers) -> None:
    p = etcd_provider
    result = await p.acquire_lease("k", "alice", 5000)
    assert result.token is not None
    data = p.prefix + "data"
    assert await p.put_fenced("k", "alice", result.token, data, b"v1")
    lose_answers(1)
    assert await p.delete_fenced("k", "alice", result.token, data)
    assert lose_answers.lost == 1
    assert await p.get_value(data) is None


async def test_fenced_put_of_a_tenure_that_ended(
    etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers
) -> None:
    """Refused by the fence, answer lost: reported not applied, and it did not apply."""
    p = etcd_provider
    result = await p.acquire_lease("k", "alice", 5000)
    assert result.token is not None and await p.transfer_lease("k", "alice", "bob", 5000)
    data = p.prefix + "data"
    lose_answers(1)
    assert not await p.put_fenced("k", "alice", result.token, data, b"stale")
    assert lose_answers.lost == 1
    assert await p.get_value(data) is None


async def test_a_send_acknowledged_before_its_answer_came_is_not_sent_twice(
    etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers
) -> None:
    # The send lands, a run acknowledges (deletes) its message at once, and only then
    # is the answer lost: the copy sent again must not store the message a second time.
    client, inbox = etcd_provider.client, etcd_provider.inbox

    async def acknowledge(request: pb.TxnRequest) -> None:
        key = request.success[1].request_put.key
        await client.call(
            "/etcdserverpb.KV/DeleteRange", pb.DeleteRangeRequest(key=key), pb.DeleteRangeResponse
        )

    lose_answers(1, acknowledge)
    message = await inbox.append("thread", b"hello", 100)
    assert lose_answers.lost == 1 and message.seq == 1
    assert await inbox.pending("thread") == []  # acknowledged once, not stored again


async def test_release_if_empty(
    etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers
) -> None:
    p = etcd_provider
    result = await p.acquire_lease("owner-of-thread", "alice", 5000)
    assert result.token is not None
    lose_answers(1)
    assert await p.inbox.release_if_empty("owner-of-thread", "alice", result.token, "thread")
    assert lose_answers.lost == 1
    assert await p.get_lease_owner("owner-of-thread") is None


@contextmanager
def refusing_the_copy_after_a_lost_answer(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[int]]:
    """The first transaction lands, its answer lost; etcd refuses the second (say, too
    busy); the rest pass. Yields the count of transactions sent (one item)."""
    original = client._attempt
    txns = [0]

    async def attempt(
        index: int, path: str, request: Message, response_type: type[Message], deadline_s: float
    ) -> Message:
        if path.endswith("/Txn"):
            txns[0] += 1
            if txns[0] == 1:
                await original(index, path, request, response_type, deadline_s)
                raise lost_answer()
            if txns[0] == 2:
                raise etcd_error(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: too many requests (test)"
                )
        return await original(index, path, request, response_type, deadline_s)

    with monkeypatch.context() as patch:
        patch.setattr(client, "_attempt", attempt)
        yield txns


async def unknown_create(provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch) -> int:
    """alice's acquire of "k" (TTL 3 s) on a pooled lease: its create lands, the caller
    is told the outcome is unknown. The lease it took."""
    await past_one_shot(provider)
    await provider.acquire_lease("warm", "me", 3000)
    await provider.release_lease("warm", "me")
    (pooled,) = provider._pool.free_lease_ids()
    with (
        refusing_the_copy_after_a_lost_answer(provider.client, monkeypatch) as txns,
        pytest.raises(BackendUnavailable),
    ):
        await provider.acquire_lease("k", "alice", 3000)
    assert txns[0] == 2  # the copy that landed, its answer lost; the copy refused
    return pooled


async def test_a_copy_refused_after_a_lost_answer_leaves_the_outcome_unknown(
    etcd_provider: EtcdLeaseProvider, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reported as unknown; the lease the create may have put the key on is never
    reused, and the tenure it began lasts its TTL, then ends by itself: another process
    may have seen it begin and acted on it. (The lease was revoked at once before: the
    check under faults saw a tenure another process had seen end early, its key taken
    by a later acquire.)"""
    p = etcd_provider
    pooled = await unknown_create(p, monkeypatch)
    await settled(p)
    async with EtcdLeaseProvider(etcd.endpoints, prefix=p.prefix) as other:
        assert await other.get_lease_owner("k") == "alice"
        assert (await other.acquire_lease("k", "bob", 3000)).owner == "alice"
        assert pooled not in p._pool.free_lease_ids() and not p._keepalive.is_kept(pooled)
        deadline = time.monotonic() + 15
        while await other.get_lease_owner("k") is not None:  # its lease runs out
            assert time.monotonic() < deadline, "the tenure no one renews never ended"
            await asyncio.sleep(0.05)
    assert (await p.client.time_to_live(pooled)).TTL == -1
    await assert_books_name_no_gone_lease(p)  # the pool let it go with its tenure


async def test_a_transaction_that_could_not_be_sent_in_the_timeout_gets_no_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Copies are for answers lost. A transaction gRPC could not send to any member
    within the client's timeout (nothing listens at the endpoint) ends the copies:
    each copy waited a whole timeout, so a call took three."""
    (nobody,) = free_ports(1)
    provider = EtcdLeaseProvider([f"127.0.0.1:{nobody}"], timeout=1.0)
    sent: list[pb.TxnRequest] = []
    txn = provider.client.txn

    async def counted(request: pb.TxnRequest) -> pb.TxnResponse:
        sent.append(request)
        return await txn(request)

    monkeypatch.setattr(provider.client, "txn", counted)
    try:
        with pytest.raises(BackendUnavailable, match="failed to connect"):
            await provider.release_lease("k", "me")
        assert len(sent) == 1
    finally:
        await provider.close()


async def test_the_owner_of_an_unknown_create_learns_it_holds_by_asking_again(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller told "unknown" asks again: the tenure its create began is its own,
    with the same token, renewed from then on like any other."""
    p = etcd_provider
    pooled = await unknown_create(p, monkeypatch)
    kv = await p.client.range(p.etcd_key("k"))
    assert kv is not None and kv.lease == pooled
    again = await p.acquire_lease("k", "alice", 3000)
    assert again.acquired and again.token == kv.mod_revision
    assert await p.renew_lease("k", "alice", 3000)
    await p.release_lease("k", "alice")
    assert await p.get_lease_owner("k") is None
    await assert_freed(p, pooled, or_expiring=True)


async def test_an_idempotent_send_whose_answer_was_lost_is_stored_once(
    etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers
) -> None:
    inbox = etcd_provider.inbox
    lose_answers(1)
    message = await inbox.append("thread", b"hello", 100, SendId("req-1"))
    assert not message.duplicate and message.seq == 1
    assert [m.id for m in await inbox.pending("thread")] == [message.id]
    again = await inbox.append("thread", b"hello", 100, SendId("req-1"))
    assert again.duplicate and again.id == message.id


@pytest.mark.parametrize("send_id", [None, SendId("req-1")])
async def test_a_send_id_settles_a_lost_answer_followed_by_another_send(
    etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers, send_id: SendId | None
) -> None:
    """The send lands, its message is handled, another send follows, and only then is
    the answer lost: without a send id the outcome is unknown; with one, it is ours."""
    client, inbox = etcd_provider.client, etcd_provider.inbox

    async def handled_and_followed(request: pb.TxnRequest) -> None:
        handled = request.success[1].request_put.key
        followed = pb.TxnRequest(
            success=[
                delete(handled),
                put(inbox.keys.seq("thread"), b"2 feedface 1"),
                put(inbox.keys.message("thread", 2, "feedface"), b"next"),
            ]
        )
        await client.txn(followed)

    lose_answers(1, handled_and_followed)
    if send_id is None:
        with pytest.raises(BackendUnavailable) as unknown:
            await inbox.append("thread", b"hello", 100)
        assert str(unknown.value) == (
            "etcd: the answer to a send to 'thread' was lost and another send followed: "
            "whether it was stored is unknown (a send id settles it)"
        )
        assert lose_answers.lost == 1
        return
    message = await inbox.append("thread", b"hello", 100, send_id)
    assert lose_answers.lost == 1
    assert not message.duplicate and message.seq == 1
    assert [m.payload for m in await inbox.pending("thread")] == [b"next"]
    assert (await inbox.append("thread", b"hello", 100, send_id)).duplicate


async def test_a_hold_whose_put_landed_unanswered_leaves_no_key(
    etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers
) -> None:
    """Every answer to a hold's put lost: the hold fails, and its settlement finds the key
    it put on the session lease with no hold on it, and deletes it."""
    p = etcd_provider
    async with p.hold("warm", "me", 3000):  # the session exists already
        pass
    lose_answers.to_lose = 1000
    with pytest.raises(BackendUnavailable):
        async with p.hold("k", "me", 3000):
            pytest.fail("a hold whose every answer was lost cannot know it holds")
    assert lose_answers.lost >= 1
    landed = await p.client.range(p.etcd_key("k"))
    lose_answers.to_lose = 0
    await settled(p)
    assert landed is None or landed.value == b"me"
    assert await p.get_lease_owner("k") is None


async def test_a_move_whose_every_answer_was_lost_is_settled_by_another_copy(
    etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers
) -> None:
    """Every copy of a transfer lost its answer (the first landed): the transfer fails as
    unknown, and a copy sent in the background learns it landed. The old tenure's lease
    goes back to the pool; the new one, whose put had an answer lost, is never reused:
    revoked once its key is gone."""
    p = etcd_provider
    await p.acquire_lease("k", "alice", 5000)
    old = await lease_of(p, "k")
    lose_answers(3)  # every copy the transfer sends
    with pytest.raises(BackendUnavailable):
        await p.transfer_lease("k", "alice", "bob", 5000)
    assert lose_answers.lost == 3
    await settled(p)
    new = await lease_of(p, "k")
    assert new != old and await p.get_lease_owner("k") == "bob"
    assert p._pool.free_lease_ids() == {old}
    await p.release_lease("k", "bob")
    await settled(p)
    assert (await p.client.time_to_live(new)).TTL == -1
    assert p._pool.free_lease_ids() == {old}


async def test_a_move_whose_every_copy_was_lost_is_settled_as_not_landed(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every copy of a transfer lost on its way (none reached etcd), and the key written
    by hand before the copy sent in the background: that copy finds the key not on the
    transfer's lease: that lease (its puts' answers lost) is revoked, and the lease of
    the tenure the transfer meant to end is never taken for free (renewed by no one, it
    expires)."""
    p = etcd_provider
    client = p.client
    await p.acquire_lease("k", "alice", 5000)
    leases_before = set(await client.leases())
    original = client._attempt
    to_lose = 3

    async def attempt(
        index: int, path: str, request: Message, response_type: type[Message], deadline_s: float
    ) -> Message:
        nonlocal to_lose
        if path.endswith("/Txn") and to_lose > 0:
            to_lose -= 1
            if to_lose == 0:  # before the background copy: the key written by hand
                put_by_hand = pb.TxnRequest(success=[put(p.etcd_key("k"), b"carol", 0)])
                await original(index, path, put_by_hand, response_type, deadline_s)
            raise lost_answer()
        return await original(index, path, request, response_type, deadline_s)

    monkeypatch.setattr(client, "_attempt", attempt)
    with pytest.raises(BackendUnavailable):
        await p.transfer_lease("k", "alice", "bob", 5000)
    assert to_lose == 0
    await settled(p)
    kv = await p.client.range(p.etcd_key("k"))
    assert kv is not None and kv.value == b"carol" and kv.lease == 0
    assert p._pool.free_lease_ids() == set()
    assert set(await client.leases()) <= leases_before  # the transfer's lease revoked


async def test_a_lease_whose_put_lost_an_answer_is_never_reused(
    etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers
) -> None:
    """The create's first answer was lost and a copy answered: the lease is never taken
    again (a copy of its put might yet land), so its release revokes it."""
    p = etcd_provider
    await past_one_shot(p)  # a process that keeps freed leases for its next takes
    before = set(await p.client.leases())
    lose_answers(1)
    assert (await p.acquire_lease("k", "alice", 5000)).acquired
    assert lose_answers.lost == 1
    lease = await lease_of(p, "k")
    await p.release_lease("k", "alice")
    await settled(p)
    assert lease not in p._pool.free_lease_ids()
    assert (await p.client.time_to_live(lease)).TTL == -1
    await assert_no_lease_leaked(p, before)  # nor is it left in the pool's books


async def test_a_create_copy_that_lands_again_after_a_release_keeps_its_key(
    etcd_provider: EtcdLeaseProvider, lose_answers: LoseAnswers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create's first copy lands, its answer is lost, and another task of the process
    releases that tenure (same owner) before the next copy: the key is free, so the
    copy lands again and the acquire answers with the tenure it began. The release
    must not revoke the put's lease while the put is unsettled: that revoke, landing
    after the copy, deleted the key just acquired, with no call to explain it (the
    revoke is held here until the acquire answered, as a slow member would)."""
    p = etcd_provider
    await past_one_shot(p)
    put_leases: list[int] = []
    acquire_answered = asyncio.Event()
    original_revoke = p.client.revoke

    async def revoke(lease_id: int) -> bool:
        if lease_id in put_leases:
            await acquire_answered.wait()
        return await original_revoke(lease_id)

    async def release_meanwhile(request: pb.TxnRequest) -> None:
        put_leases.append(request.success[0].request_put.lease)
        await p.release_lease("k", "alice")

    monkeypatch.setattr(p.client, "revoke", revoke)
    lose_answers(1, release_meanwhile)
    result = await p.acquire_lease("k", "alice", 5000)
    acquire_answered.set()
    assert lose_answers.lost == 1 and put_leases
    await settled(p)
    kv = await p.client.range(p.etcd_key("k"))
    assert kv is not None and kv.value == b"alice" and kv.lease == put_leases[0]
    assert result.acquired and result.token == kv.mod_revision
    assert kv.version == 1  # created again after the release, once
    await p.release_lease("k", "alice")
    await settled(p)
    assert (await p.client.time_to_live(put_leases[0])).TTL == -1  # revoked with its key


@pytest.mark.parametrize(("code", "text"), BROKEN_STREAM_ERRORS)
async def test_a_create_whose_stream_broke_after_it_landed_is_settled_as_unanswered(
    etcd_provider: EtcdLeaseProvider,
    lose_answers: LoseAnswers,
    code: grpc.StatusCode,
    text: str,
) -> None:
    """etcd applied the create, then the call's stream broke: gRPC's INTERNAL or
    UNKNOWN, which no etcd refusal uses. The put is settled as one whose answer was lost
    (acquired, once); read as a refusal, its lease went back to the pool while it
    carried the key, for the next take to put a second key on."""
    p = etcd_provider
    await past_one_shot(p)
    lose_answers(1, error=lambda: etcd_error(code, text))
    result = await p.acquire_lease("k", "alice", 5000)
    assert lose_answers.lost == 1
    kv = await p.client.range(p.etcd_key("k"))
    assert kv is not None and kv.version == 1
    assert result.acquired and result.token == kv.mod_revision
    await settled(p)
    assert kv.lease not in p._pool.free_lease_ids()


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
async def test_a_move_whose_key_went_after_its_lost_copy_is_settled_from_the_history(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    """The transfer's first copy lost its answer, having landed or not, and the key was
    deleted by hand before the next copy, which finds no key. The key's history tells
    the two apart: a transfer that landed (then lost its key) answers True, one that
    did not (the key went before it) answers False."""
    p = etcd_provider
    client = p.client
    await p.acquire_lease("k", "alice", 5000)
    original = client._attempt
    lost: list[pb.TxnRequest] = []

    async def attempt(
        index: int, path: str, request: Message, response_type: type[Message], deadline_s: float
    ) -> Message:
        is_move = isinstance(request, pb.TxnRequest) and any(
            op.request_put.value == b"bob" for op in request.success
        )
        if not is_move or lost:
            return await original(index, path, request, response_type, deadline_s)
        assert isinstance(request, pb.TxnRequest)
        lost.append(request)
        if landed:
            await original(index, path, request, response_type, deadline_s)
        by_hand = pb.TxnRequest(success=[delete(p.etcd_key("k"))])
        await original(index, path, by_hand, response_type, deadline_s)
        raise lost_answer()

    monkeypatch.setattr(client, "_attempt", attempt)
    assert await p.transfer_lease("k", "alice", "bob", 5000) is landed
    assert lost and await client.range(p.etcd_key("k")) is None
    await settled(p)
    lease = lost[0].success[0].request_put.lease
    await assert_freed(p, lease)


async def test_a_move_whose_key_went_before_it_was_sent_is_settled_as_not_landed(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key is deleted by hand after the transfer read it and before its move is
    sent, and this client has seen that deletion (its revision is past it); the move's
    answer is lost, and the copy sent again finds no key. The history from the
    revision the move compares tells: the key went before any copy could land, so the
    transfer answers False. (Read from the last revision the client had seen, the
    history holds nothing more of the key: the call waited for it in vain, then failed
    as unknown.)"""
    p = etcd_provider
    client = p.client
    await p.acquire_lease("k", "alice", 5000)
    original = client._attempt
    deleted: list[int] = []
    lost: list[pb.TxnRequest] = []

    async def attempt(
        index: int, path: str, request: Message, response_type: type[Message], deadline_s: float
    ) -> Message:
        response = await original(index, path, request, response_type, deadline_s)
        if path.endswith("/Range") and not deleted:  # the transfer's read
            by_hand = pb.TxnRequest(success=[delete(p.etcd_key("k"))])
            gone = await original(index, "/etcdserverpb.KV/Txn", by_hand, pb.TxnResponse, 5.0)
            assert isinstance(gone, pb.TxnResponse)
            deleted.append(gone.header.revision)
        elif isinstance(request, pb.TxnRequest) and not lost:  # the move's first copy
            lost.append(request)
            raise lost_answer()
        return response

    monkeypatch.setattr(client, "_attempt", attempt)
    assert await p.transfer_lease("k", "alice", "bob", 5000) is False
    assert deleted and client.revision_seen >= deleted[0]
    assert lost and lost[0].success[0].request_put.value == b"bob"
    assert await client.range(p.etcd_key("k")) is None
    await settled(p)
    await assert_freed(p, lost[0].success[0].request_put.lease)
