"""The two workloads whose time ``benchmarks/README.md`` breaks down, to run under a profiler.

    py-spy record --format raw -o cycles.txt -- \\
        python -m benchmarks.bench.hotpaths cycles --tasks 128 --seconds 15
    py-spy record --format raw -o hold.txt -- \\
        python -m benchmarks.bench.hotpaths hold --leases 5000 --ttl-ms 3000 --seconds 15

``cycles``: acquire+release cycles on distinct keys from N tasks of one provider.
``hold``: N leases held through ``provider.hold``, measured once all are taken.
Each starts its own one-member etcd unless ``--endpoints`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Sequence

from etcd_leases import EtcdLeaseProvider
from etcd_leases.testing import EtcdCluster

from .config import HoldCase
from .keepalive import HeldLeases
from .peers.ours import OurProvider
from .stats import CpuMeter


async def cycles(endpoint: str, prefix: str, tasks: int, seconds: float) -> None:
    ours = OurProvider(endpoint, prefix)
    try:
        await ours.open()
        meter = CpuMeter(None)
        start = time.perf_counter()
        done = await ours.cycles_until([f"hot/{i}" for i in range(tasks)], seconds)
        elapsed = time.perf_counter() - start
    finally:
        await ours.close()
    cpu, _ = meter.per_second(elapsed)
    print(f"{tasks} tasks: {done / elapsed:,.0f} cycles/s, {cpu:.2f} CPU s/s")


async def hold(endpoint: str, prefix: str, case: HoldCase, seconds: float) -> None:
    async with EtcdLeaseProvider(endpoint, prefix=prefix) as provider:
        held = HeldLeases(provider, case)
        taking = await held.take()
        meter = CpuMeter(None)
        await asyncio.sleep(seconds)
        cpu, _ = meter.per_second(seconds)
        lost = len(held.lost())
        await held.leave()
    print(f"{case.leases:,} leases, TTL {case.ttl_ms} ms: taken in {taking:.1f} s,")
    print(f"  then {cpu:.2f} CPU s/s over {seconds:g} s, {lost} lost")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench.hotpaths")
    parser.add_argument("workload", choices=("cycles", "hold"))
    parser.add_argument("--tasks", type=int, default=128)
    parser.add_argument("--leases", type=int, default=5_000)
    parser.add_argument("--ttl-ms", type=int, default=3_000)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--endpoints", help="use this running etcd instead of starting one")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prefix = f"/etcd-leases-bench/{uuid.uuid4().hex[:8]}/"

    def run(endpoint: str) -> None:
        if args.workload == "cycles":
            asyncio.run(cycles(endpoint, prefix, args.tasks, args.seconds))
        else:
            case = HoldCase(args.leases, args.ttl_ms)
            asyncio.run(hold(endpoint, prefix, case, args.seconds))

    if args.endpoints:
        run(args.endpoints)
    else:
        with EtcdCluster(1) as cluster:
            run(cluster.endpoint_string)
    return 0


if __name__ == "__main__":
    sys.exit(main())
