"""The chaos run: workers in processes hold keys on a 3-member etcd while a nemesis
kills, freezes and partitions members and freezes workers; the checker then reads
the history. Fails on any safety violation; prints its figures either way.

``python -m pytest tests/chaos`` runs the CI run (at least 20 faults, about two
minutes, against the newest etcd found); ``CHAOS_SECONDS=600 python -m pytest
tests/chaos -k soak`` runs a longer soak (skipped unless CHAOS_SECONDS is set);
``CHAOS_ETCD=/usr/bin/etcd`` picks another etcd binary.
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

import pytest

from etcd_leases.testing import EtcdCluster, etcd_version, find_etcd_binaries
from tests.chaos.checker import Record, Report, check
from tests.chaos.nemesis import Nemesis
from tests.chaos.partitions import Partitions, PartitionsUnsupported
from tests.chaos.register import OutsideRegister
from tests.chaos.worker import Config
from tests.conftest import unique_prefix

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 4
KEYS = ["alpha", "beta", "gamma"]
TTL_MS = 2000
CI_SECONDS = 75.0
CI_FAULTS = 20


def chosen_etcd() -> str:
    """``$CHAOS_ETCD`` if set, else the newest etcd found."""
    if os.environ.get("CHAOS_ETCD"):
        return os.environ["CHAOS_ETCD"]
    binaries = find_etcd_binaries()
    if not binaries:
        pytest.skip("no etcd binary found")

    def version(binary: str) -> tuple[int, ...]:
        return tuple(int(part) for part in etcd_version(binary).split(".")[:3])

    return max(binaries, key=version)


@contextlib.contextmanager
def network(size: int) -> Iterator[tuple[Partitions | None, str]]:
    """Members in network namespaces if this machine allows it, else on 127.0.0.1."""
    partitions = Partitions(size)
    try:
        partitions.create()
    except PartitionsUnsupported as exc:
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


def chaos_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], seconds: float, min_faults: int
) -> Report:
    binary = chosen_etcd()
    version = etcd_version(binary)
    prefix = unique_prefix()
    with (
        network(3) as (partitions, partitioned),
        EtcdCluster(
            3,
            binary=binary,
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
            nemesis = Nemesis(cluster, started, TTL_MS, partitions, seed=int(time.time()))
            try:
                nemesis.run(seconds, min_faults)
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
    (tmp_path / "faults.json").write_text(json.dumps(nemesis.faults, indent=1))
    with capsys.disabled():  # the figures are printed even when the run passes
        print(f"\nchaos history (one JSONL per worker, faults.json) in {tmp_path}")
        print(report.summary())
    return report


def assert_safe(report: Report, min_faults: int) -> None:
    assert report.violations == [], report.summary()
    assert sum(report.figures["faults"].values()) >= min_faults
    enough = report.figures["seconds"] / 4
    assert report.figures["tenures"] >= enough, "too little happened for the run to mean much"


@pytest.mark.timeout(2 * CI_SECONDS + 150)
def test_chaos(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_safe(chaos_run(tmp_path, capsys, CI_SECONDS, CI_FAULTS), CI_FAULTS)


@pytest.mark.skipif(not os.environ.get("CHAOS_SECONDS"), reason="a soak: set CHAOS_SECONDS")
@pytest.mark.timeout(2 * float(os.environ.get("CHAOS_SECONDS") or 0) + 150)
def test_chaos_soak(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seconds = float(os.environ["CHAOS_SECONDS"])
    assert_safe(chaos_run(tmp_path, capsys, seconds, int(seconds / 4)), int(seconds / 4))
