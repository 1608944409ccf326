"""The benchmark's pure parts: figures, etcd's counters, goals and the files it writes.

The benchmark itself is not run here (it takes minutes and asserts no timing);
``BENCH_SMOKE=1`` runs its ``--quick`` mode once, end to end, against a real etcd.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.etcd_metrics import Counts, parse_counts
from benchmarks.bench.goals import evaluate, fastest_etcd_peer
from benchmarks.bench.report import tables, write_json, write_markdown
from benchmarks.bench.stats import Latency, percentile, ratio, split_evenly

REPOSITORY = Path(__file__).resolve().parent.parent


def latency(p50: float, p99: float) -> dict[str, float]:
    return {"n": 100, "p50_ms": p50, "p99_ms": p99, "mean_ms": p50}


def call(p50: float, writes: float, floor: str, floor_p50: float) -> dict[str, Any]:
    return {
        **latency(p50, p50 * 3),
        "raft_writes": writes,
        "requests": writes + 1,
        "floor": floor,
        "p50_vs_floor": p50 / floor_p50,
    }


def hold_case(leases: int, ttl_s: float, cpu: float, lost: int) -> dict[str, Any]:
    window = {"seconds": 4.0, "cpu_per_s": cpu, "etcd_cpu_per_s": 0.1, "requests_per_s": 300.0}
    return {
        "leases": leases,
        "ttl_s": ttl_s,
        "taking_s": 2.5,
        "not_taken": 0,
        "lost_while_taking": 0,
        "idle": {**window, "lost": 0},
        "loaded": {**window, "lost": lost},
        "leaving_s": 1.0,
        "a_lost_reason": None,
    }


def oneshot(wall: float, cpu: float, writes: int, left: int, ours_vs_it: float) -> dict[str, Any]:
    return {
        **latency(wall, wall * 2),
        "cpu_p50_ms": cpu,
        "raft_writes": writes,
        "leases_left": left,
        "does": "a one-shot",
        "ours_vs_it": ours_vs_it,
        "ours_vs_it_cpu": 0.5,
    }


@pytest.fixture
def results() -> dict[str, Any]:
    levels = ("1", "16", "128", "512")
    rates = {
        "etcd_leases": 1234.0,
        "bare gRPC grant+txn+revoke": 500.0,
        "python3-etcd3 Lock": 200.0,
    }
    return {
        "meta": {
            "run": "--quick",
            "started": "2026-12-03 14:00 UTC",
            "etcd": "3.4.23 (/usr/bin/etcd)",
            "machine": "2 CPUs",
            "load_before": "0.10",
            "load_after": "2.00",
            "python": "CPython 3.11",
            "packages": "etcd-leases 0.1.0",
        },
        "floor": {
            "Txn put": {**latency(0.9, 2.0), "raft_writes": 1.0, "requests": 1.0},
            "Range (linearizable)": {**latency(0.5, 1.5), "raft_writes": 0.0, "requests": 1.0},
        },
        "calls": {
            "acquire (free key)": call(1.08, 1.0, "Txn put", 0.9),
            "release_lease": call(2.7, 2.0, "Txn put", 0.9),
            "renew_lease (same TTL)": call(0.6, 0.0, "Range (linearizable)", 0.5),
        },
        "cycle": {
            "etcd_leases": {**latency(1.5, 3.0), "does": "ours"},
            "bare gRPC grant+txn+revoke": {**latency(2.7, 5.0), "does": "bare"},
            "python3-etcd3 Lock": {**latency(2.4, 5.0), "does": "etcd3"},
            "aetcd Lock": {**latency(2.1, 5.0), "does": "aetcd"},
            "Redis SET NX PX + Lua DEL": {**latency(0.2, 0.5), "does": "redis"},
        },
        "throughput": {
            name: {
                t: {"cycles_per_s": rate * int(t) ** 0.5, "cpu": 0.9, "etcd_cpu": 0.7}
                for t in levels
            }
            for name, rate in rates.items()
        },
        "oneshot": {
            "etcd_leases": oneshot(150.0, 140.0, 3, 0, 1.0),
            "python3-etcd3 Lock": oneshot(200.0, 180.0, 3, 1, 0.75),
            "bare gRPC grant+txn+revoke": oneshot(160.0, 150.0, 3, 0, 0.9375),
        },
        "processes": {
            "etcd_leases": {
                "1": {
                    "tasks_per_process": 64,
                    "cycles_per_s": 2000.0,
                    "clients_cpu": 0.6,
                    "etcd_cpu": 0.5,
                },
                "4": {
                    "tasks_per_process": 64,
                    "cycles_per_s": 3000.0,
                    "clients_cpu": 1.2,
                    "etcd_cpu": 0.9,
                },
            },
            "bare gRPC grant+txn+revoke": {
                "1": {
                    "tasks_per_process": 64,
                    "cycles_per_s": 1000.0,
                    "clients_cpu": 0.4,
                    "etcd_cpu": 0.6,
                },
                "4": {
                    "tasks_per_process": 64,
                    "cycles_per_s": 2500.0,
                    "clients_cpu": 0.9,
                    "etcd_cpu": 1.0,
                },
            },
        },
        "keepalive": [hold_case(10_000, 15.0, 0.031, 0), hold_case(5_000, 3.0, 0.2, 7)],
        "takeover": latency(9.5, 12.0),
        "loss_detection": latency(4.5, 6.0),
        "races": {"racers": 20, "rounds": 3, **latency(17.0, 19.0)},
        "skipped": {"etcd-client-py with_lock": "etcd-client-py is not installed"},
        "errors": [],
        "warnings": [],
    }


def test_percentile_is_nearest_rank() -> None:
    samples = [float(i) for i in range(1, 101)]
    assert percentile(samples, 50) == 50.0
    assert percentile(samples, 99) == 99.0
    assert percentile([3.0, 1.0, 2.0], 99) == 3.0  # under 100 samples: the maximum
    with pytest.raises(ValueError):
        percentile([], 50)


def test_latency_is_in_milliseconds() -> None:
    figures = Latency.of([0.001, 0.002, 0.003])
    assert figures.n == 3
    assert figures.p50_ms == pytest.approx(2.0)
    assert figures.p99_ms == pytest.approx(3.0)
    assert figures.mean_ms == pytest.approx(2.0)


def test_ratio_and_split() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None
    assert ratio(1.0, 0.0) is None
    assert split_evenly(10, 3) == [4, 3, 3]
    assert sum(split_evenly(7, 7)) == 7


def test_parse_counts_sums_every_method() -> None:
    text = "\n".join(
        [
            "# HELP etcd_server_proposals_committed_total The total number...",
            "etcd_server_proposals_committed_total 42",
            'grpc_server_msg_received_total{grpc_method="Range",grpc_service="x"} 5',
            'grpc_server_msg_received_total{grpc_method="Txn",grpc_service="x"} 7',
            'grpc_server_msg_sent_total{grpc_method="Txn",grpc_service="x"} 99',
        ]
    )
    assert parse_counts(text) == Counts(raft_writes=42.0, requests=12.0)
    assert Counts(3, 4) - Counts(1, 1) == Counts(2, 3)


def test_goals_read_the_results(results: dict[str, Any]) -> None:
    goals = {goal.name: goal for goal in evaluate(results)}
    acquire = goals["acquire p50 / Txn put p50"]
    assert acquire.measured == pytest.approx(1.2) and acquire.met is True
    assert goals["release p50 / Txn put p50"].met is False
    assert goals["release: raft writes"].met is False
    assert goals["renew (same TTL): raft writes"].met is True
    # The fastest etcd library, not the bare loop or Redis.
    assert fastest_etcd_peer(results) == ("aetcd Lock", 2.1)
    assert goals["cycle: aetcd Lock p50 / ours"].measured == pytest.approx(1.4)
    assert goals["512 tasks: ours / bare loop cycles/s"].measured == pytest.approx(2.468)
    assert goals["512 tasks: ours / python3-etcd3 Lock cycles/s"].met is True
    assert goals["10,000 leases @ 15 s: CPU, share of one core"].met is True
    assert goals["5,000 leases @ 3 s, two CPU hogs: lost"].measured == 7
    assert goals["5,000 leases @ 3 s, two CPU hogs: lost"].met is False
    assert goals["takeover p50 ms"].met is True
    assert goals["transfer: raft writes"].met is None  # not measured: no verdict
    assert goals["one-shot process: ours / python3-etcd3 Lock wall p50"].measured == 0.75
    assert goals["one-shot process: ours / python3-etcd3 Lock wall p50"].met is True
    assert goals["one-shot process: raft writes, its lease freed"].met is True


def test_report_files_hold_the_figures(results: dict[str, Any], tmp_path: Path) -> None:
    write_json(results, tmp_path / "results.json")
    write_markdown(results, tmp_path / "results.md")

    written = json.loads((tmp_path / "results.json").read_text())
    assert written["calls"]["acquire (free key)"]["p50_ms"] == 1.08
    assert {"goal": "takeover p50 ms", "target": "< 15", "measured": 9.5, "met": True} in (
        written["goals"]
    )
    markdown = (tmp_path / "results.md").read_text()
    assert "| acquire (free key) | 1.08 | 3.24 | 1.0 | 2.0 | Txn put | 1.20x |" in markdown
    assert "| etcd_leases | 1,234 | 4,936 |" in markdown
    assert "| 5,000 | 3 | loaded | 0.200 |" in markdown
    assert "etcd-client-py is not installed" in markdown
    assert "- aetcd Lock: aetcd\n" in markdown
    assert (
        "| loss: another client's transfer called -> lease.lost | 4.50 | 6.00 |" in markdown
    )  # what each client's cycle sends
    assert "| 5,000 leases @ 3 s, two CPU hogs: lost | 7.000 | 0 | NO |" in markdown
    assert "| bare gRPC grant+txn+revoke | 2.47x | 2.47x | 2.47x | 2.47x |" in markdown
    assert "| 1 | 2,000 | 1,000 | 2.00x | 0.60 | 0.50 | 0.40 | 0.60 |" in markdown
    assert "| 4 | 3,000 | 2,500 | 1.20x | 1.20 | 0.90 | 0.90 | 1.00 |" in markdown
    assert "each process runs 64 tasks" in markdown
    assert "| python3-etcd3 Lock | 200.0 | 400.0 | 180.0 | 3 | 1 | 0.75x | 0.50x |" in markdown
    assert len(tables(results)) == 9


def test_chart_is_a_png(results: dict[str, Any], tmp_path: Path) -> None:
    # matplotlib comes with the bench extra, not with the test one.
    pytest.importorskip("matplotlib", reason="the chart needs the bench extra (matplotlib)")
    from benchmarks.bench.chart import write_chart

    write_chart(results, tmp_path / "results.png")
    assert (tmp_path / "results.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.skipif(not os.environ.get("BENCH_SMOKE"), reason="minutes long: set BENCH_SMOKE=1")
@pytest.mark.timeout(900)
def test_quick_run_end_to_end(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--quick", "--out", str(tmp_path)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Goals of issue 9" in run.stdout
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["errors"] == []
    assert written["calls"]["acquire (free key)"]["raft_writes"] is not None


@pytest.mark.timeout(300)
def test_held_keys_benchmark_holds_detects_and_loses_none() -> None:
    # Small: the script's every step, not its figures (those are the full run's).
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.held_keys", "--keys", "300", "--seconds", "0.5"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for figure in ("take", "detection ready", "memory per held key", "2 CPU hogs"):
        assert figure in run.stdout
    assert "lost 0, not taken 0" in run.stdout
