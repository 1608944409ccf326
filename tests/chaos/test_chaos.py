"""The chaos run: workers in processes hold keys on a 3-member etcd while a nemesis
kills, freezes and partitions members, freezes workers, and does what operators do
(fills the backend to its quota, compacts, defragments, restarts every member, moves
the leader, replaces a member on a new address); the checker then reads the history.
Fails on any safety violation; prints its figures, per kind of fault too, either way.

``python -m pytest tests/chaos`` runs the CI run against every etcd found (each kind
of fault at least once, under a minute per etcd); ``CHAOS_SECONDS=600
python -m pytest tests/chaos -k soak`` runs a longer soak on each (skipped unless
CHAOS_SECONDS is set); ``-k etcd3.4`` picks one etcd. Partitions need root and
``ip``; without them the run says so loudly, and fails if
``ETCD_LEASES_REQUIRE_PARTITIONS=1`` (as in CI).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from etcd_leases.testing import EtcdCluster, etcd_version
from tests.chaos.checker import Record, Report, check
from tests.chaos.figures import by_fault_kind
from tests.chaos.nemesis import Nemesis
from tests.chaos.partitions import Partitions, PartitionsUnsupported
from tests.chaos.register import OutsideRegister
from tests.chaos.worker import Config
from tests.conftest import unique_prefix

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 4
KEYS = ["alpha", "beta", "gamma"]
TTL_MS = 2000
CI_SECONDS = 40.0
# Small enough for a few puts to fill it, big enough for the workers' own history.
QUOTA_BYTES = 16 * 1024 * 1024


@contextlib.contextmanager
def network(size: int) -> Iterator[tuple[Partitions | None, str]]:
    """Members in network namespaces if this machine allows it, else on 127.0.0.1."""
    partitions = Partitions(size)
    try:
        partitions.create()
    except PartitionsUnsupported as exc:
        if os.environ.get("ETCD_LEASES_REQUIRE_PARTITIONS") == "1":
            pytest.fail(f"ETCD_LEASES_REQUIRE_PARTITIONS=1 but {exc}")
        yield None, f"SKIPPED ({exc}); members on 127.0.0.1"
        return
    try:
        yield partitions, "between members in network namespaces"
    finally:
        partitions.destroy()


@contextlib.contextmanager
def workers(configs: list[Config]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start the worker processes; at the end ask them to stop, then kill and reap them."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        for config in configs:
            output = open(config.log_path + ".out", "wb")  # noqa: SIM115 - closed below
            with output:
                started.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.chaos.worker", json.dumps(asdict(config))],
                        cwd=ROOT,
                        stdout=output,
                        stderr=subprocess.STDOUT,
                    )
                )
        yield started
    finally:  # the nemesis has resumed any it froze
        stop_workers(started)


def stop_workers(started: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM (a worker finishes its tenure and exits), then SIGKILL after 20 s."""
    for worker in started:
        if worker.poll() is None:
            worker.terminate()
    for worker in started:
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)


def leases_left(cluster: EtcdCluster, within: float) -> int:
    """etcd's lease count once every TTL had time to run out (0 as soon as it is)."""
    deadline = time.monotonic() + within
    while True:
        first = cluster.etcdctl("lease", "list").splitlines()[0]  # "found N leases"
        count = int(first.split()[1])
        if count == 0 or time.monotonic() >= deadline:
            return count
        time.sleep(0.5)


def read_history(paths: list[str]) -> list[Record]:
    records: list[Record] = []
    for path in paths:
        with open(path, encoding="utf-8") as log:
            records += [json.loads(line) for line in log if line.strip()]
    return records


def print_figures(report: Report, per_kind: dict[str, Any], partitioned: str) -> None:
    print(report.summary())
    print(
        "per fault kind: count; recovery s (heal -> next acquire, median/max); tenures held "
        "right through it; what workers saw while it lasted (errors, losses not their own):"
    )
    for kind, figures in per_kind.items():
        count, recovery, held, seen = figures.values()
        print(f"  {kind}: {count}; {recovery}; {held}; {seen}")
    if partitioned.startswith("SKIPPED"):
        print(f"!!! NO NETWORK PARTITIONS IN THIS RUN: {partitioned} !!!")


def chaos_run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    binary: str,
    seconds: float,
    min_faults: int,
) -> tuple[Report, set[str]]:
    version = etcd_version(binary)
    prefix = unique_prefix()
    with (
        network(3) as (partitions, partitioned),
        EtcdCluster(
            3,
            binary=binary,
            extra_args=[f"--quota-backend-bytes={QUOTA_BYTES}"],
            hosts=partitions.hosts if partitions else (),
            command_prefixes=partitions.command_prefixes if partitions else (),
        ) as cluster,
        OutsideRegister() as register,
    ):
        configs = [
            Config(
                endpoints=cluster.endpoints,
                prefix=prefix,
                name=f"w{i}",
                keys=KEYS,
                register_port=register.port,
                log_path=str(tmp_path / f"w{i}.jsonl"),
                ttl_ms=TTL_MS,
                seconds=3 * seconds + 60,  # stopped by SIGTERM when the nemesis is done
                seed=i,
            )
            for i in range(WORKERS)
        ]
        began = time.monotonic()
        with workers(configs) as started:
            nemesis = Nemesis(
                cluster, started, TTL_MS, partitions, QUOTA_BYTES, seed=int(time.time())
            )
            try:
                nemesis.run(seconds, max(min_faults, len(nemesis.kinds)))
            finally:
                nemesis.resume_all()
            stop_workers(started)
        # Right after the workers' exit only the heirs' tenures (never kept alive) should
        # still have leases; others are leases given up on during faults, left to expire.
        at_exit = leases_left(cluster, within=0)
        values = cluster.etcdctl("get", "--prefix", "--print-value-only", prefix).splitlines()
        heirs = [value for value in values if value.endswith("-heir")]
        left = leases_left(cluster, within=2 * TTL_MS / 1000 + 8)
        records = read_history([config.log_path for config in configs])
        ext_log = list(register.log)
    report = check(records, ext_log, nemesis.faults, left, version)
    report.figures["seconds"] = round(time.monotonic() - began, 1)
    report.figures["leases at exit (heirs' tenures)"] = f"{at_exit} ({len(heirs)})"
    report.figures["partitions"] = partitioned
    per_kind = by_fault_kind(records, nemesis.faults)
    (tmp_path / "faults.json").write_text(json.dumps(nemesis.faults, indent=1))
    (tmp_path / "per_kind.json").write_text(json.dumps(per_kind, indent=1))
    with capsys.disabled():  # the figures are printed even when the run passes
        print(f"\nchaos history (one JSONL per worker, faults.json) in {tmp_path}")
        print_figures(report, per_kind, partitioned)
    return report, {kind.__name__ for kind in nemesis.kinds}


def assert_safe(report: Report, kinds: set[str], min_faults: int) -> None:
    assert report.violations == [], report.summary()
    assert set(report.figures["faults"]) == kinds, "every kind of fault must have come"
    assert sum(report.figures["faults"].values()) >= min_faults
    enough = report.figures["seconds"] / 4
    assert report.figures["tenures"] >= enough, "too little happened for the run to mean much"


@pytest.mark.timeout(2 * CI_SECONDS + 150)
def test_chaos(tmp_path: Path, capsys: pytest.CaptureFixture[str], etcd_binary: str) -> None:
    assert_safe(*chaos_run(tmp_path, capsys, etcd_binary, CI_SECONDS, 0), 0)


@pytest.mark.skipif(not os.environ.get("CHAOS_SECONDS"), reason="a soak: set CHAOS_SECONDS")
@pytest.mark.timeout(2 * float(os.environ.get("CHAOS_SECONDS") or 0) + 150)
def test_chaos_soak(tmp_path: Path, capsys: pytest.CaptureFixture[str], etcd_binary: str) -> None:
    seconds = float(os.environ["CHAOS_SECONDS"])
    min_faults = int(seconds / 4)
    assert_safe(*chaos_run(tmp_path, capsys, etcd_binary, seconds, min_faults), min_faults)
