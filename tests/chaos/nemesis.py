"""The nemesis: faults injected into a running cluster and its workers, one at a time:
crashes, stalls and partitions here, an operator's maintenance in operations.py.

Each fault is recorded with the time it began and the time it healed (the moment
the cluster or worker was whole again), for the checker's recovery figures and to
tell etcd bug 15247's early deletions (after a leader stall) from ours.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

from etcd_leases.testing import EtcdCluster, EtcdMember
from tests.chaos.fault import Fault, fault
from tests.chaos.operations import Operations
from tests.chaos.partitions import Partitions

# Seconds after a leader stall's heal by which the stalled leader's revokes have counted.
EXPIRY_COUNTED_BY = 3.0


class Nemesis:
    def __init__(
        self,
        cluster: EtcdCluster,
        workers: Sequence[subprocess.Popen[bytes]],
        ttl_ms: int,
        partitions: Partitions | None,
        quota_bytes: int,
        seed: int,
    ) -> None:
        self.cluster = cluster
        self.workers = workers
        self.ttl = ttl_ms / 1000
        self.partitions = partitions
        self.random = random.Random(seed)
        self.faults: list[Fault] = []
        operations = Operations(cluster, workers, quota_bytes, self.random)
        kinds: list[Callable[[], Fault]] = [
            self.kill_leader,
            self.pause_leader,
            self.pause_follower,
            self.pause_worker,
            operations.quota_full,
            operations.compact_lagging,
            operations.defrag,
            operations.rolling_restart,
            operations.move_leader,
            operations.replace_member,
        ]
        if partitions is not None:
            kinds += [self.partition_leader, self.partition_follower]
        self.kinds = kinds

    def run(self, seconds: float, min_faults: int) -> None:
        """Inject faults until ``seconds`` passed and ``min_faults`` were made (at most 2x).

        Every kind comes once in each round of ``len(self.kinds)`` faults."""
        began = time.monotonic()
        order: list[Callable[[], Fault]] = []
        while True:
            elapsed = time.monotonic() - began
            if elapsed >= 2 * seconds or (elapsed >= seconds and len(self.faults) >= min_faults):
                return
            if not order:  # every kind in turn, in a shuffled order
                order = self.random.sample(self.kinds, len(self.kinds))
            self.faults.append(order.pop()())
            time.sleep(self.random.uniform(0.3, 0.8))

    def _leader(self) -> EtcdMember:
        return self.cluster.leader(timeout=20)

    def _follower(self) -> EtcdMember:
        leader = self._leader()
        return self.random.choice([m for m in self.cluster.members if m is not leader])

    def kill_leader(self) -> Fault:
        member, start = self._leader(), time.monotonic()
        member.kill()
        time.sleep(self.random.uniform(0.5, 1.5))
        member.start()
        return fault("kill_leader", start, member.name)

    def _pause(self, kind: str, member: EtcdMember, low: float, high: float) -> Fault:
        start = time.monotonic()
        member.pause()
        try:
            time.sleep(self.random.uniform(low, high))
        finally:
            member.resume()
        return fault(kind, start, member.name)

    def pause_leader(self) -> Fault:
        leader = self._leader()
        return self._counting_expiries(
            leader, lambda: self._pause("pause_leader", leader, 1.0, 3.0)
        )

    @staticmethod
    def _expired(member: EtcdMember) -> int | None:
        for _ in range(2):  # a member just resumed may be slow to answer
            try:
                return member.leases_expired()
            except (OSError, RuntimeError):
                continue
        return None

    def _counting_expiries(self, leader: EtcdMember, stall: Callable[[], Fault]) -> Fault:
        """Run a leader stall; note how many leases the stalled leader itself revoked
        as expired (etcd bug 15247 is only ever the stalled leader's revoke).

        Its revoke counts once the member has caught up with the log and applied it:
        a second after the heal as a rule, later on a loaded machine, so a count still
        zero then is read again (``EXPIRY_COUNTED_BY`` after the heal at the latest).
        """
        before = self._expired(leader)
        made = stall()
        for after_heal in (1.0, EXPIRY_COUNTED_BY):
            time.sleep(max(0.0, made["heal"] + after_heal - time.monotonic()))
            after = self._expired(leader)
            made["expired"] = after - before if before is not None and after is not None else None
            made["expired_read_after_heal"] = after_heal
            if made["expired"]:
                break
        return made

    def pause_follower(self) -> Fault:
        return self._pause("pause_follower", self._follower(), 1.0, 2.5)

    def pause_worker(self) -> Fault:
        """Freeze a worker past its TTL: it wakes up believing nothing happened."""
        worker, start = self.random.choice(list(self.workers)), time.monotonic()
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            time.sleep(self.ttl + self.random.uniform(0.5, 1.5))
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        return fault("pause_worker", start, str(worker.pid))

    def _partition(self, kind: str, member: EtcdMember) -> Fault:
        """Cut ``member`` off from the other members (clients still reach every member)."""
        assert self.partitions is not None
        start = time.monotonic()
        self.partitions.isolate(self.cluster.members.index(member))
        try:
            time.sleep(self.random.uniform(1.0, 3.0))
        finally:
            self.partitions.heal()
        return fault(kind, start, member.name)

    def partition_leader(self) -> Fault:
        leader = self._leader()
        return self._counting_expiries(leader, lambda: self._partition("partition_leader", leader))

    def partition_follower(self) -> Fault:
        return self._partition("partition_follower", self._follower())

    def resume_all(self) -> None:
        """Undo any fault left half done (called when the run ends, whatever happened)."""
        for member in self.cluster.members:
            if member.paused:
                member.resume()
            elif not member.running:  # a fault failed half way through a restart
                member.start()
        for worker in self.workers:
            if worker.poll() is None:
                os.kill(worker.pid, signal.SIGCONT)
        if self.partitions is not None:
            self.partitions.heal()
