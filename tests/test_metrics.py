"""MeteredProvider: the recipes run on it unchanged, and it counts what happened."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from etcd_leases import (
    Election,
    EtcdLeaseProvider,
    HeldLease,
    HoldingProvider,
    PermissionDenied,
    ProviderClosed,
    __version__,
)
from etcd_leases.metrics import LeaseMetrics, MeteredProvider
from etcd_leases.testing import EtcdCluster
from tests.conftest import Live, enable_auth, eventually, unique_prefix


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sample's value; a metric that is not there fails (it is not a zero)."""
    found = registry.get_sample_value(name, labels)
    assert found is not None, f"no sample {name}{labels or ''} in the registry"
    return found


async def counted(registry: CollectorRegistry, name: str, expected: float) -> None:
    """Wait until ``name`` reads ``expected``: the keeper counts a loss in its own
    task, after ``lost`` is set."""
    await eventually(lambda: value(registry, name) == expected, f"{name} == {expected}")


async def test_hold_adopt_and_election_run_on_a_metered_provider(live: Live) -> None:
    registry = CollectorRegistry()
    metered = MeteredProvider(live.provider, LeaseMetrics(registry))
    assert isinstance(metered, HoldingProvider)

    async with metered.hold("job", "alice", 5000) as lease:
        assert value(registry, "etcd_leases_leases_held") == 1
        await lease.transfer("bob")
    async with metered.adopt("job", "bob", 5000):
        assert value(registry, "etcd_leases_leases_held") == 1
    assert value(registry, "etcd_leases_leases_held") == 0
    assert value(registry, "etcd_leases_leases_lost_total") == 0  # all ended by their holders

    election = Election(metered, "leader", "alice", 5000)
    async with election.leadership() as seat:
        assert await metered.get_lease_owner("leader") == "alice"
        assert seat.token > 0
    assert await Election(metered, "leader", "bob", 5000).leader() is None

    calls = "etcd_leases_calls_total"
    assert value(registry, calls, call="acquire", outcome="acquired") == 3  # hold, adopt, seat
    assert value(registry, calls, call="transfer", outcome="true") == 1
    assert value(registry, calls, call="renew", outcome="true") == 1  # adopt's
    assert value(registry, "etcd_leases_call_duration_seconds_count", call="acquire") == 3

    held = await live.another().acquire_lease("other", "zed", 5000)
    assert held.acquired
    assert not (await metered.acquire_lease("other", "alice", 5000)).acquired
    assert value(registry, calls, call="acquire", outcome="held") == 1


async def test_a_key_deleted_from_outside_counts_as_lost(etcd: EtcdCluster) -> None:
    registry = CollectorRegistry()
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        metered = MeteredProvider(provider, LeaseMetrics(registry))
        async with metered.hold("job", "alice", 10_000) as lease:
            etcd.etcdctl("del", provider.etcd_key("job").decode())
            await asyncio.wait_for(lease.lost.wait(), 5)
            await counted(registry, "etcd_leases_leases_lost_total", 1)
            assert value(registry, "etcd_leases_leases_held") == 0
            assert value(registry, "etcd_leases_renewals_failed_total") == 0


async def test_a_frozen_etcd_counts_as_a_failed_renewal(etcd_binary: str) -> None:
    registry = CollectorRegistry()
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        async with EtcdLeaseProvider(etcd.endpoints, timeout=1.0) as provider:
            metered = MeteredProvider(provider, LeaseMetrics(registry))
            async with metered.hold("job", "alice", 1000) as lease:
                etcd.members[0].pause()
                try:
                    await asyncio.wait_for(lease.lost.wait(), 5)
                finally:
                    etcd.members[0].resume()
                await counted(registry, "etcd_leases_leases_lost_total", 1)
                assert value(registry, "etcd_leases_renewals_failed_total") == 1


async def test_errors_are_counted_by_kind(etcd: EtcdCluster) -> None:
    registry = CollectorRegistry()
    provider = EtcdLeaseProvider(etcd.endpoints)
    await provider.close()
    metered = MeteredProvider(provider, LeaseMetrics(registry))
    with pytest.raises(ProviderClosed):
        await metered.get_lease_owner("k")
    calls = "etcd_leases_calls_total"
    assert value(registry, calls, call="get_owner", outcome="ProviderClosed") == 1


async def test_the_leader_gauge_set_from_election_run_follows_the_seat(live: Live) -> None:
    """The documented recipe: set_leading from run's callbacks; the exported gauge reads
    1 while this process leads, 0 once run reports the term over (the seat taken)."""
    registry = CollectorRegistry()
    metrics = LeaseMetrics(registry)
    terms: asyncio.Queue[int] = asyncio.Queue()

    async def lead(lease: HeldLease) -> None:
        metrics.set_leading("reports", True)
        terms.put_nowait(lease.token)
        await asyncio.Event().wait()

    election = Election(live.provider, "reports", "alice", 5000)
    stop = asyncio.Event()
    runner = asyncio.create_task(
        election.run(lead, lambda: metrics.set_leading("reports", False), stop=stop)
    )
    try:
        first = await asyncio.wait_for(terms.get(), 5)
        assert value(registry, "etcd_leases_leader", election="reports") == 1
        other = live.another()
        assert await other.transfer_lease("reports", "alice", "mallory", 60_000)
        await eventually(
            lambda: value(registry, "etcd_leases_leader", election="reports") == 0,
            "the gauge reads 0 once the seat is taken",
        )
        await other.release_lease("reports", "mallory")
        assert await asyncio.wait_for(terms.get(), 5) > first
        assert value(registry, "etcd_leases_leader", election="reports") == 1
        stop.set()
        await asyncio.wait_for(runner, 5)
        assert value(registry, "etcd_leases_leader", election="reports") == 0
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def test_build_info_keepalive_round_trips_and_etcd_reachability(etcd_binary: str) -> None:
    registry = CollectorRegistry()
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        async with EtcdLeaseProvider(etcd.endpoints, timeout=1.0) as provider:
            metered = MeteredProvider(provider, LeaseMetrics(registry))
            assert value(registry, "etcd_leases_build_info", version=__version__) == 1
            assert value(registry, "etcd_leases_etcd_reachable") == 0  # nothing answered yet
            round_trips = "etcd_leases_keepalive_round_trip_seconds_count"
            started = time.monotonic()
            async with metered.hold("job", "alice", 3000):  # renewed every second
                assert value(registry, "etcd_leases_etcd_reachable") == 1
                await eventually(lambda: value(registry, round_trips) >= 2, "two keep-alives")
            # Read together (no await between): each round trip began after `started`.
            total = value(registry, "etcd_leases_keepalive_round_trip_seconds_sum")
            count = value(registry, round_trips)
            assert 0 < total <= count * (time.monotonic() - started)

            etcd.members[0].pause()
            try:
                assert not await metered.etcd_answers("job", timeout=1.0)
                assert value(registry, "etcd_leases_etcd_reachable") == 0
            finally:
                etcd.members[0].resume()
            assert await metered.etcd_answers("job", timeout=10.0)
            assert value(registry, "etcd_leases_etcd_reachable") == 1


async def test_a_refused_read_still_shows_etcd_reachable(etcd_binary: str) -> None:
    """etcd that answers "permission denied" is reachable: readiness is about etcd
    answering, not about this user's rights."""
    registry = CollectorRegistry()
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        enable_auth(etcd)
        async with EtcdLeaseProvider(
            etcd.endpoints, username="app", password="apppw", prefix="/forbidden/"
        ) as provider:
            metered = MeteredProvider(provider, LeaseMetrics(registry))
            with pytest.raises(PermissionDenied):
                await provider.get_lease_owner("job")
            assert await metered.etcd_answers("job", timeout=10.0)
            assert value(registry, "etcd_leases_etcd_reachable") == 1
