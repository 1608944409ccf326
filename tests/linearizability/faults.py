"""Faults for a recorded run: members of the cluster killed, frozen and cut off from
each other (leader included), and the recording processes frozen past their TTLs.

One fault at a time, each kind in turn (in a shuffled order each round; the leader
or a follower, at random), each recorded with when it began and when it healed.
Partitions reuse the chaos suite's network namespaces
(:class:`tests.chaos.partitions.Partitions`). Freezing the leader or cutting it off
is what triggers etcd bug 15247 (the stalled leader, resumed, revokes leases early):
:func:`stall_spans` gives the spans in which the checker may allow it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from etcd_leases.testing import EtcdCluster, EtcdMember
from tests.chaos.partitions import Partitions

#: How long after a stalled leader resumes it may still revoke leases early.
BUG_15247_SPAN = 5.0
#: Leader faults after which etcd bug 15247 may strike.
LEADER_STALLS = ("pause_leader", "partition_leader")
#: How long a worker is frozen beyond ``worker_ttl``: its tenures are taken meanwhile.
PAST_TTL = (0.5, 1.0)


@dataclass(frozen=True)
class Fault:
    kind: str
    member: str
    start: float
    heal: float


class Nemesis:
    """Faults one after another on ``cluster`` (blocking calls, run in a thread); with
    ``partitions`` (the cluster's members in its namespaces) partitions too, with
    ``workers`` (pids) workers frozen for ``worker_ttl`` s and a little more."""

    def __init__(
        self,
        cluster: EtcdCluster,
        seed: int,
        partitions: Partitions | None = None,
        workers: Sequence[int] = (),
        worker_ttl: float = 2.0,
    ) -> None:
        self.cluster = cluster
        self.random = random.Random(seed)
        self.partitions = partitions
        self.workers = list(workers)
        self.worker_ttl = worker_ttl
        self.faults: list[Fault] = []
        self.kinds: list[Callable[[], Fault]] = [self.kill, self.pause]
        if partitions is not None:
            self.kinds.append(self.partition)
        if self.workers:
            self.kinds.append(self.pause_worker)

    async def run(self, until: float) -> None:
        order: list[Callable[[], Fault]] = []
        try:
            while time.monotonic() < until:
                if not order:
                    order = self.random.sample(self.kinds, len(self.kinds))
                self.faults.append(await asyncio.to_thread(order.pop()))
                await asyncio.sleep(self.random.uniform(0.3, 0.8))
        finally:
            await asyncio.to_thread(self.heal_all)

    def _member(self) -> tuple[str, EtcdMember]:
        """The leader or a follower, at random, and which it is."""
        leader = self.cluster.leader(timeout=20)
        if self.random.random() < 0.5:
            return "leader", leader
        return "follower", self.random.choice([m for m in self.cluster.members if m is not leader])

    def _kill(self, kind: str, member: EtcdMember) -> Fault:
        start = time.monotonic()
        member.kill()
        time.sleep(self.random.uniform(0.5, 1.5))
        member.start()
        return Fault(kind, member.name, start, time.monotonic())

    def _pause(self, kind: str, member: EtcdMember) -> Fault:
        start = time.monotonic()
        member.pause()
        try:
            time.sleep(self.random.uniform(0.5, 2.0))
        finally:
            member.resume()
        return Fault(kind, member.name, start, time.monotonic())

    def _partition(self, kind: str, member: EtcdMember) -> Fault:
        """Cut ``member`` off from the other members (clients still reach every member)."""
        assert self.partitions is not None
        start = time.monotonic()
        self.partitions.isolate(self.cluster.members.index(member))
        try:
            time.sleep(self.random.uniform(1.0, 2.5))
        finally:
            self.partitions.heal()
        return Fault(kind, member.name, start, time.monotonic())

    def kill(self) -> Fault:
        role, member = self._member()
        return self._kill(f"kill_{role}", member)

    def pause(self) -> Fault:
        role, member = self._member()
        return self._pause(f"pause_{role}", member)

    def partition(self) -> Fault:
        role, member = self._member()
        return self._partition(f"partition_{role}", member)

    def pause_worker(self) -> Fault:
        """SIGSTOP a recording process past its TTLs: it wakes believing nothing happened."""
        pid, start = self.random.choice(self.workers), time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(self.worker_ttl + self.random.uniform(*PAST_TTL))
        finally:
            os.kill(pid, signal.SIGCONT)
        return Fault("pause_worker", str(pid), start, time.monotonic())

    def heal_all(self) -> None:
        """Leave every member running and joined, every worker going (a fault cut short
        by an error included)."""
        for member in self.cluster.members:
            if member.paused:
                member.resume()
            if not member.running:
                member.start()
        if self.partitions is not None:
            self.partitions.heal()
        for pid in self.workers:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.kill(pid, signal.SIGCONT)


def stall_spans(faults: list[Fault]) -> list[tuple[float, float]]:
    """When etcd bug 15247 may end tenures early: after each leader stall, for a while."""
    return [(f.heal, f.heal + BUG_15247_SPAN) for f in faults if f.kind in LEADER_STALLS]
