"""What the etcd backend guarantees beyond the contract table: the invariants of ETCD.md."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import pytest
from google.protobuf.message import Message

from etcd_leases import (
    BackendUnavailable,
    EtcdLeaseProvider,
    LeaseLost,
    LeaseValueError,
    OwnerState,
    ProviderClosed,
)
from etcd_leases.etcd.keeper import EtcdKeeper
from etcd_leases.etcd.members import parse_endpoints
from etcd_leases.etcd.pool import Grant
from etcd_leases.etcd.txn import Txn, delete, put
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.testing import EtcdCluster
from tests.conftest import (
    Records,
    assert_books_name_no_gone_lease,
    assert_freed,
    assert_no_lease_leaked,
    eventually,
    past_one_shot,
    settled,
    unique_prefix,
)


async def test_value_is_the_owner_under_the_prefix(
    etcd: EtcdCluster, etcd_provider: EtcdLeaseProvider
) -> None:
    await etcd_provider.acquire_lease("job\0 42", "worker-α", 5000)
    shown = etcd.etcdctl("get", "--prefix", etcd_provider.prefix).splitlines()
    assert shown == [f"{etcd_provider.prefix}job\0 42", "worker-α"]


async def test_token_is_the_mod_revision(etcd_provider: EtcdLeaseProvider) -> None:
    result = await etcd_provider.acquire_lease("k", "alice", 5000)
    kv = await etcd_provider.client.range(etcd_provider.etcd_key("k"))
    assert kv is not None and result.token == kv.mod_revision
    assert await etcd_provider.transfer_lease("k", "alice", "bob", 5000)
    kv = await etcd_provider.client.range(etcd_provider.etcd_key("k"))
    bob = await etcd_provider.acquire_lease("k", "bob", 5000)
    assert kv is not None and bob.token == kv.mod_revision


async def test_one_tenure_per_lease_and_freed_leases_are_reused(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    client = etcd_provider.client
    for key in ("a", "b", "c"):
        await etcd_provider.acquire_lease(key, "alice", 5000)
    kvs = await client.range_prefix(etcd_provider.etcd_key(""))
    assert len({kv.lease for kv in kvs}) == 3 and all(kv.lease for kv in kvs)
    old = kvs[0]
    assert await etcd_provider.transfer_lease("a", "alice", "bob", 5000)
    new = await client.range(etcd_provider.etcd_key("a"))
    assert new is not None and new.lease != old.lease
    # The old tenure's lease carries no key now: it is back in the pool, alive...
    status = await client.time_to_live(old.lease, keys=True)
    assert status.TTL > 0 and list(status.keys) == []
    # (Asked for them, etcd does list a lease's keys: the new tenure's shows its key.)
    carrying = await client.time_to_live(new.lease, keys=True)
    assert list(carrying.keys) == [etcd_provider.etcd_key("a")]
    assert etcd_provider._pool.free_lease_ids() == {old.lease}
    # ...and the next tenure takes it, granting nothing.
    await etcd_provider.acquire_lease("d", "alice", 5000)
    reused = await client.range(etcd_provider.etcd_key("d"))
    assert reused is not None and reused.lease == old.lease
    assert old.lease not in etcd_provider._pool.free_lease_ids()


async def test_ttl_rounds_up_to_whole_seconds(etcd_provider: EtcdLeaseProvider) -> None:
    assert (await etcd_provider.acquire_lease("one", "a", 1)).ttl_ms == 1000
    assert (await etcd_provider.acquire_lease("up", "a", 1001)).ttl_ms == 2000
    kv = await etcd_provider.client.range(etcd_provider.etcd_key("up"))
    assert kv is not None
    assert (await etcd_provider.client.time_to_live(kv.lease)).grantedTTL == 2


async def test_server_minimum_ttl_is_reported(etcd_binary: str) -> None:
    # Default election timeout (1 s): etcd's minimum TTL is 2 s.
    args = ["--heartbeat-interval=100", "--election-timeout=1000"]
    with EtcdCluster(1, binary=etcd_binary, extra_args=args) as etcd:
        async with EtcdLeaseProvider(etcd.endpoints) as provider:
            first = await provider.acquire_lease("k", "a", 1000)
            assert first.ttl_ms == 2000
            # Renewals at the same request keep the tenure (no TTL change seen).
            again = await provider.acquire_lease("k", "a", 1000)
            assert again.token == first.token and again.ttl_ms == 2000


async def test_no_lease_leaks_across_operations(etcd: EtcdCluster) -> None:
    prefix = unique_prefix()
    async with EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as provider:
        before = set(await provider.client.leases())
        others = [EtcdLeaseProvider(etcd.endpoints, prefix=prefix) for _ in range(5)]
        try:
            for round_ in range(3):
                results = await asyncio.gather(
                    *(p.acquire_lease("contended", f"w{i}", 5000) for i, p in enumerate(others))
                )
                winner = next(r.owner for r in results if r.acquired)
                assert winner is not None
                await provider.acquire_lease("contended", winner, 7000)  # TTL change
                await provider.renew_lease("contended", winner, 4000)  # and another
                assert await provider.transfer_lease("contended", winner, f"next{round_}", 5000)
                assert not await provider.transfer_lease("contended", winner, "x", 5000)
                await provider.release_lease("contended", f"next{round_}")
            assert await provider.get_lease_owner("contended") is None
            # Every lease left is free in a pool (alive, carrying no key)...
            left = set(await provider.client.leases()) - before
            pooled = set().union(*(p._pool.free_lease_ids() for p in [provider, *others]))
            assert left <= pooled
            for lease in left:
                assert list((await provider.client.time_to_live(lease, keys=True)).keys) == []
        finally:
            for other in others:
                await other.close()
        # ...and revoked when its provider closes.
        assert set(await provider.client.leases()) - before == provider._pool.free_lease_ids()
    async with EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as checker:
        assert set(await checker.client.leases()) - before == set()


async def test_transfer_never_leaves_the_key_free(etcd_provider: EtcdLeaseProvider) -> None:
    client = etcd_provider.client
    key = etcd_provider.etcd_key("baton")
    first = await etcd_provider.acquire_lease("baton", "runner-0", 5000)
    assert first.token is not None
    stream = client.watch_stream(await client.auth.metadata())
    await stream.write(
        pb.WatchRequest(create_request=pb.WatchCreateRequest(key=key, start_revision=first.token))
    )
    for i in range(20):
        assert await etcd_provider.transfer_lease("baton", f"runner-{i}", f"runner-{i + 1}", 5000)
    await etcd_provider.release_lease("baton", "runner-20")
    events: list[pb.Event] = []
    deadline = time.monotonic() + 5
    while len(events) < 22 and time.monotonic() < deadline:
        response = await asyncio.wait_for(stream.read(), 5)
        assert isinstance(response, pb.WatchResponse)
        events.extend(response.events)
    stream.cancel()
    kinds = [(event.type, event.kv.value.decode()) for event in events]
    puts = [(pb.Event.PUT, f"runner-{i}") for i in range(21)]
    assert kinds == [*puts, (pb.Event.DELETE, "")]


async def test_closed_provider_refuses_quickly(etcd: EtcdCluster) -> None:
    provider = EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix())
    await provider.acquire_lease("k", "a", 5000)
    await provider.close()
    await provider.close()  # idempotent
    started = time.monotonic()
    for call in (
        provider.acquire_lease("k", "a", 5000),
        provider.get_lease_owner("k"),
        provider.release_lease("k", "a"),
        provider.renew_lease("k", "a", 5000),
        provider.transfer_lease("k", "a", "b", 5000),
    ):
        with pytest.raises(ProviderClosed):
            await call
    assert time.monotonic() - started < 5.0  # none waited on the network (timeout 5 s)
    async with EtcdLeaseProvider(etcd.endpoints) as scoped:
        await scoped.get_lease_owner("k")
    with pytest.raises(ProviderClosed):
        await scoped.get_lease_owner("k")


async def test_close_during_a_call_raises_closed(etcd: EtcdCluster) -> None:
    provider = EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix())
    calls = [asyncio.ensure_future(provider.acquire_lease(f"k{i}", "a", 5000)) for i in range(50)]
    await asyncio.sleep(0.002)
    await provider.close()
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(e, ProviderClosed) for e in errors), errors


async def test_unreachable_cluster_fails_fast_with_lease_error() -> None:
    from etcd_leases.testing import free_ports

    (port,) = free_ports(1)
    async with EtcdLeaseProvider(f"127.0.0.1:{port}", timeout=1.0) as provider:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable):
            await provider.acquire_lease("k", "a", 5000)
        with pytest.raises(BackendUnavailable):
            await provider.get_lease_owner("k")
        assert time.monotonic() - started < 4


def test_endpoint_forms() -> None:
    def targets(endpoints: str | list[str], tls: bool = False) -> list[tuple[str, bool]]:
        return [(e.target, e.secure) for e in parse_endpoints(endpoints, tls=tls)]

    assert targets("127.0.0.1:2379") == [("127.0.0.1:2379", False)]
    assert targets("http://a:1, https://b:2/") == [("a:1", False), ("b:2", True)]
    assert targets(["a:1", "b:2,c:3"]) == [("a:1", False), ("b:2", False), ("c:3", False)]
    assert targets("a:1", tls=True) == [("a:1", True)]
    assert targets("[::1]:2379,") == [("[::1]:2379", False)]
    for bad in ("", " , ", "ftp://a:1", "http://", "a:1/path", "u@a:1", "a:http", "a:0"):
        with pytest.raises(LeaseValueError, match="endpoints"):
            parse_endpoints(bad, tls=False)


def test_an_endpoint_without_a_port_is_refused_by_name() -> None:
    # Not left to gRPC, which would pick a port of its own and fail only when called.
    for endpoint in ("127.0.0.1", "https://etcd.local", "a:1,localhost:"):
        with pytest.raises(LeaseValueError, match="has no valid port") as refused:
            EtcdLeaseProvider(endpoint)
        assert repr(endpoint.rpartition(",")[2]) in str(refused.value)


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETCDCTL_ENDPOINTS", "http://10.0.0.1:2379,http://10.0.0.2:2379")
    monkeypatch.setenv("ETCDCTL_USER", "svc:pa:ss")
    monkeypatch.setenv("ETCD_LEASES_PREFIX", "/mine/")
    provider = EtcdLeaseProvider.from_env(timeout=2.0)
    assert provider.client.endpoints == ["10.0.0.1:2379", "10.0.0.2:2379"]
    assert provider.prefix == "/mine/" and provider.client.timeout == 2.0
    monkeypatch.setenv("ETCDCTL_USER", "no-password")
    with pytest.raises(LeaseValueError, match=r"^ETCDCTL_USER must be name:password$"):
        EtcdLeaseProvider.from_env()


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(LeaseValueError, match="cert and key"):
        EtcdLeaseProvider(cert="/x.pem")
    with pytest.raises(LeaseValueError, match="username and password"):
        EtcdLeaseProvider(username="u")
    with pytest.raises(LeaseValueError, match="timeout"):
        EtcdLeaseProvider(timeout=0)


async def test_cancelled_transfer_never_frees_the_key(etcd_provider: EtcdLeaseProvider) -> None:
    """A transfer cancelled mid-flight must not revoke the lease it may have handed on;
    its settlement frees whichever lease ended up carrying nothing."""
    before = set(await etcd_provider.client.leases())
    for delay in (0.0005, 0.001, 0.002, 0.003, 0.005):
        await etcd_provider.acquire_lease("handoff", "alice", 5000)
        transfer = asyncio.create_task(
            etcd_provider.transfer_lease("handoff", "alice", "bob", 5000)
        )
        await asyncio.sleep(delay)
        transfer.cancel()
        await asyncio.gather(transfer, return_exceptions=True)
        await settled(etcd_provider)  # the background settlement
        assert await etcd_provider.get_lease_owner("handoff") in ("alice", "bob")
        for owner in ("alice", "bob"):
            await etcd_provider.release_lease("handoff", owner)
        await settled(etcd_provider)
        await assert_no_lease_leaked(etcd_provider, before)


class SlowToKeep(EtcdLeaseProvider):
    """A real etcd provider whose keep_lease starts late: widens a race window."""

    async def keep_lease(
        self, key: str, owner: str, token: int, ttl_ms: int, valid_until: float
    ) -> EtcdKeeper:
        await asyncio.sleep(0.3)
        return await super().keep_lease(key, owner, token, ttl_ms, valid_until)


async def test_adopt_cancelled_before_keeping_gives_the_key_back(etcd: EtcdCluster) -> None:
    # (hold itself acquires and keeps in one step: acquire_kept.)
    async with SlowToKeep(etcd.endpoints, prefix=unique_prefix()) as provider:
        await provider.acquire_lease("k", "bob", 30_000)
        assert await provider.transfer_lease("k", "bob", "alice", 30_000)
        adopting = provider.adopt("k", "alice", 30_000)
        entering = asyncio.create_task(adopting.__aenter__())
        await asyncio.sleep(0.1)  # renewed and read, not yet kept
        entering.cancel()
        await asyncio.gather(entering, return_exceptions=True)
        deadline = time.monotonic() + 2
        while await provider.get_lease_owner("k") is not None:
            assert time.monotonic() < deadline, "the key stayed taken by no one"
            await asyncio.sleep(0.05)


async def test_keep_lease_keeps_only_the_tenure_it_names(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """``keep_lease`` (what ``adopt`` calls) checks its arguments, and refuses a key that
    is absent, held by another owner or tenure, or written by hand without a lease."""
    provider, soon = etcd_provider, time.monotonic() + 5
    with pytest.raises(LeaseValueError):
        await provider.keep_lease("k", "alice", 1, 0, soon)
    with pytest.raises(LeaseLost, match="'alice' no longer holds 'absent' with token 7"):
        await provider.keep_lease("absent", "alice", 7, 5000, soon)
    taken = await provider.acquire_lease("k", "alice", 5000)
    assert taken.token is not None
    with pytest.raises(LeaseLost):
        await provider.keep_lease("k", "bob", taken.token, 5000, soon)
    with pytest.raises(LeaseLost):
        await provider.keep_lease("k", "alice", taken.token + 1, 5000, soon)
    written = await provider.client.txn(
        Txn.when().then(put(provider.etcd_key("by-hand"), b"alice")).request
    )
    by_hand = written.header.revision
    with pytest.raises(LeaseLost):
        await provider.keep_lease("by-hand", "alice", by_hand, 5000, soon)


async def test_an_adopted_tenure_is_renewed_and_its_loss_seen(etcd: EtcdCluster) -> None:
    """The adopted key's own lease is renewed past its TTL, and a transfer away is seen
    from the key's history (the reason names the new owner), not only by a renewal
    failing once the old lease is revoked."""
    async with (
        EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider,
        EtcdLeaseProvider(etcd.endpoints, prefix=provider.prefix) as other,
    ):
        await other.acquire_lease("k", "bob", 30_000)
        assert await other.transfer_lease("k", "bob", "alice", 1000)
        async with provider.adopt("k", "alice", 1000) as adopted:
            await asyncio.sleep(2.5)  # past two TTLs: kept alive by renewals of its lease
            assert not adopted.lost.is_set(), adopted.lost_reason
            assert await other.get_lease_owner("k") == "alice"
            assert await other.transfer_lease("k", "alice", "carol", 30_000)
            await asyncio.wait_for(adopted.lost.wait(), 10)
            assert "carol" in (adopted.lost_reason or ""), adopted.lost_reason


async def test_an_adopted_tenure_sees_a_change_right_after_its_read(
    etcd_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key changes at the very next revision after the adoption read it: its watch
    starts from that revision, so the change is seen as what it is (a transfer naming
    the new owner), not learnt later from the lease's loss. On a member of its own: in
    the shared one, another test's lease expiring may take that next revision."""
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        async with (
            EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider,
            EtcdLeaseProvider(etcd.endpoints, prefix=provider.prefix) as other,
        ):
            taken = await other.acquire_lease("k", "alice", 30_000)
            assert taken.token is not None
            client, original = provider.client, provider.client._attempt
            read_at: list[int] = []

            async def attempt(
                index: int,
                path: str,
                request: Message,
                response_type: type[Message],
                deadline: float,
            ) -> Message:
                answer = await original(index, path, request, response_type, deadline)
                if path.endswith("/Range") and not read_at:  # the adoption's read
                    assert isinstance(answer, pb.RangeResponse)
                    read_at.append(answer.header.revision)
                    assert await other.transfer_lease("k", "alice", "carol", 30_000)
                return answer

            monkeypatch.setattr(client, "_attempt", attempt)
            until = time.monotonic() + 20
            keeper = await provider.keep_lease("k", "alice", taken.token, 30_000, until)
            monkeypatch.undo()
            kv = await client.range(provider.etcd_key("k"))
            assert kv is not None and kv.mod_revision == read_at[0] + 1  # the next revision
            await asyncio.wait_for(keeper.lost.wait(), 10)
            assert "carol" in (keeper.lost_reason or ""), keeper.lost_reason


async def test_an_adoption_on_the_session_lease_leaves_it_to_the_other_keys(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """A key held with ``hold`` sits on the provider's session lease with its other held
    keys; adopting it there and ending the adoption must not stop that lease's renewals."""
    provider = etcd_provider
    async with provider.hold("other", "alice", 1000) as other, provider.hold("k", "alice", 1000):
        async with provider.adopt("k", "alice", 1000):
            pass
        await asyncio.sleep(2.5)  # past two TTLs of the session lease
        assert not other.lost.is_set(), other.lost_reason
        assert await provider.get_lease_owner("other") == "alice"


async def test_a_key_written_by_hand_gets_a_lease_when_its_owner_renews(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """A key someone wrote without a lease (``etcdctl put``) names its owner; the owner's
    renew or re-acquire puts it under a lease of the TTL asked, so it expires after all."""
    provider = etcd_provider
    for key, call in (("renewed", "renew"), ("acquired", "acquire")):
        await provider.client.txn(Txn.when().then(put(provider.etcd_key(key), b"alice")).request)
        if call == "renew":
            assert await provider.renew_lease(key, "alice", 1000)
        else:
            taken = await provider.acquire_lease(key, "alice", 1000)
            assert taken.acquired and taken.ttl_ms == 1000
        kv = await provider.client.range(provider.etcd_key(key))
        assert kv is not None and kv.lease and kv.value == b"alice"
        assert (await provider.client.time_to_live(kv.lease)).grantedTTL == 1
    assert await provider.renew_lease("renewed", "alice", 1000)  # a 1 s lease is alive
    for key in ("renewed", "acquired"):
        deadline = time.monotonic() + 10
        while await provider.get_lease_owner(key) is not None:
            assert time.monotonic() < deadline, f"{key} never expired"
            await asyncio.sleep(0.1)


async def test_a_one_second_lease_goes_back_to_the_pool_and_is_taken_again(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """Etcd's least TTL (1 s here): a released key's lease is reused by the next acquire,
    renewed alongside its put, and that renewal (TTL 1) proves it alive."""
    provider = etcd_provider
    leases = []
    for _ in range(3):
        taken = await provider.acquire_lease("short", "alice", 1000)
        assert taken.acquired and taken.ttl_ms == 1000
        kv = await provider.client.range(provider.etcd_key("short"))
        assert kv is not None
        leases.append(kv.lease)
        await provider.release_lease("short", "alice")
    # The first release revokes its lease (a process that may be a one-shot, see
    # LeasePool.recycling); from the second on, the lease goes back to the pool.
    assert leases[1] == leases[2], leases


@pytest.mark.parametrize("ttl_s", [1, 3])
async def test_a_free_lease_is_kept_by_the_pool_and_a_retired_one_forgotten(
    etcd_provider: EtcdLeaseProvider, ttl_s: int
) -> None:
    """The pool's renewals of a free lease (TTL 1 s, etcd's least here, answers TTL 1)
    keep it alive for the next acquire however long it waits. A lease revoked by a
    one-shot's release is no carrier of anything any more."""
    provider, key, ttl_ms = etcd_provider, etcd_provider.etcd_key("short"), ttl_s * 1000
    await provider.acquire_lease("short", "alice", ttl_ms)
    retired = provider._pool.carrier(key, b"alice")
    await provider.release_lease("short", "alice")  # so far a one-shot: its lease revoked
    assert retired is not None and retired not in await provider.client.leases()
    assert provider._pool.carrier(key, b"alice") is None
    await provider.acquire_lease("short", "alice", ttl_ms)
    await provider.release_lease("short", "alice")  # now back to the pool
    assert provider._pool.carrier(key, b"alice") is None
    free = provider._pool.free_lease_ids()
    await asyncio.sleep(2.5 * ttl_s)  # only the pool's renewals keep them
    assert provider._pool.free_lease_ids() == free
    assert (await provider.acquire_lease("short", "alice", ttl_ms)).acquired
    kv = await provider.client.range(key)
    assert kv is not None and kv.lease in free


async def test_a_free_lease_revoked_behind_the_pools_back_is_dropped_by_its_renewal(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """An operator's ``etcdctl lease revoke`` (or etcd's own, see bug 15247) of a free
    lease: the pool's next renewal hears it gone and hands it out no more."""
    provider = etcd_provider
    for _ in range(2):  # the second release gives its lease back to the pool
        await provider.acquire_lease("short", "alice", 1000)
        await provider.release_lease("short", "alice")
    (revoked, *_) = provider._pool.free_lease_ids()
    assert await provider.client.revoke(revoked)
    deadline = time.monotonic() + 10
    while revoked in provider._pool.free_lease_ids():
        assert time.monotonic() < deadline, "the revoked lease stayed in the pool"
        await asyncio.sleep(0.05)


async def test_a_lease_given_back_after_a_lost_race_makes_the_pool_keep_leases(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """A process whose attempt lost (its lease came back unused) and that acquired
    after that is no one-shot: its releases give their leases back to the pool."""
    provider = etcd_provider
    assert (await provider.acquire_lease("taken", "alice", 5000)).acquired
    assert not (await provider.acquire_lease("taken", "bob", 5000)).acquired
    assert (await provider.acquire_lease("mine", "bob", 5000)).acquired
    kv = await provider.client.range(provider.etcd_key("mine"))
    assert kv is not None
    await provider.release_lease("mine", "bob")
    assert kv.lease in provider._pool.free_lease_ids()
    assert kv.lease in await provider.client.leases()


async def test_a_lease_granted_ahead_as_the_provider_closes_is_revoked(
    etcd_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
            for _ in range(2):  # a lease back in the pool
                await provider.acquire_lease("k", "alice", 5000)
                await provider.release_lease("k", "alice")
            grant = provider._pool._grant

            async def slow_grant(ttl_s: int) -> Grant:
                await asyncio.sleep(0.5)  # still under way when the provider closes
                return await grant(ttl_s)

            monkeypatch.setattr(provider._pool, "_grant", slow_grant)
            await provider.acquire_lease("k", "alice", 5000)  # takes the last: one ahead
            await provider.release_lease("k", "alice")
        async with EtcdLeaseProvider(etcd.endpoints) as look:
            assert await look.client.leases() == []


async def test_less_than_etcds_least_ttl_is_granted_and_pooled_as_etcd_grants_it(
    etcd_binary: str,
) -> None:
    """On a server with the default election timeout (1 s) etcd grants 2 s for 1 s
    asked: the pool files, reuses and grants ahead its leases by the TTL granted."""
    with EtcdCluster(1, binary=etcd_binary, raft_timing=(100, 1000)) as etcd:
        async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
            leases = set()
            for _ in range(4):
                taken = await provider.acquire_lease("k", "alice", 1000)
                assert taken.acquired and taken.ttl_ms == 2000  # as granted
                kv = await provider.client.range(provider.etcd_key("k"))
                assert kv is not None
                assert (await provider.client.time_to_live(kv.lease)).grantedTTL == 2
                leases.add(kv.lease)
                await provider.release_lease("k", "alice")
            await settled(provider)
            assert len(leases) < 4  # reused from the pool


async def test_the_pools_trim_keeps_what_recent_use_needed_and_forgets_expired_tenures(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """Every 30 s (forced here) the pool revokes the free leases beyond the most taken
    at once since the last trim (keeping two), and forgets the leases of tenures that
    expired without this process; a live tenure's lease stays its own."""
    provider, client, pool = etcd_provider, etcd_provider.client, etcd_provider._pool
    await past_one_shot(provider)
    burst = [f"burst{i}" for i in range(8)]
    await asyncio.gather(*(provider.acquire_lease(k, "me", 3000) for k in burst))
    await asyncio.gather(*(provider.release_lease(k, "me") for k in burst))
    await settled(provider)
    free = pool.free_lease_ids()
    assert len(free) >= 8

    async def lease_of(key: str) -> int:
        kv = await client.range(provider.etcd_key(key))
        assert kv is not None
        return kv.lease

    await provider.acquire_lease("expiring", "me", 1000)
    expiring = await lease_of("expiring")
    await provider.acquire_lease("alive", "me", 30_000)
    alive = await lease_of("alive")
    deadline = time.monotonic() + 10
    while await provider.get_lease_owner("expiring") is not None:
        assert time.monotonic() < deadline, "the 1 s tenure never expired"
        await asyncio.sleep(0.1)

    async def trim_then_use_one() -> None:
        pool._trimmed_at = -math.inf  # the next take trims
        await provider.acquire_lease("one", "me", 3000)
        await provider.release_lease("one", "me")
        await settled(provider)

    await trim_then_use_one()  # the burst was the most taken at once: all kept
    assert free <= pool.free_lease_ids()
    assert expiring not in pool._out and alive in pool._out
    await trim_then_use_one()  # since the last trim, one at most: two kept
    kept = pool.free_lease_ids()
    assert len(kept) == 2
    assert not (free - kept) & set(await client.leases()), "trimmed leases not revoked"
    await provider.release_lease("alive", "me")
    assert alive in pool.free_lease_ids()


async def test_a_free_lease_past_its_freshness_is_revoked_not_handed_out(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """A free lease whose renewal is overdue (less than half its TTL known left) is
    not trusted with a tenure: revoked, and another granted."""
    provider, pool = etcd_provider, etcd_provider._pool
    await past_one_shot(provider)
    await provider.acquire_lease("k", "me", 3000)
    await provider.release_lease("k", "me")
    (stale,) = pool.free_lease_ids()
    assert pool._sweeper is not None
    pool._sweeper.cancel()  # its renewals stop
    await asyncio.sleep(2.0)  # past half its 3 s, before etcd's expiry
    assert (await provider.acquire_lease("k", "me", 3000)).acquired
    kv = await provider.client.range(provider.etcd_key("k"))
    assert kv is not None and kv.lease != stale
    await settled(provider)
    assert stale not in await provider.client.leases()


async def test_cancelled_acquires_leave_no_lease_behind(etcd_binary: str) -> None:
    # An etcd of its own: a lease another test's provider granted in the background as
    # it closed (left to expire) would count here as this test's leak.
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        await _cancel_acquires(etcd)


async def _cancel_acquires(etcd: EtcdCluster) -> None:
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        before = set(await provider.client.leases())
        for i, delay in enumerate((0, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.006)):
            attempt = asyncio.create_task(provider.acquire_lease(f"k{i}", "alice", 60_000))
            await asyncio.sleep(delay)
            attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)
        await settled(provider)  # background revokes
        for i in range(8):
            await provider.release_lease(f"k{i}", "alice")
        # Back in the pool, or (a create cancelled in flight: its outcome unknown, the
        # tenure it may have begun must last its TTL) carrying nothing and left to run out.
        for lease in set(await provider.client.leases()) - before:
            await assert_freed(provider, lease, or_expiring=True)
        await assert_books_name_no_gone_lease(provider)


async def test_a_fresh_process_renewing_under_the_server_minimum_keeps_the_token(
    etcd_binary: str,
) -> None:
    # Default election timeout: etcd raises 1 s requests to 2 s. A process that has
    # not learnt that yet must not mistake the same request for a change of TTL.
    args = ["--heartbeat-interval=100", "--election-timeout=1000"]
    with EtcdCluster(1, binary=etcd_binary, extra_args=args) as etcd:
        async with EtcdLeaseProvider(etcd.endpoints) as first:
            held = await first.acquire_lease("k", "a", 1000)
        async with EtcdLeaseProvider(etcd.endpoints) as fresh:
            assert await fresh.renew_lease("k", "a", 1000)
            again = await fresh.acquire_lease("k", "a", 1000)
            assert again.token == held.token and again.ttl_ms == 2000


async def test_watch_owner_reports_every_change_in_order(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """Each owner the key had after the first read, with its token, even when etcd
    delivers the changes together in one batch (as the memory backend reports them)."""
    client, key = etcd_provider.client, etcd_provider.etcd_key("k")
    await client.txn(Txn.when().then(put(key, b"X")).request)
    states = etcd_provider.watch_owner("k")
    assert (await anext(states)).owner == "X"
    expected = []
    for value in (b"A", b"B", None, b"C"):
        op = delete(key) if value is None else put(key, value)
        revision = (await client.txn(Txn.when().then(op).request)).header.revision
        expected.append(
            OwnerState(None, None) if value is None else OwnerState(value.decode(), revision)
        )
    seen = [await asyncio.wait_for(anext(states), 5.0) for _ in expected]
    await states.aclose()
    assert seen == expected


async def test_watch_owner_never_goes_back_after_a_compaction(
    etcd: EtcdCluster, etcd_provider: EtcdLeaseProvider
) -> None:
    client, key = etcd_provider.client, etcd_provider.etcd_key("k")
    await client.txn(Txn.when().then(put(key, b"X")).request)
    states = etcd_provider.watch_owner("k")
    assert (await anext(states)).owner == "X"
    await client.txn(Txn.when().then(put(key, b"A")).request)
    compacted = (await client.txn(Txn.when().then(put(key, b"B")).request)).header.revision
    etcd.etcdctl("compact", str(compacted))
    await client.txn(Txn.when().then(put(key, b"C")).request)
    seen: list[str | None] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1.5):
            async for state in states:
                seen.append(state.owner)
    await states.aclose()
    assert seen == ["C"]


async def test_acquire_grants_again_when_it_stalled_past_its_grant(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process frozen between its grant and its create (GC, SIGSTOP) finds the lease
    # expired: the create is refused with "lease not found", and acquire must grant
    # again rather than fail (seen when a chaos test froze a serverless sender).
    grant = etcd_provider._pool._grant
    stalled: list[int] = []

    async def grant_then_stall(ttl_s: int) -> Grant:
        granted = await grant(ttl_s)
        if not stalled:
            stalled.append(granted.lease_id)
            for _ in range(150):  # until etcd has expired the grant (30 s at most)
                if (await etcd_provider.client.time_to_live(granted.lease_id)).TTL == -1:
                    break
                await asyncio.sleep(0.2)
        return granted

    monkeypatch.setattr(etcd_provider._pool, "_grant", grant_then_stall)
    result = await etcd_provider.acquire_lease("stalled", "alice", 1000)
    assert result.acquired and stalled
    kv = await etcd_provider.client.range(etcd_provider.etcd_key("stalled"))
    assert kv is not None and kv.lease not in (0, stalled[0]) and kv.mod_revision == result.token


@pytest.mark.parametrize(("call", "owner"), [("transfer", "bob"), ("renew", "alice")])
async def test_a_move_takes_another_lease_when_etcd_dropped_the_one_it_took(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch, call: str, owner: str
) -> None:
    # The pooled lease a move takes may be gone when its transaction arrives (revoked
    # by a stalled etcd leader, bug 15247; expired while the process was frozen): the
    # put is refused, the key unchanged. Transfer (and renew with another TTL) answered
    # False although alice held the key throughout.
    p = etcd_provider
    assert (await p.acquire_lease("k", "alice", 5000)).acquired
    take = p._pool.take
    dropped: list[int] = []

    async def take_dropped(ttl_s: int) -> Grant:
        grant = await take(ttl_s)
        if not dropped:
            dropped.append(grant.lease_id)
            assert await p.client.revoke(grant.lease_id)
        return grant

    monkeypatch.setattr(p._pool, "take", take_dropped)
    if call == "transfer":
        assert await p.transfer_lease("k", "alice", "bob", 5000)
    else:
        assert await p.renew_lease("k", "alice", 8000)
    kv = await p.client.range(p.etcd_key("k"))
    assert dropped and kv is not None and kv.value == owner.encode()
    assert kv.lease not in (0, dropped[0])
    await assert_books_name_no_gone_lease(p)


async def test_a_one_shots_late_release_of_an_ended_tenure_leaves_the_next_owner_alone(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """A one-shot process (no lease given back yet, so a release revokes the tenure's
    lease) took the key as alice; alice's lease was revoked elsewhere (an operator),
    and bob took the key in this process. alice's release, late, finds no carrier for
    alice: the key's carrier is bob's lease, and it stays."""
    provider = etcd_provider
    assert (await provider.acquire_lease("k", "alice", 5000)).acquired
    kv = await provider.client.range(provider.etcd_key("k"))
    assert kv is not None and await provider.client.revoke(kv.lease)
    assert (await provider.acquire_lease("k", "bob", 5000)).acquired
    assert not provider._pool.recycling
    await provider.release_lease("k", "alice")
    assert await provider.get_lease_owner("k") == "bob"


async def test_a_sweep_that_fails_is_logged_at_once(
    etcd_provider: EtcdLeaseProvider,
    no_background_task_fails: Records,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A defect in the pool's sweep (a renewal raising what no etcd answer makes it
    raise) ends the sweeper: logged as a failed background task when it ends, not
    left for the garbage collector to mention, if ever."""
    provider = etcd_provider
    for _ in range(2):  # the second release gives its lease back: the sweep begins
        await provider.acquire_lease("k", "alice", 1000)
        await provider.release_lease("k", "alice")
    assert provider._pool.free_lease_ids()

    async def renew(grant: Grant) -> None:
        raise RuntimeError("a defect in the sweep")

    monkeypatch.setattr(provider._pool, "_renew", renew)
    records = no_background_task_fails.records
    await eventually(lambda: bool(records), "the sweeper's failure logged")
    (record,) = records
    assert "_sweep failed" in record.getMessage()
    records.clear()  # failed on purpose
