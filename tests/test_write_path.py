"""Issue 9: what each contract call costs etcd.

Every etcd call the client makes is counted by method. Each ``Txn``, ``LeaseGrant``
and ``LeaseRevoke`` is one raft write (a consensus round with an fsync); ``Range``
and keep-alives are none. The benchmark (``benchmarks/``) reads the same from etcd's
own metrics, and times it; tests only count.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from etcd_leases import EtcdLeaseProvider
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.testing import EtcdCluster
from tests.conftest import past_one_shot, settled, unique_prefix


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every unary etcd call any client makes, by method (``Txn``, ``Range``, ...)."""
    counted: Counter[str] = Counter()
    call = EtcdClient.call

    async def counting(self: EtcdClient, path: str, *args: Any, **kwargs: Any) -> Any:
        counted[path.rsplit("/", 1)[1]] += 1
        return await call(self, path, *args, **kwargs)

    monkeypatch.setattr(EtcdClient, "call", counting)
    return counted


async def warm(provider: EtcdLeaseProvider) -> None:
    """Give the pool its leases: one granted on the way, one ahead in the background."""
    await past_one_shot(provider)
    for _ in range(2):
        await provider.acquire_lease("warm", "me", 5000)
        await provider.release_lease("warm", "me")
    await settled(provider)


async def test_each_ownership_change_is_one_write(
    etcd_provider: EtcdLeaseProvider, calls: Counter[str]
) -> None:
    provider = etcd_provider
    await warm(provider)
    calls.clear()
    for i in range(20):
        result = await provider.acquire_lease(f"job-{i}", "me", 5000)
        assert result.acquired
        await provider.release_lease(f"job-{i}", "me")
    # One Txn to acquire, one to release, one round trip each (and a keep-alive on
    # the shared stream): no grant, no revoke, no read.
    assert calls == Counter(Txn=40)

    await provider.acquire_lease("baton", "a", 5000)
    calls.clear()
    assert await provider.transfer_lease("baton", "a", "b", 5000)
    await settled(provider)  # the pool's refill, in the background
    # The transfer's one write is its Txn; taking the last free lease made the pool
    # grant one more, off the transfer's path; the old lease went back to the pool.
    assert calls == Counter(Range=1, Txn=1, LeaseGrant=1)
    assert len(provider._pool.free_lease_ids()) == 2


async def test_a_losing_racer_writes_nothing_it_must_undo(
    etcd: EtcdCluster, calls: Counter[str]
) -> None:
    prefix = unique_prefix()
    async with (
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as provider,
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as other,
    ):
        await warm(provider)
        free_before = provider._pool.free_lease_ids()
        await other.acquire_lease("seat", "holder", 5000)
        calls.clear()
        lost = await provider.acquire_lease("seat", "me", 5000)
        assert not lost.acquired and lost.owner == "holder"
        # One Txn, whose compare failed: no grant before it, no revoke after it.
        assert calls == Counter(Txn=1)
        # Its lease went back to the pool, unharmed, for the next attempt.
        assert provider._pool.free_lease_ids() == free_before


async def test_renewal_writes_nothing_and_opens_no_stream_per_call(
    etcd_provider: EtcdLeaseProvider, calls: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = etcd_provider
    await warm(provider)
    await provider.acquire_lease("k", "me", 5000)
    streams = Counter[str]()
    open_stream = provider.client._open_stream

    def counting(path: str, *args: Any) -> Any:
        streams[path.rsplit("/", 1)[1]] += 1
        return open_stream(path, *args)

    monkeypatch.setattr(provider.client, "_open_stream", counting)
    calls.clear()
    for _ in range(20):
        assert await provider.renew_lease("k", "me", 5000)
    assert calls == Counter(Range=20)  # and a keep-alive each, on the shared stream
    calls.clear()
    tokens = set()
    for _ in range(20):
        # A re-acquire is a renewal too; its create attempt is the one Txn it sends.
        tokens.add((await provider.acquire_lease("k", "me", 5000)).token)
    # (Taking the pool's last free lease made it grant one ahead, in the background.)
    await settled(provider)
    assert calls == Counter(Txn=20, LeaseGrant=1) and len(tokens) == 1
    assert streams["LeaseKeepAlive"] <= 1  # the shared stream, opened once at most


async def test_a_pooled_lease_is_renewed_before_its_ttl_is_promised(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    provider = etcd_provider
    await past_one_shot(provider)
    await provider.acquire_lease("first", "me", 3000)
    await provider.release_lease("first", "me")
    (pooled,) = provider._pool.free_lease_ids()
    await asyncio.sleep(1.2)  # the free lease ages between its renewals
    result = await provider.acquire_lease("second", "me", 3000)
    kv = await provider.client.range(provider.etcd_key("second"))
    assert kv is not None and kv.lease == pooled and result.ttl_ms == 3000
    # etcd's whole seconds: a lease renewed just now reads 2 or 3 s left, never less.
    assert (await provider.client.time_to_live(pooled)).TTL >= 2


async def test_concurrent_takes_of_distinct_keys_each_get_a_lease(
    etcd_provider: EtcdLeaseProvider, calls: Counter[str]
) -> None:
    provider = etcd_provider
    await past_one_shot(provider)
    for round_ in range(3):
        calls.clear()
        results = await asyncio.gather(
            *(provider.acquire_lease(f"r{round_}-{i}", "me", 5000) for i in range(64))
        )
        assert all(result.acquired for result in results)
        kvs = await provider.client.range_prefix(provider.etcd_key(f"r{round_}-"))
        assert len({kv.lease for kv in kvs}) == 64  # one tenure per lease
        await asyncio.gather(*(provider.release_lease(f"r{round_}-{i}", "me") for i in range(64)))
        # The first round grants 64 leases; the second reuses them (and the pool
        # grants one ahead when its last free lease is taken); the third grants none.
        await settled(provider)
        assert calls["LeaseGrant"] == [64, 1, 0][round_] and calls["LeaseRevoke"] == 0


async def test_free_leases_outlive_their_ttl_while_they_wait(
    etcd_provider: EtcdLeaseProvider, calls: Counter[str]
) -> None:
    provider = etcd_provider
    await past_one_shot(provider)
    await provider.acquire_lease("k", "me", 2000)
    await provider.release_lease("k", "me")
    (free,) = provider._pool.free_lease_ids()
    await asyncio.sleep(3.5)  # past its 2 s TTL: the pool's sweep renewed it
    assert (await provider.client.time_to_live(free)).TTL > 0
    assert provider._pool.free_lease_ids() == {free}
    calls.clear()
    await provider.acquire_lease("again", "me", 2000)
    kv = await provider.client.range(provider.etcd_key("again"))
    assert kv is not None and kv.lease == free and calls["LeaseGrant"] <= 1  # (the refill)
