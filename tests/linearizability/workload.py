"""Random calls of the five methods by concurrent tasks, recorded for the checker.

Busy tasks call on a few keys back to back; sparse tasks call on a key of their own
now and then, slower than its TTLs, so that tenures expire and are taken afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from etcd_leases import LeaseError, LeaseProvider
from tests.linearizability.history import Call, CallName, History
from tests.linearizability.recorder import RecordingProvider, send

BUSY_KEYS = ["k0", "k1"]
TTLS_MS = [1000, 2000]
BUSY = (0.0, 0.005)  # s between a busy task's calls
SPARSE = (0.3, 1.5)  # s between a sparse task's calls: slower than the TTLs
NAMES: list[CallName] = ["acquire", "get_owner", "release", "renew", "transfer"]
WEIGHTS = [30, 25, 10, 20, 15]


@dataclass(frozen=True)
class Task:
    """Calls on ``keys`` as ``owners`` (transfers go to them too), ``pause`` s apart."""

    keys: Sequence[str]
    owners: Sequence[str]
    ttls_ms: Sequence[int]
    pause: tuple[float, float]


def standard_tasks(owners: Sequence[str], index: int) -> list[Task]:
    """Three busy tasks on the shared keys, one sparse task on a key of client ``index``."""
    busy = Task(BUSY_KEYS, owners, TTLS_MS, BUSY)
    return [busy, busy, busy, Task([f"sparse{index}"], owners, TTLS_MS, SPARSE)]


def random_call(rng: random.Random, task: Task) -> Call:
    name = rng.choices(NAMES, WEIGHTS)[0]
    owner, ttl_ms = rng.choice(task.owners), rng.choice(task.ttls_ms)
    if name == "get_owner":
        return Call("get_owner")
    if name == "release":
        return Call("release", owner)
    if name == "transfer":
        return Call("transfer", owner, ttl_ms, rng.choice(task.owners))
    return Call(name, owner, ttl_ms)


async def _run(provider: LeaseProvider, task: Task, until: float, seed: str) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        # Recorded without an answer; the checker lets it have landed or not.
        with contextlib.suppress(LeaseError):
            await send(provider, rng.choice(task.keys), random_call(rng, task))
        await asyncio.sleep(rng.uniform(*task.pause))


async def drive(
    clients: Mapping[str, tuple[LeaseProvider, Sequence[Task]]],
    until: float,
    seed: int = 0,
    history: History | None = None,
) -> History:
    """Run each client's tasks through its provider until ``until`` (monotonic time);
    every call recorded under the client's name (into ``history``, if given)."""
    history = History() if history is None else history
    async with asyncio.TaskGroup() as group:
        for name, (provider, tasks) in clients.items():
            recorded = RecordingProvider(provider, history, name)
            for number, task in enumerate(tasks):
                group.create_task(_run(recorded, task, until, f"{seed}/{name}/{number}"))
    return history
