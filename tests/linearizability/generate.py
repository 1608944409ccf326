"""Valid histories, made up: the reference model answers calls at known instants.

Tasks make calls one after another, each call lasting a random time; each call is
answered by :class:`InMemoryLeaseProvider` on a clock set to an instant within it,
the calls of all tasks in the order of those instants. The history is linearizable by
construction (the instants give the order), which makes it a benchmark for the
checker and a test that it does not reject what is correct.
"""

from __future__ import annotations

import asyncio
import random

from etcd_leases import InMemoryLeaseProvider
from tests.linearizability.history import Call, CallName, History
from tests.linearizability.recorder import send

OWNERS = ["o0", "o1", "o2", "o3", "o4"]
TTLS_MS = [1000, 2000, 3000]


def random_call(rng: random.Random) -> Call:
    """One of the five calls, with the mix a busy set of holders makes."""
    owner, ttl_ms = rng.choice(OWNERS), rng.choice(TTLS_MS)
    names: list[CallName] = ["acquire", "get_owner", "release", "renew", "transfer"]
    name = rng.choices(names, [30, 30, 10, 15, 15])[0]
    if name == "transfer":
        return Call("transfer", owner, ttl_ms, rng.choice(OWNERS))
    if name == "get_owner":
        return Call("get_owner")
    return Call(name, owner, 0 if name == "release" else ttl_ms)


def valid_history(
    calls: int, seconds: float, keys: int, tasks: int, seed: int, lost: float = 0.002
) -> History:
    """``calls`` calls over ``seconds`` on ``keys`` keys by ``tasks`` tasks, each making
    one call after another; a fraction ``lost`` has no answer (half of those never
    took effect)."""
    rng = random.Random(seed)
    mean = seconds * tasks / calls  # each task's calls follow each other closely
    made: list[tuple[float, float, float, int]] = []  # instant, start, end, task
    for task in range(tasks):
        start = rng.uniform(0, mean)
        while len(made) < calls * (task + 1) // tasks:
            end = start + rng.uniform(0.1, 1.9) * mean
            made.append((rng.uniform(start, end), start, end, task))
            start = end
    now = [0.0]
    history = History(clock=lambda: now[0])

    async def run() -> None:
        provider = InMemoryLeaseProvider(clock=lambda: now[0])
        for instant, start, end, task in sorted(made):
            now[0] = instant
            key, call = f"k{rng.randrange(keys)}", random_call(rng)
            if rng.random() < lost:
                if rng.random() < 0.5:
                    await send(provider, key, call)
                history.add(key, call, start, None, client=f"t{task}")
                continue
            answer = await send(provider, key, call)
            history.add(key, call, start, end, answer, f"t{task}")
        await provider.close()

    asyncio.run(run())
    return history
