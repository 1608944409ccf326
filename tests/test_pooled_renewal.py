"""A key taken on a lease that aged in the pool: the renewal asked alongside its put.

A free lease is renewed by the pool's sweep only once it has aged a third of its TTL,
so the lease a take finds may have less than its TTL left on etcd. The take renews it
alongside the put (one keep-alive, not a write), and promises its TTL only if etcd
answered that renewal: etcd's lease never ends before the tenure promised. A move
(a transfer) renews it before the put: the tenure it replaces ends as it lands.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from etcd_leases import AcquireResult, BackendError, BackendUnavailable, EtcdLeaseProvider
from etcd_leases.etcd.renewal_stream import RenewalStream
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.testing import EtcdCluster
from tests.conftest import (
    KeepAliveCall,
    assert_books_name_no_gone_lease,
    assert_no_lease_leaked,
    etcd_error,
    settled,
    unique_prefix,
)
from tests.test_lost_answers import unknown_create
from tests.test_tenure_races import AnsweredGone

TTL_MS = 60_000  # the sweep renews a free lease of 60 s only after it aged 20 s


class KeepAliveRequests:
    """The leases a provider's keep-alive requests renew, in order; those renewing
    ``held`` wait until ``let_through`` is set (as over a slow link)."""

    def __init__(self, provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[int] = []
        self.held: int | None = None
        self.holding = asyncio.Event()  # a request renewing ``held`` waits
        self.let_through = asyncio.Event()
        open_call = provider.client.keep_alive_stream
        monkeypatch.setattr(
            provider.client, "keep_alive_stream", lambda *args: NotedCall(open_call(*args), self)
        )


class NotedCall(KeepAliveCall):
    """A keep-alive call whose requests ``requests`` notes (and may hold back)."""

    def __init__(
        self,
        call: grpc.aio.StreamStreamCall[pb.LeaseKeepAliveRequest, pb.LeaseKeepAliveResponse],
        requests: KeepAliveRequests,
    ) -> None:
        super().__init__(call)
        self._requests = requests

    async def write(self, request: pb.LeaseKeepAliveRequest) -> None:
        self._requests.sent.append(request.ID)
        if self._requests.held == request.ID:
            self._requests.holding.set()
            await self._requests.let_through.wait()
        await self._call.write(request)


async def aged_free_lease(provider: EtcdLeaseProvider) -> int:
    """A lease of ``TTL_MS`` back in ``provider``'s pool, free (its key moved away)."""
    await provider.acquire_lease("first", "alice", TTL_MS)
    kv = await provider.client.range(provider.etcd_key("first"))
    assert kv is not None
    assert await provider.transfer_lease("first", "alice", "bob", TTL_MS)
    assert provider._pool.free_lease_ids() == {kv.lease}
    return kv.lease


async def a_take_whose_renewal_is_held(
    provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> tuple[asyncio.Task[AcquireResult], int, KeepAliveRequests]:
    """An acquire of "second" under a lease aged in the pool, its put answered and the
    renewal sent beside it held back on the wire: the take, the lease, the requests."""
    requests = KeepAliveRequests(provider, monkeypatch)
    lease = await aged_free_lease(provider)
    requests.held = lease
    put_answered = asyncio.Event()
    original = provider.client.txn

    async def txn(request: pb.TxnRequest) -> pb.TxnResponse:
        response = await original(request)
        put_answered.set()
        return response

    monkeypatch.setattr(provider.client, "txn", txn)
    take = asyncio.create_task(provider.acquire_lease("second", "alice", TTL_MS))
    async with asyncio.timeout(10):
        await put_answered.wait()
        await requests.holding.wait()
    return take, lease, requests


async def test_a_lease_aged_in_the_pool_is_renewed_once_alongside_the_put(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taken 3 s after it went back to the pool (no sweep renewed it in between), the
    lease has a whole TTL left on etcd once the take returns, renewed by one keep-alive."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        requests = KeepAliveRequests(provider, monkeypatch)
        requests.let_through.set()
        lease = await aged_free_lease(provider)
        sent_before = requests.sent.count(lease)
        await asyncio.sleep(3)  # etcd's TTL of the free lease now at most 57 s
        result = await provider.acquire_lease("second", "alice", TTL_MS)
        assert result.acquired and result.ttl_ms == TTL_MS
        kv = await provider.client.range(provider.etcd_key("second"))
        assert kv is not None and kv.lease == lease  # the aged one, not a new grant
        # Whole seconds, rounded down: 59 when read at once, 58 with a second's delay.
        assert (await provider.client.time_to_live(lease)).TTL >= 58
        assert requests.sent.count(lease) == sent_before + 1
        await settled(provider)


async def test_a_put_whose_lease_is_answered_gone_is_not_reported_acquired(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put on an aged pooled lease landed, then the lease ended (revoked here, as
    etcd's expiry after a stall would) before its renewal reached etcd: the tenure the
    put began has ended, so the take fails as unknown, never "acquired"."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        take, lease, requests = await a_take_whose_renewal_is_held(provider, monkeypatch)
        key = provider.etcd_key("second")
        kv = await provider.client.range(key)
        assert kv is not None and kv.lease == lease  # the put under the aged lease landed
        assert not take.done()  # it waits for the renewal held back
        assert await provider.client.revoke(lease)
        requests.let_through.set()
        with pytest.raises(BackendUnavailable) as raised:
            await take
        assert str(raised.value) == (
            "etcd: the lease under the put ran out before its renewal was answered "
            "(etcd stalled): the tenure it began has ended; outcome unknown"
        )
        assert await provider.client.range(key) is None
        assert lease not in provider._pool.free_lease_ids()
        await assert_books_name_no_gone_lease(provider)
        assert (await provider.acquire_lease("second", "bob", TTL_MS)).acquired
        await settled(provider)


async def test_a_put_whose_lease_etcd_answers_gone_while_it_stays_leaves_no_key(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but only the renewal's answer says the lease is gone (a leader elected
    a moment ago that has not applied the lease yet answers so, etcd issue 13675): the
    lease stays, and so would the key the put landed on. The take fails as unknown
    and deletes the key, so the tenure the error says has ended has ended; no holder
    renews it, and a later acquire takes the key at once, not a TTL later."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        gone: set[int] = set()
        open_call = provider.client.keep_alive_stream
        monkeypatch.setattr(
            provider.client, "keep_alive_stream", lambda *args: AnsweredGone(open_call(*args), gone)
        )
        lease = await aged_free_lease(provider)
        gone.add(lease)
        with pytest.raises(BackendUnavailable, match="the tenure it began has ended"):
            await provider.acquire_lease("second", "alice", TTL_MS)
        assert (await provider.client.time_to_live(lease)).TTL > 0  # only the answer said gone
        assert await provider.client.range(provider.etcd_key("second")) is None
        assert (await provider.acquire_lease("second", "bob", TTL_MS)).acquired
        await settled(provider)
        await provider.client.revoke(lease)  # left to run out by the provider: 60 s


async def test_a_lease_renewed_past_its_first_ttl_goes_back_to_the_pool(
    etcd: EtcdCluster,
) -> None:
    """Renewed by its owner for longer than its TTL, then moved away from its key: the
    lease is known alive from its last renewal, not its grant, so the pool takes it
    back for the next take (a lease known to be gone would be dropped)."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        await provider.acquire_lease("k", "alice", 2000)
        kv = await provider.client.range(provider.etcd_key("k"))
        assert kv is not None
        for _ in range(6):  # 3 s of renewals every 0.5 s: the grant's 2 s are long past
            await asyncio.sleep(0.5)
            assert await provider.renew_lease("k", "alice", 2000)
        assert await provider.transfer_lease("k", "alice", "bob", 2000)
        assert provider._pool.free_lease_ids() == {kv.lease}
        await settled(provider)


async def test_a_take_whose_renewal_goes_unanswered_fails_in_the_client_timeout(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The renewal asked alongside the put never reaches etcd: the take fails in the
    client's timeout, in words saying so; it does not wait for an answer that never
    comes. The tenure the put began (others may have seen it) is left to run its
    course: the lease is neither revoked nor reused nor renewed again."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix(), timeout=2.0) as provider:
        requests = KeepAliveRequests(provider, monkeypatch)
        lease = await aged_free_lease(provider)
        requests.held = lease
        try:
            async with asyncio.timeout(20):  # bounds a take that waits for the answer
                with pytest.raises(BackendUnavailable, match=r"was not answered in 2\.0 s"):
                    await provider.acquire_lease("second", "alice", TTL_MS)
        finally:
            requests.let_through.set()
        await settled(provider)
        assert await provider.get_lease_owner("second") == "alice"
        assert lease not in provider._pool.free_lease_ids()
        assert not provider._keepalive.is_kept(lease)
        await assert_books_name_no_gone_lease(provider)


async def test_a_put_refused_beside_a_renewal_left_unanswered_fails_with_the_refusal(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd refuses the put on an aged lease while the renewal asked beside it waits on
    the wire: the take fails with etcd's refusal, not the renewal's fate; the lease,
    under which nothing landed, goes back to the pool; the renewal is waited for in the
    background until the client's timeout passes, and its going unanswered fails
    nothing there."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix(), timeout=2.0) as provider:
        requests = KeepAliveRequests(provider, monkeypatch)
        lease = await aged_free_lease(provider)
        requests.held = lease
        original = provider.client._attempt

        async def attempt(
            index: int, path: str, request: Message, response_type: type[Message], deadline: float
        ) -> Message:
            if path.endswith("/Txn"):
                raise etcd_error(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: too many requests"
                )
            return await original(index, path, request, response_type, deadline)

        monkeypatch.setattr(provider.client, "_attempt", attempt)
        try:
            async with asyncio.timeout(10):  # bounds a take that tries lease after lease
                with pytest.raises(BackendError, match="too many requests"):
                    await provider.acquire_lease("second", "alice", TTL_MS)
            async with asyncio.timeout(10):
                await requests.holding.wait()  # the renewal was asked, and waits unanswered
            assert lease in provider._pool.free_lease_ids()
            await settled(provider)  # the renewal's wait, ended by the client's timeout
        finally:
            requests.let_through.set()


async def test_a_transfer_onto_a_lease_aged_in_the_pool_never_ends_the_tenure_it_moves(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transfer moves the key onto a lease that aged in the pool, which turns out
    gone (revoked here, as etcd says of a lease after a stall or a leader change) when
    its renewal arrives. A move ends the tenure it replaces, so it is sent only once
    the new lease is known alive for the whole TTL: the transfer takes another lease
    and lands. Sent alongside the renewal, it landed on the dying lease, the key went
    with it, and the holder's tenure ended long before its TTL (CI, stop 33: a
    re-acquire with another TTL, a move too, freed a key another owner then took)."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        before = set(await provider.client.leases())
        await provider.acquire_lease("k", "carol", TTL_MS)
        requests = KeepAliveRequests(provider, monkeypatch)
        requests.let_through.set()
        lease = await aged_free_lease(provider)
        requests.held, requests.let_through = lease, asyncio.Event()
        moves: list[asyncio.Task[pb.TxnResponse]] = []
        sent_under: list[int] = []
        original = provider.client.txn

        async def txn(request: pb.TxnRequest) -> pb.TxnResponse:
            sent_under.extend(op.request_put.lease for op in request.success)
            moves.append(asyncio.create_task(original(request)))
            return await moves[-1]

        monkeypatch.setattr(provider.client, "txn", txn)
        transfer = asyncio.create_task(provider.transfer_lease("k", "carol", "dave", TTL_MS))
        async with asyncio.timeout(10):
            await requests.holding.wait()
            await asyncio.gather(*moves)  # a move sent beside the renewal has landed
        assert await provider.client.revoke(lease)
        requests.let_through.set()
        async with asyncio.timeout(10):
            assert await transfer
        kv = await provider.client.range(provider.etcd_key("k"))
        assert kv is not None and kv.value == b"dave" and kv.lease != lease
        assert lease not in sent_under  # nothing was sent under the lease etcd called gone
        await provider.release_lease("k", "dave")
        await provider.release_lease("first", "bob")
        await settled(provider)
        await assert_no_lease_leaked(provider, before)  # nor is it left in the pool's books


async def test_a_transfer_onto_a_lease_aged_in_the_pool_renews_it_once_before_the_move(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The move lands on the aged lease, renewed by one keep-alive sent before the
    move and none beside it; the pool knows the lease alive for the TTL from that
    renewal (it would otherwise drop the lease, freed later, as expired)."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        await provider.acquire_lease("k", "carol", TTL_MS)
        requests = KeepAliveRequests(provider, monkeypatch)
        requests.let_through.set()
        lease = await aged_free_lease(provider)
        renewals_before = requests.sent.count(lease)
        renewals_at_each_put: list[int] = []
        original = provider.client.txn

        async def txn(request: pb.TxnRequest) -> pb.TxnResponse:
            if any(op.HasField("request_put") for op in request.success):
                renewals_at_each_put.append(requests.sent.count(lease))
            return await original(request)

        monkeypatch.setattr(provider.client, "txn", txn)
        started = time.monotonic()
        assert await provider.transfer_lease("k", "carol", "dave", TTL_MS)
        kv = await provider.client.range(provider.etcd_key("k"))
        assert kv is not None and kv.value == b"dave" and kv.lease == lease
        assert renewals_at_each_put == [renewals_before + 1]
        await settled(provider)
        assert requests.sent.count(lease) == renewals_before + 1
        assert provider._pool._out[lease].valid_until >= started + TTL_MS / 1000


async def test_a_transfer_whose_renewal_goes_unanswered_fails_in_the_client_timeout(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The renewal a move asks before it is sent never reaches etcd: the transfer
    fails in the client's timeout, in words saying so, having sent nothing; the key
    stays with its holder, and the lease, which carries nothing, goes back to the pool."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix(), timeout=2.0) as provider:
        await provider.acquire_lease("k", "carol", TTL_MS)
        held = await provider.client.range(provider.etcd_key("k"))
        requests = KeepAliveRequests(provider, monkeypatch)
        requests.let_through.set()
        lease = await aged_free_lease(provider)
        requests.held, requests.let_through = lease, asyncio.Event()
        try:
            async with asyncio.timeout(20):  # bounds a transfer that waits for the answer
                with pytest.raises(BackendUnavailable, match=r"was not answered in 2\.0 s"):
                    await provider.transfer_lease("k", "carol", "dave", TTL_MS)
        finally:
            requests.let_through.set()
        assert await provider.client.range(provider.etcd_key("k")) == held
        await settled(provider)
        assert lease in provider._pool.free_lease_ids()


async def test_a_take_whose_tenure_a_release_ended_before_it_settled_answers_acquired(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put on an aged lease landed; while its renewal is on its way, another task
    of the process releases that tenure (same owner). Both calls happened: the acquire
    answers acquired (its tenure since ended by the release), and the lease, which no
    copy can land on again, goes back to the pool, not revoked as if its lease had run
    out under the put."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        take, lease, requests = await a_take_whose_renewal_is_held(provider, monkeypatch)
        kv = await provider.client.range(provider.etcd_key("second"))
        assert kv is not None and kv.lease == lease
        await provider.release_lease("second", "alice")
        requests.let_through.set()
        result = await take
        assert result.acquired and result.token == kv.mod_revision and result.ttl_ms == TTL_MS
        assert await provider.client.range(provider.etcd_key("second")) is None
        await settled(provider)
        assert lease in provider._pool.free_lease_ids()
        assert (await provider.client.time_to_live(lease)).TTL > 0
        # Taken again, the lease carries the next tenure as any lease does.
        assert (await provider.acquire_lease("third", "alice", TTL_MS)).acquired
        kv = await provider.client.range(provider.etcd_key("third"))
        assert kv is not None and kv.lease == lease
        assert lease not in provider._pool.free_lease_ids()


async def test_the_renewal_beside_a_create_left_unknown_still_goes_out(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create whose outcome is unknown may have begun a tenure that must last its
    TTL: the renewal asked beside it is sent even when the call has given up before
    the renewal streams opened (it was dropped before, and the lease, aged in the pool,
    would have ended that tenure early)."""
    requests = KeepAliveRequests(etcd_provider, monkeypatch)
    streams_may_open = asyncio.Event()
    open_stream = RenewalStream.open

    async def open_later(*args: Any, **kwargs: Any) -> RenewalStream | str:
        await streams_may_open.wait()
        return await open_stream(*args, **kwargs)

    monkeypatch.setattr(RenewalStream, "open", open_later)
    pooled = await unknown_create(etcd_provider, monkeypatch)
    streams_may_open.set()
    await settled(etcd_provider)
    assert requests.sent == [pooled]
