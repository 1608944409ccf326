"""Issue 17: the serverless one-shot, and the long-lived worker, in raft writes.

A fresh process that takes one key and frees it costs etcd three raft writes (grant,
put-if-absent, revoke: the revoke deletes the key it carries) and leaves no lease
behind; a long-lived worker still costs one write per acquire and one per release.
Writes are counted by etcd itself (``etcd_server_proposals_committed_total``), on an
etcd of the test's own so that nobody else's writes are counted. The timings are in
``benchmarks/oneshot.py``; these tests count only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from benchmarks.bench.etcd_metrics import EtcdMetrics
from etcd_leases import EtcdLeaseProvider
from etcd_leases.testing import EtcdCluster
from tests.conftest import past_one_shot, settled

ONE_SHOT = """
import asyncio, sys
from etcd_leases import EtcdLeaseProvider

async def main():
    async with EtcdLeaseProvider(sys.argv[1]) as provider:
        assert (await provider.acquire_lease("job", "one-shot", 15_000)).acquired
        await provider.release_lease("job", "one-shot")

asyncio.run(main())
"""

# What ``from etcd_leases import EtcdLeaseProvider`` must not load: the one-shot uses none.
NOT_FOR_THE_ONE_SHOT = (
    "etcd_leases.cli",
    "etcd_leases.election",
    "etcd_leases.etcd.dead_letters",
    "etcd_leases.etcd.inbox",
    "etcd_leases.inbox",
    "etcd_leases.memory",
    "etcd_leases.memory_inbox",
    "etcd_leases.memory_provider",
    "etcd_leases.metrics",
    "etcd_leases.sync",
    "etcd_leases.threads",
    "prometheus_client",
)


class Writes:
    """etcd's count of committed raft proposals, read over HTTP."""

    def __init__(self, cluster: EtcdCluster) -> None:
        self._metrics = EtcdMetrics(cluster.endpoint_string.split(",")[0])

    def now(self) -> float:
        counts = self._metrics.sample()
        assert counts is not None, f"etcd's metrics are not readable at {self._metrics.url}"
        return counts.raft_writes

    def settled(self, quiet_s: float = 0.3, timeout: float = 30.0) -> float:
        """The count once no write has come for ``quiet_s``: etcd updates it after the
        client has its answer, and writes on its own as it starts (cluster version,
        member attributes)."""
        deadline = time.monotonic() + timeout
        last, since = self.now(), time.monotonic()
        while time.monotonic() - since < quiet_s:
            assert time.monotonic() < deadline, "etcd kept writing on its own"
            time.sleep(0.05)
            if (current := self.now()) != last:
                last, since = current, time.monotonic()
        return last


@pytest.fixture
def quiet_etcd(etcd_binary: str) -> Iterator[EtcdCluster]:
    """An etcd of this test's own, whose start-up writes are over."""
    with EtcdCluster(1, binary=etcd_binary) as cluster:
        Writes(cluster).settled(quiet_s=1.0)
        yield cluster


def test_a_one_shot_process_makes_three_raft_writes_and_leaves_no_lease(
    quiet_etcd: EtcdCluster,
) -> None:
    writes = Writes(quiet_etcd)
    before = writes.settled()
    subprocess.run(
        [sys.executable, "-c", ONE_SHOT, quiet_etcd.endpoint_string], check=True, timeout=60
    )
    assert writes.settled() - before == 3  # grant, put-if-absent, revoke (which deleted the key)
    assert quiet_etcd.etcdctl("lease", "list").strip() == "found 0 leases"
    assert quiet_etcd.etcdctl("get", "--prefix", "/etcd-leases/").strip() == ""


async def test_a_long_lived_worker_writes_once_per_acquire_and_per_release(
    quiet_etcd: EtcdCluster,
) -> None:
    writes = Writes(quiet_etcd)
    async with EtcdLeaseProvider(quiet_etcd.endpoints) as provider:
        before = writes.settled()
        await past_one_shot(provider)
        assert writes.settled() - before == 3  # its first release revoked its lease
        for _ in range(2):  # the pool keeps leases from here on: one ahead, one back
            await provider.acquire_lease("warm", "worker", 5000)
            await provider.release_lease("warm", "worker")
        await settled(provider)
        before = writes.settled()
        for i in range(20):
            assert (await provider.acquire_lease(f"job-{i}", "worker", 5000)).acquired
            await provider.release_lease(f"job-{i}", "worker")
        await settled(provider)
        assert writes.settled() - before == 40
        free = provider._pool.free_lease_ids()
        assert free
    # Closing revokes the free leases the worker kept, and nothing else is left.
    assert quiet_etcd.etcdctl("lease", "list").strip() == "found 0 leases"


@pytest.mark.parametrize("old_lease_revoked", [True, False])
async def test_a_one_shot_release_frees_the_owner_whose_tenure_moved_to_another_lease(
    quiet_etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch, old_lease_revoked: bool
) -> None:
    """The release revokes the lease its acquire put the key on; another process moved
    the same owner's tenure to a lease of its own (another TTL) meanwhile, and revoked
    the old lease or not yet: the key is released all the same, as a release by that
    owner must."""
    async with (
        EtcdLeaseProvider(quiet_etcd.endpoints) as one_shot,
        EtcdLeaseProvider(quiet_etcd.endpoints) as other,
    ):
        assert (await one_shot.acquire_lease("job", "owner", 5000)).acquired
        old = (await one_shot.client.range(one_shot.etcd_key("job"))).lease  # type: ignore[union-attr]
        if not old_lease_revoked:

            async def not_yet(lease_id: int) -> None:
                pass

            monkeypatch.setattr(other.client, "revoke_quietly", not_yet)
        assert await other.renew_lease("job", "owner", 8000)  # onto a lease of its own
        await settled(other)
        old_alive = (await one_shot.client.time_to_live(old)).TTL > 0
        assert old_alive is not old_lease_revoked
        await one_shot.release_lease("job", "owner")
        assert await one_shot.get_lease_owner("job") is None


def test_importing_the_provider_loads_nothing_the_one_shot_does_not_use() -> None:
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys\n"
            "import etcd_leases\n"
            "bare = sorted(m for m in sys.modules if m.startswith('etcd_leases'))\n"
            "from etcd_leases import EtcdLeaseProvider\n"
            "print(json.dumps([bare, sorted(sys.modules)]))",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    bare, modules = json.loads(loaded.stdout)
    assert bare == ["etcd_leases"]  # the package alone: every name is imported on use
    assert "etcd_leases.etcd.provider" in modules
    assert [m for m in modules if m.startswith(NOT_FOR_THE_ONE_SHOT)] == []


def test_every_public_name_is_importable_from_the_package() -> None:
    import etcd_leases

    for name in etcd_leases.__all__:
        assert getattr(etcd_leases, name) is not None
        assert name in dir(etcd_leases)
    from etcd_leases.hold import HeldLease  # the module ``hold`` is loaded: still the function

    assert etcd_leases.hold.__name__ == "hold" and HeldLease is etcd_leases.HeldLease
    with pytest.raises(AttributeError):
        etcd_leases.NoSuchName  # type: ignore[attr-defined]  # noqa: B018
