"""Each contract call against the floor, interleaved round by round.

One round runs the four bare calls, then every contract call on one key in the
order a tenure goes (acquire, lose a race, re-acquire, read, renew, transfer,
release), then ``hold`` entered and left. Timed rounds first; then a few rounds
counted call by call from etcd's own metrics (raft writes, requests).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from etcd_leases import EtcdLeaseProvider, HeldLease

from .checks import Checks
from .config import TTL_MS, WARMUP_ROUNDS, Config
from .etcd_metrics import CallCounts, EtcdMetrics
from .floor import FLOOR_CALLS, BareEtcd
from .stats import Latency, ratio

T = TypeVar("T")

# Each call, and the floor call it is held against: writes against a bare Txn put,
# reads (and what should cost no write) against a linearizable Range.
CALLS: dict[str, str] = {
    "acquire (free key)": "Txn put",
    "acquire (held by other)": "Txn put",
    "acquire (again by its owner)": "Range (linearizable)",
    "get_lease_owner": "Range (linearizable)",
    "renew_lease (same TTL)": "Range (linearizable)",
    "transfer_lease": "Txn put",
    "release_lease": "Txn put",
    "hold: block entered": "Txn put",
    "hold: block left": "Txn put",
}

Timer = Callable[[str, Awaitable[Any]], Awaitable[Any]]


async def floor_round(bare: BareEtcd, timed: Timer) -> None:
    lease_id = await timed("LeaseGrant", bare.grant(TTL_MS // 1000))
    await timed("Txn put", bare.txn_put(bare.key("put"), b"floor"))
    await timed("Range (linearizable)", bare.range(bare.key("put")))
    await timed("LeaseRevoke", bare.revoke(lease_id))


async def contract_round(provider: EtcdLeaseProvider, timed: Timer, checks: Checks) -> None:
    key, a, b = "calls", "owner-a", "owner-b"
    got = await timed("acquire (free key)", provider.acquire_lease(key, a, TTL_MS))
    checks.check(got.acquired, f"calls: acquiring a free key failed: {got}")
    other = await timed("acquire (held by other)", provider.acquire_lease(key, b, TTL_MS))
    checks.check(
        not other.acquired and other.owner == a,
        f"calls: a held key was not reported held by {a!r}: {other}",
    )
    again = await timed("acquire (again by its owner)", provider.acquire_lease(key, a, TTL_MS))
    checks.check(
        again.acquired and again.token == got.token,
        f"calls: the owner's re-acquire did not keep its tenure: {got} then {again}",
    )
    owner = await timed("get_lease_owner", provider.get_lease_owner(key))
    checks.check(owner == a, f"calls: owner is {owner!r}, not {a!r}")
    renewed = await timed("renew_lease (same TTL)", provider.renew_lease(key, a, TTL_MS))
    checks.check(renewed, "calls: the holder could not renew")
    moved = await timed("transfer_lease", provider.transfer_lease(key, a, b, TTL_MS))
    checks.check(moved, "calls: the holder could not transfer")
    await timed("release_lease", provider.release_lease(key, b))

    holding: AbstractAsyncContextManager[HeldLease] = provider.hold("held", a, TTL_MS)
    lease = await timed("hold: block entered", holding.__aenter__())
    checks.check(not lease.lost.is_set(), "calls: hold entered a lost lease")
    await timed("hold: block left", holding.__aexit__(None, None, None))


async def measure_calls(
    endpoint: str, prefix: str, metrics: EtcdMetrics | None, cfg: Config, checks: Checks
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{"floor": {call: figures}, "calls": {call: figures with ratio}}``."""
    times: dict[str, list[float]] = {}
    recording = False

    async def timed(label: str, call: Awaitable[T]) -> T:
        start = time.perf_counter()
        result = await call
        if recording:
            times.setdefault(label, []).append(time.perf_counter() - start)
        return result

    bare = BareEtcd(endpoint, prefix)
    try:
        async with EtcdLeaseProvider(endpoint, prefix=prefix) as provider:
            for i in range(WARMUP_ROUNDS + cfg.rounds):
                recording = i >= WARMUP_ROUNDS
                # Alternate which goes first, so neither always follows the other.
                if i % 2:
                    await floor_round(bare, timed)
                    await contract_round(provider, timed, checks)
                else:
                    await contract_round(provider, timed, checks)
                    await floor_round(bare, timed)
            counts = CallCounts(metrics) if metrics else None
            if counts:
                for _ in range(cfg.counted_rounds):
                    await floor_round(bare, counts.count)
                    await contract_round(provider, counts.count, checks)
    finally:
        await bare.close()

    def figures(label: str) -> dict[str, Any]:
        row: dict[str, Any] = Latency.of(times[label]).as_dict()
        per_call = counts.per_call(label) if counts else None
        row["raft_writes"] = None if per_call is None else per_call.raft_writes
        row["requests"] = None if per_call is None else per_call.requests
        return row

    floor = {label: figures(label) for label in FLOOR_CALLS}
    calls = {}
    for label, against in CALLS.items():
        row = figures(label)
        row["floor"] = against
        row["p50_vs_floor"] = ratio(row["p50_ms"], floor[against]["p50_ms"])
        calls[label] = row
    return {"floor": floor, "calls": calls}
