"""Hand-overs between providers: takeover, loss detection, and a race for one key.

Takeover: the holder leaves its ``hold`` block -> a waiter's ``hold(wait=True)`` is
in. The waiter runs on another provider (its own connection, as another process
would), already waiting: this times the hand-over, not the waiter's start-up.
Loss detection: another client transfers a held key -> the holder's ``lease.lost``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from etcd_leases import EtcdLeaseProvider

from .checks import Checks
from .config import TTL_MS
from .stats import Latency

# Long enough for the waiter to fail its first attempt and start watching.
SETTLE_S = 0.1


async def measure_takeover(
    endpoint: str, prefix: str, rounds: int, checks: Checks
) -> dict[str, Any]:
    takeovers: list[float] = []
    key = "takeover"
    async with (
        EtcdLeaseProvider(endpoint, prefix=prefix) as holder,
        EtcdLeaseProvider(endpoint, prefix=prefix) as waiter,
    ):
        await asyncio.gather(holder.get_lease_owner(key), waiter.get_lease_owner(key))
        for _ in range(rounds + 1):  # the first round warms up

            async def wait_for_key() -> float:
                async with waiter.hold(key, "waiter", TTL_MS, wait=True):
                    return time.perf_counter()

            async with holder.hold(key, "holder", TTL_MS):
                waiting = asyncio.create_task(wait_for_key())
                await asyncio.sleep(SETTLE_S)
                checks.check(not waiting.done(), "takeover: the waiter got in while held")
                start = time.perf_counter()
            got_in = await asyncio.wait_for(waiting, timeout=10)
            takeovers.append(got_in - start)
    return Latency.of(takeovers[1:]).as_dict()


async def check_races(
    endpoint: str, prefix: str, racers: int, rounds: int, checks: Checks
) -> dict[str, Any]:
    """``racers`` providers acquire one free key at once: exactly one wins, every
    loser names it, etcd agrees. Times until all have answered."""
    providers = [EtcdLeaseProvider(endpoint, prefix=prefix) for _ in range(racers)]
    answered: list[float] = []
    try:
        await asyncio.gather(*(p.get_lease_owner("warm-up") for p in providers))
        for round_no in range(rounds):
            key = f"race/{round_no}"
            start = time.perf_counter()
            results = await asyncio.gather(
                *(p.acquire_lease(key, f"racer-{i}", TTL_MS) for i, p in enumerate(providers))
            )
            answered.append(time.perf_counter() - start)
            won = [f"racer-{i}" for i, got in enumerate(results) if got.acquired]
            told = {got.owner for got in results if not got.acquired}
            holder = await providers[0].get_lease_owner(key)
            checks.check(
                len(won) == 1 and holder == won[0] and told <= {won[0]},
                f"race {round_no}: winners {won}, losers told {told}, etcd says {holder!r}",
            )
            if holder is not None:
                await providers[0].release_lease(key, holder)
    finally:
        await asyncio.gather(*(p.close() for p in providers))
    return {"racers": racers, "rounds": rounds, **Latency.of(answered).as_dict()}


async def stamp_when_set(event: asyncio.Event) -> float:
    """``perf_counter()`` when ``event`` is set, caught by a task of its own even while
    the caller still waits on the call that set it."""
    await event.wait()
    return time.perf_counter()


async def measure_loss_detection(
    endpoint: str, prefix: str, rounds: int, checks: Checks
) -> dict[str, Any]:
    """Another client's ``transfer_lease`` called -> the holder's ``lease.lost`` set."""
    detections: list[float] = []
    key = "loss"
    async with (
        EtcdLeaseProvider(endpoint, prefix=prefix) as holder,
        EtcdLeaseProvider(endpoint, prefix=prefix) as thief,
    ):
        await asyncio.gather(holder.get_lease_owner(key), thief.get_lease_owner(key))
        for _ in range(rounds + 1):  # the first round warms up
            async with holder.hold(key, "holder", TTL_MS) as lease:
                await asyncio.sleep(SETTLE_S)  # the lease's watch is up: time detection only
                lost_at = asyncio.create_task(stamp_when_set(lease.lost))
                start = time.perf_counter()
                moved = await thief.transfer_lease(key, "holder", "thief", TTL_MS)
                checks.check(moved, "loss: the other client could not transfer the key")
                detections.append(await asyncio.wait_for(lost_at, timeout=10) - start)
            await thief.release_lease(key, "thief")
    return Latency.of(detections[1:]).as_dict()
