"""Histories of the real provider under faults, checked for linearizability (issue 19, 2).

Three processes, each with a provider of its own (endpoint lists rotated), drive
random calls on a three-member cluster, and on the same provider hold keys (``hold``,
``adopt``) and campaign in an election, every call those make recorded too, with each
holder's belief that it holds its key as a read. Meanwhile the members, leader
included, are killed, frozen and cut off from each other (partitions: needs root and
``ip``, else skipped loudly, or failed with ``ETCD_LEASES_REQUIRE_PARTITIONS=1``), and
the processes frozen past their TTLs (see ``tests/linearizability/soak.py``, which
also runs longer). Calls that fail are recorded without an answer. Early expiries
right after a leader stall are allowed where the etcd version has bug 15247, and
counted apart.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from etcd_leases import EtcdLeaseProvider, HeldLease, hold
from etcd_leases.testing import EtcdCluster
from tests.conftest import unique_prefix
from tests.linearizability.checker import check
from tests.linearizability.history import History
from tests.linearizability.recorder import RecordingHoldingProvider, claim
from tests.linearizability.report import explain
from tests.linearizability.soak import partitioned_cluster, recorded_run
from tests.test_linearizability_etcd import OWN_OWNERS

SECONDS = 14.0


@pytest.mark.timeout(180)
async def test_histories_under_faults_are_linearizable(
    etcd_binary: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with partitioned_cluster(etcd_binary) as (cluster, partitions):
        run = await recorded_run(
            cluster, etcd_binary, OWN_OWNERS, SECONDS, tmp_path, partitions=partitions, recipes=True
        )
    with capsys.disabled():  # shown even when the run passes
        print(f"\nlinearizability under faults: {run.summary()}")
        if partitions is None:
            print("!!! NO NETWORK PARTITIONS IN THIS RUN: they need root and 'ip' !!!")
    print(f"faults:\n{run.fault_times()}")
    print(explain(run.result, origin=run.began))
    kinds = {fault.kind for fault in run.faults}
    assert len(run.faults) >= 4, "each kind of fault comes once in every 4"
    assert "pause_worker" in kinds
    assert kinds & {"kill_leader", "kill_follower"} and kinds & {"pause_leader", "pause_follower"}
    assert partitions is None or kinds & {"partition_leader", "partition_follower"}
    recipes = {op.client.split(":")[0] for op in run.history.ops if "check" in op.client}
    assert recipes == {"p0", "p1", "p2"}, "every process's holders said they held"
    keys = {op.key for op in run.history.ops}
    assert {"held0", "held1", "seat"} <= keys
    assert run.result.ok is True


def remaining_without_renewals(self: HeldLease) -> float:
    """A wrong hold: the tenure counted as whole whatever became of its renewals."""
    return self.ttl_ms / 1000


@pytest.mark.parametrize("hold_is", ["right", "wrong"])
async def test_a_holder_cut_off_from_etcd_believes_nothing_the_history_refutes(
    etcd_cluster: EtcdCluster, hold_is: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holder A reaches one follower only; the follower is frozen, so A's renewals go
    unanswered, and B takes the key once A's TTL ran out. A keeps checking its lease:
    the right hold says it is lost, and the history is linearizable; a hold that skips
    the renewals' verdict says A still holds, and the checker must refuse it."""
    if hold_is == "wrong":
        monkeypatch.setattr(HeldLease, "remaining", remaining_without_renewals)
    leader = etcd_cluster.leader()
    cut = next(member for member in etcd_cluster.members if member is not leader)
    history, prefix = History(), unique_prefix()
    beliefs_after_takeover: list[bool] = []
    async with (
        EtcdLeaseProvider(
            [cut.endpoint], prefix=prefix, timeout=1.0, member_sync_interval=None
        ) as alone,
        EtcdLeaseProvider([leader.endpoint], prefix=prefix) as others,
    ):
        a = RecordingHoldingProvider(alone, history, "A")
        b = RecordingHoldingProvider(others, history, "B")
        async with hold(a, "k", "holder-a", 1000) as lease:
            assert claim(history, "A", lease)
            cut.pause()
            try:
                async with hold(b, "k", "holder-b", 1000, wait=10) as taken:
                    assert claim(history, "B", taken)
                    beliefs_after_takeover.append(claim(history, "A", lease))
                    assert claim(history, "B", taken)
            finally:
                cut.resume()
    result = check(history)
    print(explain(result, origin=history.ops[0].start))
    if hold_is == "right":
        assert beliefs_after_takeover == [False]
        assert result.ok is True
    else:
        assert beliefs_after_takeover == [True]
        assert result.ok is False
        assert "[A:check] get_lease_owner() -> 'holder-a'" in explain(result)
