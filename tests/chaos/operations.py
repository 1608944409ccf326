"""The faults operators meet, as nemesis actions: a full backend, compaction past lagging
watches, defragmentation, a rolling restart, a leader moved, a member replaced on a new
address (see nemesis.py)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Sequence

from etcd_leases.testing import EtcdCluster, EtcdctlError, EtcdMember
from tests.chaos import quota
from tests.chaos.fault import Fault, fault


class Operations:
    def __init__(
        self,
        cluster: EtcdCluster,
        workers: Sequence[subprocess.Popen[bytes]],
        quota_bytes: int,
        rng: random.Random,
    ) -> None:
        self.cluster = cluster
        self.workers = workers
        self.quota_bytes = quota_bytes
        self.random = rng

    def _follower(self) -> EtcdMember:
        leader = self.cluster.leader(timeout=20)
        return self.random.choice([m for m in self.cluster.members if m is not leader])

    def quota_full(self) -> Fault:
        """Fill the backend until NOSPACE; let the workers meet it; then recover."""
        start = time.monotonic()
        filled = quota.fill(self.cluster, self.quota_bytes)
        alarms = self.cluster.alarms()
        time.sleep(self.random.uniform(1.5, 3.0))  # acquires refused, keep-alives answered
        quota.recover(self.cluster)
        return fault("quota_full", start, "cluster", filled=filled, alarms=alarms)

    def compact_lagging(self) -> Fault:
        """Compact to the current revision while a worker is frozen and a follower down:
        the watches that were on that follower resume from history etcd no longer has."""
        worker, follower = self.random.choice(list(self.workers)), self._follower()
        start = time.monotonic()
        os.kill(worker.pid, signal.SIGSTOP)  # for less than a TTL: it must lose nothing
        follower.kill()
        try:
            time.sleep(self.random.uniform(0.3, 0.8))  # the others write on meanwhile
            revision = self.cluster.compact()
        finally:
            os.kill(worker.pid, signal.SIGCONT)
            follower.start()
        return fault("compact_lagging", start, follower.name, revision=revision, worker=worker.pid)

    def defrag(self) -> Fault:
        """Defragment one member (the leader now and then): it serves nothing meanwhile."""
        member, start = self.random.choice(self.cluster.members), time.monotonic()
        member.defragment()
        return fault("defrag", start, member.name)

    def rolling_restart(self) -> Fault:
        """Restart every member in turn, each stopped gracefully, as an upgrade does."""
        start = time.monotonic()
        for member in self.random.sample(self.cluster.members, len(self.cluster.members)):
            member.stop()
            member.start()
        self.cluster.leader(timeout=20)
        return fault("rolling_restart", start, "cluster")

    def move_leader(self) -> Fault:
        start = time.monotonic()
        for _ in range(3):  # an election in between makes the old leader refuse: again
            target = self._follower()
            try:
                self.cluster.move_leader(target)
                break
            except EtcdctlError:
                continue
        else:
            raise RuntimeError("etcd refused to move its leader three times")
        self.cluster.leader(timeout=20)
        return fault("move_leader", start, target.name)

    def replace_member(self) -> Fault:
        """Replace a member by a new one on a new address; the workers were given the old
        addresses and must find the new one in etcd's member list."""
        member, start = self.random.choice(self.cluster.members), time.monotonic()
        replacement = self.cluster.replace_member(member)
        self.cluster.leader(timeout=20)
        # It caught up by replaying the log, a quota_full's filler included: its backend
        # keeps the space the others freed, and the next writes would raise NOSPACE for
        # the whole cluster. The operator defragments it and disarms what it raised.
        replacement.defragment()
        alarms = self.cluster.alarms()
        self.cluster.disarm_alarms()
        return fault(
            "replace_member", start, member.name, replacement=replacement.name,
            endpoint=replacement.endpoint, alarms=alarms,
        )  # fmt: skip
