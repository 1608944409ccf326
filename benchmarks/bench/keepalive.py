"""Keep-alive cost: N leases held through ``provider.hold`` in one process.

Each case takes its leases (a bounded number at a time), then measures a window
on an idle host and one with two CPU hogs started by the benchmark: CPU seconds
per second of this process (all threads) and of etcd, requests etcd received per
second, and leases lost. Then every block is left, which releases the leases.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager
from typing import Any

from etcd_leases import EtcdLeaseProvider, HeldLease, LeaseError
from etcd_leases.testing.load import cpu_hogs

from .checks import Checks
from .config import ADMISSION, HoldCase
from .etcd_metrics import EtcdMetrics
from .stats import CpuMeter

HOGS = 2


class HeldLeases:
    """``case.leases`` hold blocks, each in a task that stays inside until ``stop``."""

    def __init__(
        self, provider: EtcdLeaseProvider, case: HoldCase, admission: int = ADMISSION
    ) -> None:
        self._provider = provider
        self._case = case
        self._admission = asyncio.Semaphore(admission)  # blocks entered or left at a time
        self._stop = asyncio.Event()
        self.leases: list[HeldLease] = []
        self.not_taken: list[str] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._settled = 0  # blocks entered, or failed to
        self._all_settled = asyncio.Event()

    async def _hold(self, i: int) -> None:
        holding: AbstractAsyncContextManager[HeldLease] = self._provider.hold(
            f"kept/{self._case.ttl_ms}/{i}", f"keeper-{i}", self._case.ttl_ms
        )
        async with self._admission:
            try:
                lease = await holding.__aenter__()
            except LeaseError as exc:
                self.not_taken.append(f"{type(exc).__name__}: {exc}")
                return
            finally:
                self._settled += 1
                if self._settled == self._case.leases:
                    self._all_settled.set()
        self.leases.append(lease)
        await self._stop.wait()
        async with self._admission:
            await holding.__aexit__(None, None, None)

    async def take(self) -> float:
        """Enter every block; seconds it took."""
        start = time.perf_counter()
        self._tasks = [asyncio.create_task(self._hold(i)) for i in range(self._case.leases)]
        await self._all_settled.wait()  # any other error than LeaseError surfaces in leave()
        return time.perf_counter() - start

    def lost(self) -> list[HeldLease]:
        return [lease for lease in self.leases if lease.lost.is_set()]

    async def leave(self) -> float:
        """Leave every block (each releases its lease); seconds it took."""
        start = time.perf_counter()
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return time.perf_counter() - start


# Steady state: each held key's watch is registered after its block is entered, one
# watch create at a time; the windows start once etcd hears this little.
_QUIET_REQUESTS_PER_S = 100
_SETTLE_MAX_S = 30.0


async def settle(metrics: EtcdMetrics | None) -> float:
    """Wait until the taking's tail (watch creates) is over; seconds waited."""
    start = time.perf_counter()
    if metrics is None:
        await asyncio.sleep(5.0)
        return time.perf_counter() - start
    before = metrics.sample()
    while time.perf_counter() - start < _SETTLE_MAX_S:
        await asyncio.sleep(0.5)
        after = metrics.sample()
        if before is None or after is None:
            break
        if (after - before).requests / 0.5 < _QUIET_REQUESTS_PER_S:
            break
        before = after
    return time.perf_counter() - start


async def window(
    held: HeldLeases, seconds: float, etcd_pid: int | None, metrics: EtcdMetrics | None
) -> dict[str, Any]:
    lost_before = len(held.lost())
    requests_before = metrics.sample() if metrics else None
    meter = CpuMeter(etcd_pid)
    start = time.perf_counter()
    await asyncio.sleep(seconds)
    elapsed = time.perf_counter() - start
    ours, etcd = meter.per_second(elapsed)
    requests_after = metrics.sample() if metrics else None
    requests = (
        None
        if requests_before is None or requests_after is None
        else (requests_after - requests_before).requests / elapsed
    )
    return {
        "seconds": elapsed,
        "cpu_per_s": ours,
        "etcd_cpu_per_s": etcd,
        "requests_per_s": requests,
        "lost": len(held.lost()) - lost_before,
    }


async def measure_case(
    endpoint: str,
    prefix: str,
    case: HoldCase,
    seconds: float,
    etcd_pid: int | None,
    metrics: EtcdMetrics | None,
    checks: Checks,
) -> dict[str, Any]:
    async with EtcdLeaseProvider(endpoint, prefix=prefix) as provider:
        await provider.get_lease_owner("warm-up")
        held = HeldLeases(provider, case)
        taking = await held.take()
        lost_taking = len(held.lost())
        settling = await settle(metrics)
        idle = await window(held, seconds, etcd_pid, metrics)
        with cpu_hogs(HOGS):
            loaded = await window(held, seconds, etcd_pid, metrics)
        lost = held.lost()
        reason = lost[0].lost_reason if lost else None
        leaving = await held.leave()
    result = {
        "leases": case.leases,
        "ttl_s": case.ttl_ms / 1000,
        "taking_s": taking,
        "settling_s": settling,
        "not_taken": len(held.not_taken),
        "lost_while_taking": lost_taking,
        "idle": idle,
        "loaded": loaded,
        "leaving_s": leaving,
        "a_lost_reason": reason or (held.not_taken[0] if held.not_taken else None),
    }
    if lost or held.not_taken:
        checks.warn(
            f"keep-alive {case.leases:,} leases @ TTL {case.ttl_ms / 1000:g} s:"
            f" {len(lost):,} lost, {len(held.not_taken):,} not taken,"
            f" e.g. {result['a_lost_reason']!r}"
        )
    return result
