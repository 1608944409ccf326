"""etcd's database full (NOSPACE alarm): writes refused with a clear error, tenures kept.

etcd then refuses every write that takes space (a lease grant, a put) but still answers
keep-alives, until an operator compacts, defragments and disarms the alarm. A release
(a transaction that only deletes) gets through on 3.4; 3.5.1 now and then refuses it
too, and the key then stays its holder's until the holder releases it again.
"""

from __future__ import annotations

import asyncio

import pytest

from etcd_leases import BackendError, BackendFull, EtcdLeaseProvider
from etcd_leases.testing import EtcdCluster, EtcdctlError, etcd_version

QUOTA = 2 * 1024 * 1024


def fill(cluster: EtcdCluster) -> None:
    """Put big values until etcd refuses one for want of space."""
    value = "x" * 100_000  # under Linux's 128 KiB limit on one argument
    for i in range(4 * QUOTA // len(value)):
        try:
            cluster.etcdctl("put", f"filler/{i}", value)
        except EtcdctlError as exc:
            assert "database space exceeded" in exc.stderr
            return
    raise AssertionError("etcd never ran out of space")


async def test_a_full_database_refuses_writes_clearly_and_keeps_tenures(etcd_binary: str) -> None:
    args = [f"--quota-backend-bytes={QUOTA}"]
    with EtcdCluster(1, binary=etcd_binary, extra_args=args) as cluster:
        async with EtcdLeaseProvider(cluster.endpoints, timeout=2.0) as provider:
            try:
                async with provider.hold("held", "alice", 1000) as lease:
                    await asyncio.to_thread(fill, cluster)
                    with pytest.raises(BackendFull, match="database is full") as refused:
                        await provider.acquire_lease("other", "bob", 1000)
                    assert isinstance(refused.value, BackendError)  # what callers caught before
                    with pytest.raises(BackendFull):
                        await lease.put("held/state", "1")
                    await asyncio.sleep(2.0)  # twice the TTL: only answered keep-alives keep it
                    assert not lease.lost.is_set() and lease.remaining() > 0
                    assert await provider.get_lease_owner("held") == "alice"
                released = True
            except BackendFull:
                # etcd 3.5.1 now and then refuses even a transaction that only deletes.
                assert not etcd_version(etcd_binary).startswith("3.4.")
                released = False
            assert await provider.get_lease_owner("held") == (None if released else "alice")

            cluster.etcdctl("del", "--prefix", "filler/")
            cluster.compact()
            cluster.members[0].defragment()
            cluster.disarm_alarms()
            await provider.release_lease("held", "alice")
            assert await provider.get_lease_owner("held") is None
            assert (await provider.acquire_lease("other", "bob", 1000)).acquired
