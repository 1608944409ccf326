"""The operator's actions the nemesis takes, against a real cluster."""

from __future__ import annotations

import random

from etcd_leases.testing import EtcdCluster
from tests.chaos.operations import Operations

QUOTA_BYTES = 16 * 1024 * 1024


def test_a_member_replaced_after_a_full_backend_leaves_the_cluster_writable(
    etcd_binary: str,
) -> None:
    """The replacement replays the log, the filler of a full backend included, and would
    keep the space the others freed (about 13 MiB of a 16 MiB quota here) until its next
    writes raised NOSPACE for the whole cluster: the operator defragments it."""
    args = [f"--quota-backend-bytes={QUOTA_BYTES}"]
    with EtcdCluster(3, binary=etcd_binary, extra_args=args) as cluster:
        operations = Operations(cluster, [], QUOTA_BYTES, random.Random(1))
        full = operations.quota_full()
        assert full["alarms"] and cluster.alarms() == []
        replaced = operations.replace_member()
        replacement = next(m for m in cluster.members if m.name == replaced["replacement"])
        assert replacement.db_size() < QUOTA_BYTES // 8
        assert cluster.alarms() == []
        cluster.etcdctl("put", "after", "the replacement")
