"""Many keys held with ``hold`` in one process: taking, loss detection, CPU, memory.

    python -m benchmarks.held_keys                # 100,000 keys, throwaway etcd
    python -m benchmarks.held_keys --quick        # 2,000 keys, shorter windows
    python -m benchmarks.held_keys --keys 10000
    python -m benchmarks.held_keys --endpoints 127.0.0.1:2379   # no etcd CPU/memory then

One provider takes N keys (TTL 15 s), each in a task inside its ``hold`` block, a
bounded number of takes in flight. Another provider (its own connection) plays
"anyone": it releases or transfers held keys, and the holder's ``lease.lost`` tells
when the loss was seen. Printed:

- **take**: from the first ``hold`` started to the last block entered, and the CPU
  seconds this process and etcd spent meanwhile (on a busy host, the wall time
  mostly says how much CPU the others left); ``--gc-off`` turns Python's cyclic GC
  off meanwhile, to show its share (it walks every held key's objects as they grow);
- **detection ready**: the key taken last is released by the other provider right
  after the last take; the time until its holder sees the loss says when loss
  detection covered every key (a key's changes are never missed, only seen late);
- **detection**: then 20 keys picked at random, one at a time, released or
  transferred: latency from the call's start to ``lost`` set (ms);
- **CPU** of this process and of etcd (CPU seconds per second, 1.0 = one core)
  over a window while holding, idle and beside two CPU hogs, and leases lost;
- **memory per held key**: the growth of this process's and etcd's resident set
  from before the first take to after the last, divided by N.

Prints figures; asserts no timing. Exit code 1 if a key was not taken or a lease
other than the ones released on purpose was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Sequence

from benchmarks.bench.config import HoldCase
from benchmarks.bench.keepalive import HeldLeases
from benchmarks.bench.stats import CpuMeter
from etcd_leases import EtcdLeaseProvider, HeldLease
from etcd_leases.testing import EtcdCluster
from etcd_leases.testing.load import cpu_hogs

TTL_MS = 15_000
IN_FLIGHT = 512  # takes at a time
PROBES = 20
HOGS = 2


def rss_bytes(pid: int | None = None) -> int | None:
    """Resident set of ``pid`` (this process if None), from /proc; None elsewhere."""
    try:
        with open(f"/proc/{'self' if pid is None else pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


async def lose(anyone: EtcdLeaseProvider, lease: HeldLease, transfer: bool) -> float:
    """Release (or transfer) ``lease``'s key from the other provider; seconds until seen."""
    start = time.perf_counter()
    if transfer:
        if not await anyone.transfer_lease(lease.key, lease.owner, "anyone", TTL_MS):
            raise RuntimeError(f"{lease.key!r} was not held by {lease.owner!r} any more")
    else:
        await anyone.release_lease(lease.key, lease.owner)
    await asyncio.wait_for(lease.lost.wait(), 120)
    return time.perf_counter() - start


async def window(seconds: float, etcd_pid: int | None) -> tuple[float | None, float | None]:
    meter = CpuMeter(etcd_pid)
    start = time.perf_counter()
    await asyncio.sleep(seconds)
    return meter.per_second(time.perf_counter() - start)


def per_key(before: int | None, after: int | None, keys: int) -> str:
    return "-" if before is None or after is None else f"{(after - before) / keys:,.0f} B"


def seconds_of(figure: float | None) -> str:
    return "-" if figure is None else f"{figure:.1f}"


def cpu(figure: float | None) -> str:
    return "-" if figure is None else f"{figure * 100:.2f}%"


async def run(
    endpoints: Sequence[str], keys: int, seconds: float, etcd_pid: int | None, gc_off: bool
) -> int:
    prefix = f"/etcd-leases-bench-held/{uuid.uuid4().hex}/"
    async with (
        EtcdLeaseProvider(endpoints, prefix=prefix) as holder,
        EtcdLeaseProvider(endpoints, prefix=prefix) as anyone,
    ):
        await holder.get_lease_owner("warm-up")
        await anyone.get_lease_owner("warm-up")
        rss_before, etcd_before = rss_bytes(), rss_bytes(etcd_pid)
        held = HeldLeases(holder, HoldCase(keys, TTL_MS), IN_FLIGHT)
        meter = CpuMeter(etcd_pid)
        if gc_off:
            gc.disable()
        taking = await held.take()
        gc.enable()
        taking_cpu = meter.per_second(1.0)
        ready = await lose(anyone, held.leases[-1], transfer=False)
        print(
            f"{keys:,} keys held, TTL {TTL_MS / 1000:g} s, {IN_FLIGHT} takes in flight;"
            f" load average {os.getloadavg()[0]:.1f} after the take"
            + ("; cyclic GC off while taking" if gc_off else "")
        )
        print(
            f"  take                 {taking:8.2f} s   ({keys / taking:,.0f} keys/s;"
            f" CPU s: client {seconds_of(taking_cpu[0])}, etcd {seconds_of(taking_cpu[1])})"
        )
        print(f"  detection ready      {ready * 1000:8.1f} ms  after the last take")
        rss_after, etcd_after = rss_bytes(), rss_bytes(etcd_pid)
        print(
            f"  memory per held key  client {per_key(rss_before, rss_after, keys)},"
            f" etcd {per_key(etcd_before, etcd_after, keys)}"
        )
        probed = {held.leases[-1].key}
        latencies = []
        for n, lease in enumerate(random.sample(held.leases[:-1], min(PROBES, keys - 1))):
            probed.add(lease.key)
            latencies.append(await lose(anyone, lease, transfer=n % 2 == 1))
            await asyncio.sleep(0.05)
        print(
            f"  detection (release/transfer by another client, {len(latencies)} keys):"
            f" p50 {statistics.median(latencies) * 1000:.1f} ms,"
            f" max {max(latencies) * 1000:.1f} ms"
        )
        idle = await window(seconds, etcd_pid)
        with cpu_hogs(HOGS):
            loaded = await window(seconds, etcd_pid)
        lost = [lease for lease in held.leases if lease.lost.is_set() and lease.key not in probed]
        for name, (ours, etcd) in (("idle", idle), (f"{HOGS} CPU hogs", loaded)):
            print(f"  CPU while holding, {name:<10} client {cpu(ours)}, etcd {cpu(etcd)}")
        print(f"  lost {len(lost):,}, not taken {len(held.not_taken):,}")
        for reason in [lease.lost_reason for lease in lost[:3]] + held.not_taken[:3]:
            print(f"    e.g. {reason}")
        leaving = await held.leave()
        print(f"  leave                {leaving:8.2f} s")
    return 1 if lost or held.not_taken else 0


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="2,000 keys, 3 s windows")
    parser.add_argument("--keys", type=int, help="how many keys to hold (default 100,000)")
    parser.add_argument("--seconds", type=float, help="each CPU window (default 15 s)")
    parser.add_argument("--endpoints", help="an etcd you already run (host:port,...)")
    parser.add_argument(
        "--gc-off", action="store_true", help="Python's cyclic GC off while taking (its share)"
    )
    args = parser.parse_args(argv)
    keys = args.keys or (2_000 if args.quick else 100_000)
    seconds = args.seconds or (3.0 if args.quick else 15.0)
    if args.endpoints:
        sys.exit(asyncio.run(run(args.endpoints.split(","), keys, seconds, None, args.gc_off)))
    with EtcdCluster(1) as cluster:
        print(f"throwaway etcd at {cluster.endpoint_string}")
        code = asyncio.run(
            run(cluster.endpoints, keys, seconds, cluster.members[0].pid, args.gc_off)
        )
    sys.exit(code)


if __name__ == "__main__":
    main()
