"""Keys held with ``hold`` share one session lease per TTL (issue 9): what that keeps."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import grpc
import grpc.aio
import pytest
from google.protobuf.message import Message

from etcd_leases import (
    AcquireResult,
    BackendUnavailable,
    EtcdLeaseProvider,
    HeldLease,
    LeaseHeld,
    LeaseValueError,
)
from etcd_leases.etcd.keepalive import Renewal
from etcd_leases.etcd.keeper import EtcdKeeper
from etcd_leases.etcd.kept_lease import KeptLease
from etcd_leases.etcd.lease_ids import is_session_lease, new_lease_id
from etcd_leases.etcd.pool import Grant
from etcd_leases.etcd.session import Session
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.testing import EtcdCluster
from tests.conftest import HeldKeepAliveAnswers, etcd_error, settled, unique_prefix


async def leases_of(provider: EtcdLeaseProvider, prefix: str) -> set[int]:
    return {kv.lease for kv in await provider.client.range_prefix(provider.etcd_key(prefix))}


async def test_held_keys_share_one_lease_per_ttl(etcd_provider: EtcdLeaseProvider) -> None:
    async with contextlib.AsyncExitStack() as stack:
        short = [
            await stack.enter_async_context(etcd_provider.hold(f"s{i}", "me", 3000))
            for i in range(20)
        ]
        long = [
            await stack.enter_async_context(etcd_provider.hold(f"l{i}", "me", 9000))
            for i in range(5)
        ]
        (session,) = await leases_of(etcd_provider, "s")
        assert is_session_lease(session) and await leases_of(etcd_provider, "l") != {session}
        assert len({lease.token for lease in short + long}) == 25  # a token per tenure
        assert all(lease.ttl_ms == 3000 for lease in short)
        assert 0 < short[0].remaining() <= 3.0
    # Every hold ended: keys deleted one by one; the session lease stays for the next.
    assert await etcd_provider.client.range_prefix(etcd_provider.etcd_key("")) == []
    assert (await etcd_provider.client.time_to_live(session)).TTL > 0


async def test_ending_one_tenure_leaves_the_others_on_the_session(etcd: EtcdCluster) -> None:
    prefix = unique_prefix()
    async with (
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as provider,
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as elsewhere,
        contextlib.AsyncExitStack() as stack,
    ):
        held = [
            await stack.enter_async_context(provider.hold(f"k{i}", "me", 3000)) for i in range(4)
        ]
        # Another process releases one, transfers another, with the contract's calls:
        # it must not revoke the lease the other keys share.
        await elsewhere.release_lease("k0", "me")
        assert await elsewhere.transfer_lease("k1", "me", "you", 3000)
        await asyncio.wait_for(asyncio.gather(held[0].lost.wait(), held[1].lost.wait()), 2)
        assert "released" in (held[0].lost_reason or "")
        assert "handed to 'you'" in (held[1].lost_reason or "")
        await asyncio.sleep(3.5)  # past the TTL: the others are still renewed
        assert not held[2].lost.is_set() and not held[3].lost.is_set()
        assert await provider.get_lease_owner("k3") == "me"
        await held[2].put("data", "still mine")  # fenced writes still apply
        assert await provider.get_value("data") == b"still mine"


async def test_losing_the_session_lease_loses_every_key_on_it(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        held: list[HeldLease] = [
            await stack.enter_async_context(etcd_provider.hold(f"k{i}", "me", 3000))
            for i in range(10)
        ]
        (session,) = await leases_of(etcd_provider, "k")
        await etcd_provider.client.revoke(session)  # as etcd would on expiry
        await asyncio.wait_for(asyncio.gather(*(lease.lost.wait() for lease in held)), 2)
        assert all(lease.remaining() == 0 for lease in held)
        # The next hold starts a new session.
        async with etcd_provider.hold("after", "me", 3000) as after:
            assert await leases_of(etcd_provider, "after") != {session}
            assert not after.lost.is_set()


async def test_a_cancelled_hold_leaves_no_key_on_the_session(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    async with etcd_provider.hold("warm", "me", 3000):  # the session exists already
        pass
    for i, delay in enumerate((0, 0.0005, 0.001, 0.002, 0.003, 0.005)):
        attempt = asyncio.create_task(etcd_provider.hold(f"c{i}", "me", 3000).__aenter__())
        await asyncio.sleep(delay)
        attempt.cancel()
        results = await asyncio.gather(attempt, return_exceptions=True)
        if isinstance(results[0], HeldLease):  # it finished before the cancel
            await results[0]._finish()
    await settled(etcd_provider)  # background settlement
    # A key left on the session would be held by nobody for as long as the process runs.
    assert await etcd_provider.client.range_prefix(etcd_provider.etcd_key("c")) == []


async def test_a_key_held_elsewhere_by_the_same_owner_moves_onto_the_session(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    # A TTL no test waits out: the hold moves the tenure, never finds the key expired.
    first = await etcd_provider.acquire_lease("job", "me", 60_000)
    async with asyncio.timeout(20), etcd_provider.hold("job", "me", 3000) as lease:
        kv = await etcd_provider.client.range(etcd_provider.etcd_key("job"))
        assert kv is not None and is_session_lease(kv.lease)
        assert first.token is not None and lease.token > first.token  # a new tenure
    assert await etcd_provider.get_lease_owner("job") is None


async def test_the_same_owner_holding_a_key_twice_in_one_process_shares_the_tenure(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """The key is on the session lease with this owner's value already: the same tenure,
    its token and TTL, without another write (and either release ends it)."""
    async with etcd_provider.hold("twice", "me", 3000) as first:
        async with etcd_provider.hold("twice", "me", 3000) as second:
            assert second.owner == "me" and second.token == first.token
            assert 0 < second.remaining() <= 3.0
            result, keeper = await etcd_provider.acquire_kept("twice", "me", 3000)
            assert result.acquired is True and result.owner == "me"
            assert result.token == first.token and result.ttl_ms == 3000
            assert keeper is not None
            keeper.lose("this test is done with it")
            assert await etcd_provider.get_lease_owner("twice") == "me"
        await asyncio.wait_for(first.lost.wait(), 10)
    assert await etcd_provider.get_lease_owner("twice") is None


async def test_a_hold_checks_its_ttl(etcd_provider: EtcdLeaseProvider) -> None:
    for ttl_ms in (0, -1):
        with pytest.raises(LeaseValueError):
            await etcd_provider.acquire_kept("k", "me", ttl_ms)
        with pytest.raises(LeaseValueError):
            async with etcd_provider.hold("k", "me", ttl_ms):
                pytest.fail("held with a bad TTL")
    assert await etcd_provider.get_lease_owner("k") is None


async def test_another_owner_in_the_same_process_does_not_share_the_tenure(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    # Both would put the key on the same session lease: the lease alone does not say
    # whose the key is (a bug the agent-threads tests caught: two runs of one thread).
    async with etcd_provider.hold("seat", "a", 3000) as first:
        with pytest.raises(LeaseHeld) as held:
            async with etcd_provider.hold("seat", "b", 3000):
                pass
        assert held.value.holder == "a"
        result, keeper = await etcd_provider.acquire_kept("seat", "b", 3000)
        assert not result.acquired and result.owner == "a" and keeper is None
        assert not first.lost.is_set()
        assert await etcd_provider.get_lease_owner("seat") == "a"


async def test_a_tenure_given_up_without_seeing_its_key_change_deletes_the_key(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    # Its watch failed: the tenure cannot be vouched for, but the key still stands on
    # the session lease, which would keep it alive for nobody (review of issue 9).
    async with etcd_provider.hold("other", "me", 3000) as other:
        async with etcd_provider.hold("k", "me", 3000) as lease:
            lease._keeper._give_up("the key's watch failed: (test)")  # type: ignore[attr-defined]
            assert lease.lost.is_set()
            for _ in range(50):
                if await etcd_provider.get_lease_owner("k") is None:
                    break
                await asyncio.sleep(0.05)
            assert await etcd_provider.get_lease_owner("k") is None
        assert not other.lost.is_set()
        assert await etcd_provider.get_lease_owner("other") == "me"


async def test_a_tenure_taken_as_etcd_resumes_starts_alive(etcd_binary: str) -> None:
    """A hold taken while etcd is frozen, answered once it resumes, is not born lost
    (it holds, or reports the outcome unknown).

    The session lease granted then was requested during the freeze: counted from its
    request, its TTL is over when the answer comes. Issue 14 saw ``elect`` take a term
    and lose it 1 ms later ("deadline passed without a renewal"), then take another: a
    new tenure's deadline must count from a renewal answered for it.
    """
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        async with EtcdLeaseProvider(etcd.endpoints, timeout=5.0) as provider:
            async with provider.hold("before", "me", 1000) as before:
                etcd.members[0].pause()
                try:
                    await asyncio.wait_for(before.lost.wait(), 5)  # the session is lost
                    taking = asyncio.create_task(_hold_for(provider, "after", 0.5))
                    await asyncio.sleep(1.5)  # the new session's grant waits for etcd
                finally:
                    etcd.members[0].resume()
                try:
                    lost_while_held = await asyncio.wait_for(taking, 10)
                except BackendUnavailable as exc:
                    # The session lease under the put may have run out meanwhile (it
                    # was granted during the freeze): then its tenure ended, and the
                    # hold says so rather than take a second tenure in one call.
                    assert "outcome unknown" in str(exc)
                    return
            assert lost_while_held is None


async def _hold_for(provider: EtcdLeaseProvider, key: str, seconds: float) -> str | None:
    """Hold ``key`` for ``seconds``; why it was lost meanwhile, if it was."""
    async with provider.hold(key, "me", 1000) as lease:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(lease.lost.wait(), seconds)
        return lease.lost_reason


async def test_a_hold_that_failed_never_puts_its_key_later(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hold whose put failed is settled in the background, by reading: sending the put
    again would create the key once it is free (after its owner's next release, say), a
    tenure nobody asked for that every reader sees until the settlement deletes it (a
    chaos run saw a worker read itself as owner right after its own release)."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix(), timeout=1.5) as p:
        async with p.hold("warm", "me", 3000):  # the session exists already
            pass
        client, key = p.client, p.etcd_key("k")
        original = client._attempt
        refusing = True

        async def attempt(
            index: int, path: str, request: Message, response_type: type[Message], deadline: float
        ) -> Message:
            if refusing and path.endswith("/Txn"):  # never sent: etcd unreachable
                raise etcd_error(grpc.StatusCode.UNAVAILABLE, "unreachable (test)")
            return await original(index, path, request, response_type, deadline)

        monkeypatch.setattr(client, "_attempt", attempt)
        _, before = await client.range_at(key)
        with pytest.raises(BackendUnavailable):
            await p.hold("k", "me", 3000).__aenter__()
        refusing = False  # while the settlement tries again
        await settled(p)
        _, after = await client.range_at(key)
        # The key at every revision since: never put.
        for revision in range(before + 1, after + 1):
            found = await client.call(
                "/etcdserverpb.KV/Range",
                pb.RangeRequest(key=key, revision=revision),
                pb.RangeResponse,
            )
            assert not found.kvs, f"the failed hold put its key at revision {revision}"


def writes(
    request: Message, key: bytes, kind: Literal["request_put", "request_delete_range"]
) -> bool:
    """Whether ``request`` (a transaction, maybe nested in a batch) has an op of ``kind``
    (``request_put``, ``request_delete_range``) on ``key`` among its success ops."""
    if not isinstance(request, pb.TxnRequest):
        return False
    return any(
        (op.HasField(kind) and getattr(op, kind).key == key)
        or (op.HasField("request_txn") and writes(op.request_txn, key, kind))
        for op in request.success
    )


def puts(request: Message, key: bytes) -> bool:
    return writes(request, key, "request_put")


def deletes(request: Message, key: bytes) -> bool:
    return writes(request, key, "request_delete_range")


async def test_a_settlement_never_deletes_the_tenure_a_later_hold_is_taking(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the chaos run (etcd 3.4.23, beside two CPU hogs): a worker's holds of a
    key failed in an outage, its next hold took the key, and the failed holds'
    settlements read the key between that take's transaction and its return: they
    found the owner's value on the session lease, no hold of it registered, and deleted
    the tenure the take then returned (lost 65 ms later, the key deleted while held).
    Forced here: the first hold's put lands and its answer never comes (the hold is
    cancelled); the settlement's read waits for the next hold's transaction to be
    answered, and that answer waits for the read (5 s at most: the read is due 3 s,
    the TTL asked, after the first put)."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix(), timeout=10.0) as p:
        async with p.hold("warm", "me", 3000):  # the session exists already
            pass
        client, key = p.client, p.etcd_key("k")
        original = client._attempt
        first_landed, next_answered, settlement_read = (asyncio.Event() for _ in range(3))
        takes = 0

        async def attempt(
            index: int, path: str, request: Message, response_type: type[Message], deadline: float
        ) -> Message:
            nonlocal takes
            if path.endswith("/Txn") and puts(request, key):
                takes += 1
                answer = await original(index, path, request, response_type, deadline)
                if takes == 1:  # landed; its answer is lost
                    first_landed.set()
                    await asyncio.sleep(60)
                next_answered.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(settlement_read.wait(), 5.0)
                return answer
            if path.endswith("/Range") and getattr(request, "key", None) == key:
                await asyncio.wait_for(next_answered.wait(), 10.0)
                answer = await original(index, path, request, response_type, deadline)
                settlement_read.set()
                return answer
            return await original(index, path, request, response_type, deadline)

        monkeypatch.setattr(client, "_attempt", attempt)
        await hold_cancelled_when(p, first_landed)
        async with p.hold("k", "me", 3000) as lease:
            await settled(p)  # the settlement is done
            kv = await client.range(key)
            assert kv is not None and kv.mod_revision == lease.token, "deleted while held"
            assert not lease.lost.is_set(), lease.lost_reason
        assert len(p._key_locks) == 0  # no lock left behind for a key nobody takes


async def interrupted_hold(
    p: EtcdLeaseProvider,
    monkeypatch: pytest.MonkeyPatch,
    before_read: Callable[[int], Awaitable[None]],
    *,
    put_after_read: int = 0,
    ttl_ms: int = 3000,
) -> asyncio.Event:
    """Cancel a hold of ``k`` by ``me`` whose put lands and is never answered, sent once
    the settlement has read the key ``put_after_read`` times (a copy still on its way).
    ``before_read(n)`` runs before each try of the settlement's reads of the key (n
    counts the tries, from 1) and may refuse one by raising. Set when the put landed."""
    client, key = p.client, p.etcd_key("k")
    original = client._attempt
    answered = [asyncio.Event() for _ in range(1000)]  # each try of a read, in order
    tries = 0
    sent, landed = asyncio.Event(), asyncio.Event()

    async def send(request: Message, response_type: type[Message]) -> None:
        if put_after_read:
            await answered[put_after_read - 1].wait()
        await original(0, "/etcdserverpb.KV/Txn", request, response_type, 5.0)
        landed.set()

    async def attempt(
        index: int, path: str, request: Message, response_type: type[Message], deadline: float
    ) -> Message:
        nonlocal tries
        if path.endswith("/Txn") and puts(request, key) and not sent.is_set():
            sent.set()
            background.add(asyncio.create_task(send(request, response_type)))
            await asyncio.sleep(60)  # its answer never comes: the hold is cancelled
        if path.endswith("/Range") and getattr(request, "key", None) == key:
            tries += 1
            try_ = tries
            await before_read(try_)
            answer = await original(index, path, request, response_type, deadline)
            answered[try_ - 1].set()
            return answer
        return await original(index, path, request, response_type, deadline)

    background: set[asyncio.Task[None]] = set()  # the put, not cancelled with the hold
    async with p.hold("warm", "me", ttl_ms):  # the session exists already
        pass
    monkeypatch.setattr(client, "_attempt", attempt)
    await hold_cancelled_when(p, sent, ttl_ms)
    return landed


async def hold_cancelled_when(
    p: EtcdLeaseProvider, event: asyncio.Event, ttl_ms: int = 3000
) -> None:
    """Start a hold of ``k`` by ``me`` and cancel it once ``event`` is set."""
    hold = asyncio.create_task(p.hold("k", "me", ttl_ms).__aenter__())
    await asyncio.wait_for(event.wait(), 5.0)
    hold.cancel()
    with pytest.raises(asyncio.CancelledError):
        await hold


async def no_wait(read: int) -> None:
    pass


async def test_a_put_landing_after_the_settlements_first_read_is_deleted(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of the put still on its way lands after the first read: a later read of
    the settlement finds it and deletes it (nobody holds it, the session would keep
    it alive as long as the process runs)."""
    p = etcd_provider
    landed = await interrupted_hold(p, monkeypatch, no_wait, put_after_read=1)
    await asyncio.wait_for(landed.wait(), 5.0)
    await settled(p)
    assert await p.client.range(p.etcd_key("k")) is None


async def test_an_interrupted_hold_leaves_its_key_for_the_ttl_it_asked(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put landed and its answer was lost: others may have seen that tenure begin
    and acted on it, so it lasts the TTL asked (3 s) from the put, as an interrupted
    put on a lease of its own does, and only then is the key deleted. (The settlement
    read the key, and deleted it, as soon as the hold failed: a tenure others saw
    ended long before its TTL, then another owner took the key.)"""
    prefix = unique_prefix()
    async with (
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as p,
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as other,
    ):
        reads: list[float] = []

        async def read_at(read: int) -> None:
            reads.append(time.monotonic())

        begun = time.monotonic()
        landed = await interrupted_hold(p, monkeypatch, read_at)
        await asyncio.wait_for(landed.wait(), 5.0)
        assert await other.get_lease_owner("k") == "me"  # the tenure others can see
        await settled(p)
        assert reads and reads[0] >= begun + 3.0, f"read {reads[0] - begun:.2f} s after"
        assert await other.get_lease_owner("k") is None
        # Settled, the key's wait is forgotten: a process interrupted on many keys
        # over its life keeps no entry per key.
        assert p._unsettled_until == {}


async def test_closing_the_provider_ends_an_interrupted_holds_wait_for_its_ttl(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The provider closes while the settlement of an interrupted hold waits out its TTL
    (60 s): the wait ends, closing leaves no task behind (it left the settlement
    asleep, to fail on the closed client a minute later), and the key goes with the
    session lease closing revokes."""
    prefix = unique_prefix()
    async with EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as other:
        p = EtcdLeaseProvider(etcd.endpoints, prefix=prefix)
        landed = await interrupted_hold(p, monkeypatch, no_wait, ttl_ms=60_000)
        await asyncio.wait_for(landed.wait(), 5.0)
        assert await other.get_lease_owner("k") == "me"
        await p.close()
        assert not p._background._tasks, "a settlement outlived the provider"
        assert await other.get_lease_owner("k") is None


def losing_put_answers(
    p: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch, count: int
) -> tuple[asyncio.Event, list[float]]:
    """The first ``count`` puts of ``k`` land and their answers never come; set once each
    landed (a test clears it between them), and the times deletes of ``k`` were sent."""
    client, key = p.client, p.etcd_key("k")
    original = client._attempt
    landed, deleted_at = asyncio.Event(), []
    lost = 0

    async def attempt(
        index: int, path: str, request: Message, response_type: type[Message], deadline: float
    ) -> Message:
        nonlocal lost
        if path.endswith("/Txn") and puts(request, key) and lost < count:
            lost += 1
            await original(index, path, request, response_type, deadline)
            landed.set()
            await asyncio.sleep(60)  # its answer never comes: the hold is cancelled
        if path.endswith("/Txn") and deletes(request, key):
            deleted_at.append(time.monotonic())
        return await original(index, path, request, response_type, deadline)

    monkeypatch.setattr(client, "_attempt", attempt)
    return landed, deleted_at


async def test_a_later_interrupted_hold_of_the_key_puts_its_deletion_off(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two holds of the key by the same owner, interrupted 1.5 s apart, both puts landed
    (the second a new tenure): the key is deleted only once the TTL (3 s) has passed
    since the second put. (The first's settlement deleted it at the first's TTL: the
    second tenure ended 1.5 s early.)"""
    p = etcd_provider
    async with p.hold("warm", "me", 3000):  # the session exists already
        pass
    landed, deleted_at = losing_put_answers(p, monkeypatch, 2)
    await hold_cancelled_when(p, landed)
    await asyncio.sleep(1.5)
    landed.clear()
    second = time.monotonic()
    await hold_cancelled_when(p, landed)
    await settled(p)
    assert deleted_at and deleted_at[0] >= second + 3.0, f"{deleted_at[0] - second:.2f} s"
    assert await p.client.range(p.etcd_key("k")) is None


async def test_an_acquire_of_a_key_an_interrupted_hold_left_keeps_it_for_its_ttl(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1.5 s after a hold was interrupted, its owner acquires the key with
    ``acquire_lease``: that renews the tenure the hold's put began (its token) for the
    TTL from then, and the settlement deletes the key only once that has passed (it
    deleted it at the hold's TTL, 1.5 s before the acquire's ran out)."""
    p = etcd_provider
    async with p.hold("warm", "me", 3000):  # the session exists already
        pass
    landed, deleted_at = losing_put_answers(p, monkeypatch, 1)
    await hold_cancelled_when(p, landed)
    kv = await p.client.range(p.etcd_key("k"))
    assert kv is not None
    await asyncio.sleep(1.5)
    acquired_at = time.monotonic()
    result = await p.acquire_lease("k", "me", 3000)
    assert result.acquired and result.token == kv.mod_revision  # that very tenure
    await settled(p)
    assert deleted_at and deleted_at[0] >= acquired_at + 3.0, f"{deleted_at[0] - acquired_at:.2f}"
    assert await p.client.range(p.etcd_key("k")) is None


async def test_a_tenure_adopted_from_an_interrupted_hold_is_not_deleted_while_held(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner adopts the tenure an interrupted hold's put began: the settlement never
    deletes it while the adopted hold has it (an adopted tenure on the session lease
    was not registered as held: deleted, and the hold lost)."""
    p = etcd_provider
    async with p.hold("warm", "me", 3000):  # the session exists already
        pass
    landed, deleted_at = losing_put_answers(p, monkeypatch, 1)
    await hold_cancelled_when(p, landed)
    async with p.adopt("k", "me", 3000) as held:
        await settled(p)  # the settlement is over
        assert not held.lost.is_set(), held.lost_reason
        kv = await p.client.range(p.etcd_key("k"))
        assert kv is not None and kv.mod_revision == held.token
    assert deleted_at  # by the adopted hold's release


async def test_a_settlement_reads_again_while_etcd_is_unreachable(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its reads refused for longer than the client's timeout, the settlement reads again
    until one is answered, and deletes the key its put left."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix(), timeout=1.0) as p:
        refused_until = math.inf

        async def refuse_at_first(read: int) -> None:
            nonlocal refused_until
            if read == 1:
                refused_until = time.monotonic() + 1.5
            if time.monotonic() < refused_until:
                raise etcd_error(grpc.StatusCode.UNAVAILABLE, "unreachable (test)")

        landed = await interrupted_hold(p, monkeypatch, refuse_at_first)
        await asyncio.wait_for(landed.wait(), 5.0)
        await settled(p)
        assert time.monotonic() >= refused_until  # it read after the refusals
        assert await p.client.range(p.etcd_key("k")) is None


async def test_a_settlement_leaves_the_same_owners_tenure_on_another_lease(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the put and the settlement's read, another process of the same owner took
    the key onto its own lease (a new tenure): not the session's key any more, it stays."""
    prefix = unique_prefix()
    async with (
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as p,
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as elsewhere,
    ):
        taken: list[AcquireResult] = []

        async def taken_elsewhere_first(read: int) -> None:
            if read == 1:
                taken.append(await elsewhere.acquire_lease("k", "me", 5000))

        landed = await interrupted_hold(p, monkeypatch, taken_elsewhere_first)
        await asyncio.wait_for(landed.wait(), 5.0)
        await settled(p)
        kv = await p.client.range(p.etcd_key("k"))
        assert taken and taken[0].acquired and kv is not None
        assert kv.mod_revision == taken[0].token and not is_session_lease(kv.lease)


def renewals_requested(p: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The leases of the one-shot renewals ``p`` requests from now on, in order."""
    requested: list[int] = []
    original = p._keepalive.request_renewal

    def request_renewal(lease_id: int) -> asyncio.Future[Renewal]:
        requested.append(lease_id)
        return original(lease_id)

    monkeypatch.setattr(p._keepalive, "request_renewal", request_renewal)
    return requested


async def hold_fifty_at_once(p: EtcdLeaseProvider) -> int:
    """Hold ``k0``..``k49`` by ``me`` together, then let them go; their session lease."""
    async with contextlib.AsyncExitStack() as stack:
        await asyncio.gather(
            *(stack.enter_async_context(p.hold(f"k{i}", "me", 3000)) for i in range(50))
        )
        (session,) = await leases_of(p, "k")
        return session


async def test_holds_taken_at_once_by_a_fresh_provider_share_one_session_and_renewal(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fifty holds started together, before any session exists: one session lease is
    granted (the others wait for it), and the takes share one renewal of it (a
    keep-alive message, not one per key): its first. Once answered, it counts from
    after every take began: none asks for another (each did when the shared one was
    answered before it looked, 10 renewals seen under load)."""
    requested = renewals_requested(etcd_provider, monkeypatch)
    session = await hold_fifty_at_once(etcd_provider)
    assert requested == [session]


async def test_holds_taken_at_once_on_an_older_session_share_one_renewal(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session was granted before the takes began: they need a renewal answered
    alongside their puts, and share one."""
    p = etcd_provider
    async with p.hold("warm", "me", 3000):  # the session exists already
        pass
    requested = renewals_requested(p, monkeypatch)
    session = await hold_fifty_at_once(p)
    assert requested == [session]


async def test_a_take_begun_before_the_sessions_last_renewal_asks_for_none(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A take that reaches its put after a renewal sent since it began was answered
    needs none of its own: the session lives the TTL from its start already. Forced:
    the first take waits for its session until a second take, begun after it, holds
    its key (that take's renewal answered)."""
    p = etcd_provider
    async with p.hold("warm", "me", 3000):  # the session exists already
        pass
    requested = renewals_requested(p, monkeypatch)
    original = p._sessions.get
    waiting, second_held = asyncio.Event(), asyncio.Event()

    async def get(ttl_s: int) -> Session:
        if not waiting.is_set():  # the first take's
            waiting.set()
            await asyncio.wait_for(second_held.wait(), 10.0)
        return await original(ttl_s)

    monkeypatch.setattr(p._sessions, "get", get)
    first = asyncio.create_task(p.hold("k1", "me", 3000).__aenter__())
    await asyncio.wait_for(waiting.wait(), 5.0)
    async with p.hold("k2", "me", 3000):
        second_held.set()
        held = await first
        (session,) = await leases_of(p, "k")
        await held._finish()
    assert requested == [session]


async def test_a_session_granted_again_mid_take_is_renewed_alongside_the_put(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A take whose put etcd refused, its session lease gone, puts the key on a new
    session granted after the take began: never renewed, so its first tenure starts
    with a renewal of it answered beside the put (its keep-alive seen working), not
    from the grant alone."""
    p = etcd_provider
    async with p.hold("warm", "me", 3000):  # the session exists already
        (old,) = await leases_of(p, "warm")
    await p.client.revoke(old)  # as etcd would on expiry, not seen here yet
    requested = renewals_requested(p, monkeypatch)
    async with p.hold("k", "me", 3000):
        (new,) = await leases_of(p, "k")
    assert is_session_lease(new) and new != old
    assert requested[-1] == new  # (preceded by the old session's, if it was asked for)


async def test_a_session_slow_to_be_granted_holds_back_no_other_ttls_takes(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions of each TTL are granted under a lock of their own: a hold of 9 s is taken
    while the grant of the 3 s session waits (etcd slow to answer it)."""
    p = etcd_provider
    original = p._sessions._grant
    granting, release = asyncio.Event(), asyncio.Event()

    async def grant(ttl_s: int) -> Grant:
        if ttl_s == p._ttl_s(3000):
            granting.set()
            await release.wait()
        return await original(ttl_s)

    monkeypatch.setattr(p._sessions, "_grant", grant)
    slow = asyncio.create_task(p.hold("short", "me", 3000).__aenter__())
    try:
        await asyncio.wait_for(granting.wait(), 5.0)
        async with asyncio.timeout(5.0):
            async with p.hold("long", "me", 9000) as lease:
                assert not slow.done() and lease.token > 0
    finally:
        release.set()
        held = await slow
        await held._finish()


async def test_a_session_lost_here_is_revoked_in_etcd(etcd_provider: EtcdLeaseProvider) -> None:
    """A session this process gave up (say etcd refused a put under it, or its renewals
    came too late) is revoked: keys etcd may still keep on it would otherwise stand,
    held by nobody, until its TTL ran out. And forgotten: nothing stays behind for a TTL
    no hold asks for any more."""
    p = etcd_provider
    async with p.hold("k", "me", 3000) as lease:
        kv = await p.client.range(p.etcd_key("k"))
        assert kv is not None
        session = p._sessions._sessions[p._ttl_s(3000)]
        p._sessions.lose(session, "given up (test)")
        await asyncio.wait_for(lease.lost.wait(), 5.0)
        await settled(p)
        assert (await p.client.time_to_live(kv.lease)).TTL == -1
        assert await p.client.range(p.etcd_key("k")) is None
        assert p._sessions._sessions == {}


async def test_a_session_past_its_deadline_is_replaced_before_its_loss_is_noticed(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """A session whose renewals came too late (its deadline passed, the keep-alive loop
    not yet at it) is not handed to a take: a new one is granted."""
    sessions = etcd_provider._sessions
    late = await sessions.get(3)
    late.kept.valid_until = time.monotonic() - 0.01
    assert (await sessions.get(3)).lease_id != late.lease_id


async def test_closing_the_provider_revokes_its_session_leases(etcd: EtcdCluster) -> None:
    prefix = unique_prefix()
    async with EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as observer:
        async with EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as p:
            async with p.hold("k", "me", 3000):
                pass
            sessions = await leases_of(p, "")  # none: the key went with its hold
            session = next(iter(p._sessions._sessions.values())).lease_id
            assert not sessions and (await observer.client.time_to_live(session)).TTL > 0
        assert (await observer.client.time_to_live(session)).TTL == -1


async def test_a_tenure_moved_onto_the_session_frees_the_lease_it_left(etcd: EtcdCluster) -> None:
    """The same owner's tenure taken by another process moves onto this one's session:
    the lease it left carries nothing any more and is revoked (not left to its TTL)."""
    prefix = unique_prefix()
    async with (
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as p,
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as elsewhere,
    ):
        await elsewhere.acquire_lease("job", "me", 60_000)
        before = await p.client.range(p.etcd_key("job"))
        assert before is not None
        async with p.hold("job", "me", 3000):
            await settled(p)
            assert (await p.client.time_to_live(before.lease)).TTL == -1


async def test_a_hold_cancelled_while_its_put_is_confirmed_leaves_no_key(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put landed and the hold is cancelled while it waits for the session's renewal
    (etcd slow to answer it): nobody holds the key, so it is deleted once the TTL
    asked (3 s) has passed (others may have seen the tenure begin)."""
    p = etcd_provider
    async with p.hold("warm", "me", 3000):  # the session exists already
        pass
    confirming = asyncio.Event()
    original = p.client._attempt
    reads: list[float] = []

    async def attempt(
        index: int, path: str, request: Message, response_type: type[Message], deadline: float
    ) -> Message:
        if (
            hold.done()
            and path.endswith("/Range")
            and getattr(request, "key", None) == p.etcd_key("k")
        ):
            reads.append(time.monotonic())  # the settlement's
        return await original(index, path, request, response_type, deadline)

    async def confirm(*args: object) -> bool:
        confirming.set()
        await asyncio.sleep(60)  # the renewal's answer is slow: cancelled meanwhile
        raise AssertionError("not cancelled")

    monkeypatch.setattr(p._sessions, "confirm", confirm)
    monkeypatch.setattr(p.client, "_attempt", attempt)
    begun = time.monotonic()
    hold = asyncio.create_task(p.hold("k", "me", 3000).__aenter__())
    await asyncio.wait_for(confirming.wait(), 5.0)
    kv = await p.client.range(p.etcd_key("k"))
    assert kv is not None and kv.value == b"me"  # the put landed
    hold.cancel()
    with pytest.raises(asyncio.CancelledError):
        await hold
    await settled(p)
    assert reads and reads[0] >= begun + 3.0, f"read {reads[0] - begun:.2f} s after"
    assert await p.client.range(p.etcd_key("k")) is None


@pytest.mark.parametrize("renewed_beside", [False, True], ids=["no-renewal", "renewal"])
async def test_a_put_counts_while_its_session_lives_however_little_is_left(
    etcd_provider: EtcdLeaseProvider, renewed_beside: bool
) -> None:
    """A put counts if its session is alive once the put, and the renewal asked beside
    it if one was (none when one was answered since the take began), were answered,
    however little of the session is left (an answer slow to come); not once its time
    has run out, nor once it was lost."""
    now = time.monotonic()

    def session(valid_until: float) -> Session:
        lease_id = new_lease_id(session=True)
        return Session(lease_id, 3, KeptLease(lease_id, 3, valid_until), valid_until)

    async def confirm(session: Session) -> bool:
        renewal = None
        if renewed_beside:  # answered already; the keep-alive loop applied it
            renewal = asyncio.get_running_loop().create_future()
            renewal.set_result((now - 2.6, 3))
        return await etcd_provider._sessions.confirm(session, renewal, 5.0)

    assert await confirm(session(now + 0.4))
    assert not await confirm(session(now - 0.01))
    lost = session(now + 3.0)
    lost.kept.lost.set()
    assert not await confirm(lost)


def confirm_first_too_late(
    p: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch, meanwhile: Callable[[], Awaitable[None]]
) -> list[int]:
    """The first put's confirmation comes after the session's deadline (etcd stalled:
    the renewal asked with the put was answered too late), and ``meanwhile`` runs
    before the take looks again. The revisions of the puts confirmed, in order."""
    original = p._sessions.confirm
    confirmed: list[int] = []

    async def confirm(session: Session, renewal: asyncio.Future[Renewal], timeout: float) -> bool:
        assert await original(session, renewal, timeout)
        kv = await p.client.range(p.etcd_key("k"))
        assert kv is not None
        confirmed.append(kv.mod_revision)
        if len(confirmed) > 1:
            return True
        await meanwhile()
        return False

    monkeypatch.setattr(p._sessions, "confirm", confirm)
    return confirmed


async def test_a_put_confirmed_too_late_is_written_again_if_still_ours(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tenure the put began may have ended unseen: the key, still ours, is written
    again on a live session, a new tenure (a new token) the hold then keeps."""
    p = etcd_provider

    async def nothing() -> None:
        pass

    confirmed = confirm_first_too_late(p, monkeypatch, nothing)
    async with p.hold("k", "me", 3000) as lease:
        assert len(confirmed) == 2 and lease.token == confirmed[1] > confirmed[0]
        kv = await p.client.range(p.etcd_key("k"))
        assert kv is not None and kv.mod_revision == lease.token


async def test_a_put_confirmed_too_late_and_gone_since_is_an_unknown_outcome(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key the put wrote was deleted before the take looked again: that tenure began
    and ended; neither "acquired" nor "not acquired" is true."""
    p = etcd_provider

    async def deleted() -> None:
        await p.client.call(
            "/etcdserverpb.KV/DeleteRange",
            pb.DeleteRangeRequest(key=p.etcd_key("k")),
            pb.DeleteRangeResponse,
        )

    confirm_first_too_late(p, monkeypatch, deleted)
    with pytest.raises(BackendUnavailable) as raised:
        await p.hold("k", "me", 3000).__aenter__()
    assert str(raised.value) == (
        "etcd: the session lease under the put ran out before its renewal was answered "
        "(etcd stalled): the tenure it began has ended; outcome unknown"
    )
    assert await p.client.range(p.etcd_key("k")) is None


async def test_a_take_whose_every_session_is_gone_fails_in_the_client_timeout(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd refuses each put, its session lease gone (revoked as soon as granted, here):
    the take tries new sessions until the client's timeout, then fails saying so."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix(), timeout=1) as p:
        original = p._sessions._grant
        granted: list[int] = []

        async def grant(ttl_s: int) -> Grant:
            lease = await original(ttl_s)
            await p.client.revoke(lease.lease_id)
            granted.append(lease.lease_id)
            return lease

        monkeypatch.setattr(p._sessions, "_grant", grant)
        with pytest.raises(BackendUnavailable) as raised:
            await p.hold("k", "me", 3000).__aenter__()
        assert str(raised.value) == (
            "etcd: no session lease stayed alive long enough to put the key on it"
        )
        assert len(granted) > 1  # a new session after each refusal
        assert await p.client.range(p.etcd_key("k")) is None


async def test_a_tenure_given_up_is_not_deleted_under_a_hold_taking_it(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hold whose key's watch failed gives its tenure up and deletes the key, unless a
    hold of this process has that tenure: the same owner's next hold of the key, still
    between its transaction and its return, is about to. Forced here: the watch fails
    once that transaction is answered, and its answer waits for the delete (2 s at
    most). Before, the delete compared only the tenure's revision and ended the tenure
    the second hold then returned."""
    p = etcd_provider
    client, key = p.client, p.etcd_key("k")
    original = client._attempt
    taking, taken, delete_sent = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def attempt(
        index: int, path: str, request: Message, response_type: type[Message], deadline: float
    ) -> Message:
        if path.endswith("/Txn") and deletes(request, key):
            delete_sent.set()
        answer = await original(index, path, request, response_type, deadline)
        if path.endswith("/Txn") and puts(request, key) and taking.is_set():
            taken.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(delete_sent.wait(), 2.0)
        return answer

    monkeypatch.setattr(client, "_attempt", attempt)
    async with p.hold("k", "me", 3000) as first:
        taking.set()
        holding = p.hold("k", "me", 3000)
        second = asyncio.create_task(holding.__aenter__())
        await asyncio.wait_for(taken.wait(), 5.0)
        keeper = first._keeper
        assert isinstance(keeper, EtcdKeeper)
        keeper._watch_failed(BackendUnavailable("the key's watch failed (test)"))
        lease = await second
        try:
            assert lease.token == first.token  # the same tenure, shared
            await settled(p)
            kv = await client.range(key)
            assert kv is not None and kv.mod_revision == lease.token, "deleted while held"
            assert not lease.lost.is_set(), lease.lost_reason
        finally:
            await holding.__aexit__(None, None, None)


async def test_a_take_whose_renewal_goes_unanswered_fails_in_the_client_timeout(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put landed, and the session's renewal asked with it goes unanswered: the take
    fails in the client's timeout, in words saying so, and deletes the key it put once
    the TTL it asked has passed. It does not wait for the answer: none is let through
    until it failed."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix(), timeout=2.0) as p:
        flowing = asyncio.Event()
        flowing.set()
        open_call = p.client.keep_alive_stream
        monkeypatch.setattr(
            p.client,
            "keep_alive_stream",
            lambda *args: HeldKeepAliveAnswers(open_call(*args), flowing),
        )
        async with p.hold("warm", "me", 10_000):  # the session, renewed (TTL 10 s)
            pass
        flowing.clear()
        try:
            async with asyncio.timeout(20):  # bounds a take that waits for the answer
                with pytest.raises(BackendUnavailable, match=r"was not answered in 2\.0 s"):
                    await p.hold("k", "me", 10_000).__aenter__()
        finally:
            flowing.set()
        await settled(p, timeout=20.0)
        assert await p.client.range(p.etcd_key("k")) is None
