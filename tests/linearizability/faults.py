"""Faults for a recorded run: members of the cluster killed and frozen, leader included.

One fault at a time, each recorded with when it began and when it healed. Freezing
the leader is what triggers etcd bug 15247 (the stalled leader, resumed, revokes
leases early): :func:`stall_spans` gives the spans in which the checker may allow it.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from etcd_leases.testing import EtcdCluster, EtcdMember

#: How long after a stalled leader resumes it may still revoke leases early.
BUG_15247_SPAN = 5.0


@dataclass(frozen=True)
class Fault:
    kind: str
    member: str
    start: float
    heal: float


class Nemesis:
    """Faults one after another on ``cluster`` (blocking calls, run in a thread)."""

    def __init__(self, cluster: EtcdCluster, seed: int) -> None:
        self.cluster = cluster
        self.random = random.Random(seed)
        self.faults: list[Fault] = []

    async def run(self, until: float) -> None:
        kinds = [self.kill_leader, self.kill_follower, self.pause_leader, self.pause_follower]
        try:
            while time.monotonic() < until:
                self.faults.append(await asyncio.to_thread(self.random.choice(kinds)))
                await asyncio.sleep(self.random.uniform(0.3, 0.8))
        finally:
            await asyncio.to_thread(self.heal_all)

    def _leader(self) -> EtcdMember:
        return self.cluster.leader(timeout=20)

    def _follower(self) -> EtcdMember:
        leader = self._leader()
        return self.random.choice([m for m in self.cluster.members if m is not leader])

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

    def kill_leader(self) -> Fault:
        return self._kill("kill_leader", self._leader())

    def kill_follower(self) -> Fault:
        return self._kill("kill_follower", self._follower())

    def pause_leader(self) -> Fault:
        return self._pause("pause_leader", self._leader())

    def pause_follower(self) -> Fault:
        return self._pause("pause_follower", self._follower())

    def heal_all(self) -> None:
        """Leave every member running (a fault cut short by an error included)."""
        for member in self.cluster.members:
            if member.paused:
                member.resume()
            if not member.running:
                member.start()


def stall_spans(faults: list[Fault]) -> list[tuple[float, float]]:
    """When etcd bug 15247 may end tenures early: after each leader stall, for a while."""
    return [(f.heal, f.heal + BUG_15247_SPAN) for f in faults if f.kind == "pause_leader"]
