"""Random calls of the five methods by concurrent tasks, recorded for the checker.

Busy tasks call on a few keys back to back; sparse tasks call on a key of their own
now and then, slower than its TTLs, so that tenures expire and are taken afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from etcd_leases import LeaseError, LeaseProvider
from tests.linearizability.history import Call, CallName, History
from tests.linearizability.recorder import RecordingProvider, send

NAMES: list[CallName] = ["acquire", "get_owner", "release", "renew", "transfer"]
WEIGHTS = [30, 25, 10, 20, 15]


@dataclass(frozen=True)
class Task:
    """Calls on ``keys`` as ``owners`` (transfers go to them too), ``pause`` s apart."""

    keys: Sequence[str]
    owners: Sequence[str]
    ttls_ms: Sequence[int]
    pause: tuple[float, float]


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


async def _run(provider: LeaseProvider, task: Task, until: float, seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        # Recorded without an answer; the checker lets it have landed or not.
        with contextlib.suppress(LeaseError):
            await send(provider, rng.choice(task.keys), random_call(rng, task))
        await asyncio.sleep(rng.uniform(*task.pause))


async def drive(
    providers: Sequence[LeaseProvider],
    tasks: Sequence[Sequence[Task]],
    seconds: float,
    seed: int = 0,
) -> History:
    """Run ``tasks[i]`` through ``providers[i]`` for ``seconds``; every call recorded."""
    history = History()
    until = time.monotonic() + seconds
    async with asyncio.TaskGroup() as group:
        for index, (provider, its_tasks) in enumerate(zip(providers, tasks, strict=True)):
            recorded = RecordingProvider(provider, history, f"p{index}")
            for number, task in enumerate(its_tasks):
                group.create_task(_run(recorded, task, until, seed * 1000 + index * 100 + number))
    return history
