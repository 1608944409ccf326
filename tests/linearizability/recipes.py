"""``hold``, ``adopt`` and the election driven at random, their calls recorded.

Each runs on a :class:`RecordingHoldingProvider`, so the acquires, renews, releases,
transfers and reads the recipes make land in the history beside the plain calls.
While a holder or leader believes it holds its key, it says so now and then
(:func:`claim`): each such belief is a read the checker must place where the key is
held by it. Owner ids are the process's own (``<client>-h<n>``, ``<client>-c``): a
belief is about one holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

from etcd_leases import Election, HeldLease, HoldingProvider, LeaseError, adopt, hold
from tests.linearizability.history import History
from tests.linearizability.recorder import RecordingHoldingProvider, claim

HOLD_KEYS = ["held0", "held1"]
SEAT = "seat"
TTL_MS = 1000


async def _claim_for_a_while(
    history: History, client: str, lease: HeldLease, rng: random.Random
) -> bool:
    """Check the lease a few times, a while apart; whether it was held throughout."""
    for _ in range(rng.randint(1, 15)):
        if not claim(history, client, lease):
            return False
        await asyncio.sleep(rng.uniform(0.01, 0.2))
    return True


async def holding(
    recorded: RecordingHoldingProvider, owner: str, until: float, rng: random.Random
) -> None:
    """Hold a shared key (waiting for it), then release it, or hand it to an heir that
    adopts it in turn."""
    history, client = recorded.history, recorded.client
    while time.monotonic() < until:
        key = rng.choice(HOLD_KEYS)
        with contextlib.suppress(LeaseError):
            async with hold(recorded, key, owner, TTL_MS, wait=True) as lease:
                if await _claim_for_a_while(history, client, lease, rng) and rng.random() < 0.4:
                    heir = f"{owner}-heir"
                    await lease.transfer(heir)
                    async with adopt(recorded, key, heir, TTL_MS) as adopted:
                        await _claim_for_a_while(history, client, adopted, rng)
        await asyncio.sleep(rng.uniform(0, 0.3))


async def electing(
    recorded: RecordingHoldingProvider, candidate: str, until: float, rng: random.Random
) -> None:
    """Campaign for the seat, lead a while, resign; ask who leads now and then."""
    election = Election(recorded, SEAT, candidate, TTL_MS)
    while time.monotonic() < until:
        with contextlib.suppress(LeaseError):
            await election.leader()
            async with election.leadership() as lease:
                await _claim_for_a_while(recorded.history, recorded.client, lease, rng)
        await asyncio.sleep(rng.uniform(0, 0.3))


async def drive_recipes(
    provider: HoldingProvider, history: History, client: str, until: float, seed: int
) -> None:
    """Two holders and a candidate of client ``client`` until ``until``.

    They wait for their keys without a timeout: a call cut short leaves no answer, and
    each call without one makes the search costlier (it may land at any moment), so
    calls are cut short only at ``until`` (a monotonic time, as the event loop's).
    """
    recorded = RecordingHoldingProvider(provider, history, client)
    rng = [random.Random(f"{seed}/{client}/{n}") for n in range(3)]
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout_at(until), asyncio.TaskGroup() as group:
            for number in range(2):
                group.create_task(holding(recorded, f"{client}-h{number}", until, rng[number]))
            group.create_task(electing(recorded, f"{client}-c", until, rng[2]))
