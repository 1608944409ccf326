"""``results.png``: latency of each call against the floor; cycles/s by concurrency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


def write_chart(results: dict[str, Any], path: Path) -> None:
    figure, (calls_axis, throughput_axis) = plt.subplots(1, 2, figsize=(15, 6))

    floor, calls = results["floor"], results["calls"]
    labels = [*floor, *calls]
    p50 = [row["p50_ms"] for row in (*floor.values(), *calls.values())]
    p99 = [row["p99_ms"] for row in (*floor.values(), *calls.values())]
    colors = ["tab:gray"] * len(floor) + ["tab:blue"] * len(calls)
    positions = range(len(labels))
    calls_axis.barh(positions, p99, color="lightgray", label="p99")
    calls_axis.barh(positions, p50, color=colors, label="p50 (gray: bare gRPC floor)")
    calls_axis.set_yticks(list(positions), labels, fontsize=8)
    calls_axis.invert_yaxis()
    calls_axis.set_xlabel("ms")
    calls_axis.set_title("Latency by operation against the floor")
    calls_axis.legend(fontsize=8)

    for name, by_level in results["throughput"].items():
        levels = sorted(by_level, key=int)
        throughput_axis.plot(
            [int(t) for t in levels],
            [by_level[t]["cycles_per_s"] for t in levels],
            marker="o",
            linewidth=3 if name == "etcd_leases" else 1.5,
            label=name,
        )
    throughput_axis.set_xscale("log", base=2)
    levels_run = sorted({int(t) for by_level in results["throughput"].values() for t in by_level})
    throughput_axis.set_xticks(levels_run, [str(t) for t in levels_run])
    throughput_axis.set_yscale("log")
    throughput_axis.set_xlabel("concurrent tasks (threads for python3-etcd3)")
    throughput_axis.set_ylabel("acquire+release cycles/s, distinct keys")
    throughput_axis.set_title("Cycles/s by concurrency")
    throughput_axis.legend(fontsize=8)
    throughput_axis.grid(True, which="both", alpha=0.3)

    figure.suptitle(f"etcd_leases benchmark, {results['meta']['run']}: {results['meta']['etcd']}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
