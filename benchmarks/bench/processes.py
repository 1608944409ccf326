"""Cycles/s from 1, 2 and 4 client processes against one etcd: the ceiling all share.

One client process is bound by Python's cost per gRPC message; several processes
add client CPU until etcd itself (or the machine) is the limit. Ours and the bare
grant+txn+revoke loop run the same way, in turn, so the ratio at each level says
what the library costs once etcd is the bottleneck, and etcd's CPU says where that
is. Each child connects, says it is ready, and starts when every child is ready.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from .config import Config
from .peers import PeerFactory
from .peers.bare import NAME as BARE
from .peers.bare import BareLoop
from .peers.ours import NAME as OURS
from .peers.ours import OurProvider
from .stats import CpuMeter, cpu_seconds_self

KINDS: dict[str, PeerFactory] = {OURS: OurProvider, BARE: BareLoop}
# Past its level's length, how long a child may take before it counts as hung.
HANG_S = 60.0


async def measure_processes(
    endpoint: str, prefix: str, cfg: Config, etcd_pid: int | None
) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per kind and process count: cycles/s, the clients' and etcd's CPU (s/s)."""
    results: dict[str, dict[str, dict[str, float | None]]] = {}
    kinds = list(KINDS)
    for level, processes in enumerate(cfg.processes):
        for turn in range(len(kinds)):
            kind = kinds[(level + turn) % len(kinds)]
            figures = await asyncio.to_thread(
                _run_level, endpoint, f"{prefix}mp/{processes}/", kind, processes, cfg, etcd_pid
            )
            results.setdefault(kind, {})[str(processes)] = figures
            etcd_cpu = figures["etcd_cpu"]
            print(
                f"  {kind:<28} {processes} processes x {cfg.process_tasks} tasks: "
                f"{figures['cycles_per_s']:8,.0f} cycles/s, etcd CPU "
                + ("-" if etcd_cpu is None else f"{etcd_cpu:.2f}")
            )
    return results


def _run_level(
    endpoint: str, prefix: str, kind: str, processes: int, cfg: Config, etcd_pid: int | None
) -> dict[str, float | None]:
    command = [sys.executable, "-m", "benchmarks.bench.processes", kind, endpoint, prefix]
    children = [
        subprocess.Popen(
            [*command, str(child), str(cfg.process_tasks), str(cfg.seconds_per_level)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for child in range(processes)
    ]
    try:
        for child in children:
            assert child.stdout is not None
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a {kind} client process did not start")
        meter = CpuMeter(etcd_pid, None)
        started = time.perf_counter()
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        reports = [
            json.loads(child.communicate(timeout=HANG_S + cfg.seconds_per_level)[0])
            for child in children
        ]
        elapsed = time.perf_counter() - started
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    _, etcd_cpu = meter.per_second(elapsed)
    return {
        "tasks_per_process": cfg.process_tasks,
        "cycles_per_s": sum(report["cycles"] for report in reports) / elapsed,
        "clients_cpu": sum(report["cpu_s"] for report in reports) / elapsed,
        "etcd_cpu": etcd_cpu,
    }


async def _child(
    kind: str, endpoint: str, prefix: str, index: int, tasks: int, seconds: float
) -> None:
    """One client process: connect, say ready, run on "go", print what it did."""
    peer = KINDS[kind](endpoint, f"{prefix}{index}/")
    await peer.open()
    try:
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        cpu = cpu_seconds_self()
        cycles = await peer.cycles_until([f"k{i}" for i in range(tasks)], seconds)
        print(json.dumps({"cycles": cycles, "cpu_s": cpu_seconds_self() - cpu}), flush=True)
    finally:
        await peer.close()


if __name__ == "__main__":
    kind, endpoint, prefix, index, tasks, seconds = sys.argv[1:7]
    asyncio.run(_child(kind, endpoint, prefix, int(index), int(tasks), float(seconds)))
