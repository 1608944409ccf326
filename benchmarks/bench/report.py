"""The results as tables: printed, and written as ``results.json`` and ``results.md``.

Tables are built once from the results dict (rows of strings), so the console and
the Markdown file show the same figures.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .goals import evaluate
from .peers.bare import NAME as BARE
from .peers.ours import NAME as OURS
from .stats import ratio


@dataclass(frozen=True)
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]
    notes: tuple[str, ...] = ()


def fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:,.{digits}f}{suffix}"


def calls_table(results: dict[str, Any]) -> Table:
    rows = []
    for label, row in {**results["floor"], **results["calls"]}.items():
        rows.append([
            label, fmt(row["p50_ms"]), fmt(row["p99_ms"]), fmt(row["raft_writes"], 1),
            fmt(row["requests"], 1), row.get("floor", "(floor)"),
            fmt(row.get("p50_vs_floor"), 2, "x"),
        ])  # fmt: skip
    header = ["call", "p50 ms", "p99 ms", "raft writes", "requests", "against", "p50 ratio"]
    return Table("Contract calls against the floor (bare gRPC, same process)", header, rows)


def cycle_table(results: dict[str, Any]) -> Table:
    ours = results["cycle"].get(OURS, {}).get("p50_ms")
    rows = [
        [name, fmt(row["p50_ms"]), fmt(row["p99_ms"]), fmt(ratio(row["p50_ms"], ours), 2, "x")]
        for name, row in results["cycle"].items()
    ]
    header = ["client", "p50 ms", "p99 ms", "its p50 / ours"]
    notes = tuple(f"{name}: {row['does']}" for name, row in results["cycle"].items())
    return Table("Sequential acquire+release cycle (above 1: ours is faster)", header, rows, notes)


def throughput_table(results: dict[str, Any]) -> Table:
    levels = sorted({int(t) for by_level in results["throughput"].values() for t in by_level})
    ours = results["throughput"].get(OURS, {})
    rows = []
    for name, by_level in results["throughput"].items():
        cells = [fmt(by_level.get(str(t), {}).get("cycles_per_s"), 0) for t in levels]
        top = by_level.get(str(levels[-1]), {}) if levels else {}
        vs = ratio(ours.get(str(levels[-1]), {}).get("cycles_per_s"), top.get("cycles_per_s"))
        rows.append([
            name, *cells, fmt(vs, 2, "x"), fmt(top.get("cpu"), 2), fmt(top.get("etcd_cpu"), 2),
        ])  # fmt: skip
    top_label = levels[-1] if levels else "?"
    header = ["client", *(f"{t} tasks" for t in levels), f"ours / it @{top_label}",
              f"CPU @{top_label}", f"etcd CPU @{top_label}"]  # fmt: skip
    return Table("Cycles/s on distinct keys (CPU in seconds per second)", header, rows)


def throughput_ratio_table(results: dict[str, Any]) -> Table:
    levels = sorted({int(t) for by_level in results["throughput"].values() for t in by_level})
    ours = results["throughput"].get(OURS, {})

    def rate(by_level: dict[str, Any], tasks: int) -> float | None:
        value = by_level.get(str(tasks), {}).get("cycles_per_s")
        return None if value is None else float(value)

    rows = [
        [name, *(fmt(ratio(rate(ours, t), rate(by_level, t)), 2, "x") for t in levels)]
        for name, by_level in results["throughput"].items()
        if name != OURS
    ]
    header = ["ours / it", *(f"{t} tasks" for t in levels)]
    return Table("Cycles/s, ours against each client at the same concurrency", header, rows)


def processes_table(results: dict[str, Any]) -> Table:
    by_kind = results.get("processes", {})
    ours, bare = by_kind.get(OURS, {}), by_kind.get(BARE, {})
    rows = []
    for level in sorted({int(n) for figures in by_kind.values() for n in figures}):
        mine, floor = ours.get(str(level), {}), bare.get(str(level), {})
        rows.append([
            str(level), fmt(mine.get("cycles_per_s"), 0), fmt(floor.get("cycles_per_s"), 0),
            fmt(ratio(mine.get("cycles_per_s"), floor.get("cycles_per_s")), 2, "x"),
            fmt(mine.get("clients_cpu"), 2), fmt(mine.get("etcd_cpu"), 2),
            fmt(floor.get("clients_cpu"), 2), fmt(floor.get("etcd_cpu"), 2),
        ])  # fmt: skip
    header = ["processes", "ours cycles/s", "bare cycles/s", "ours / bare", "ours: clients CPU",
              "ours: etcd CPU", "bare: clients CPU", "bare: etcd CPU"]  # fmt: skip
    tasks = next((f["tasks_per_process"] for f in ours.values() if "tasks_per_process" in f), "?")
    notes = (f"each process runs {tasks} tasks on distinct keys; CPU in seconds per second: "
             "etcd is the shared ceiling where its CPU stops growing with processes",)  # fmt: skip
    return Table("Cycles/s from several client processes, one etcd", header, rows, notes)


def oneshot_table(results: dict[str, Any]) -> Table:
    rows = [
        [name, fmt(row["p50_ms"], 1), fmt(row["p99_ms"], 1), fmt(row["cpu_p50_ms"], 1),
         fmt(row["raft_writes"], 0), fmt(row["leases_left"], 0), fmt(row["ours_vs_it"], 2, "x"),
         fmt(row["ours_vs_it_cpu"], 2, "x")]
        for name, row in results.get("oneshot", {}).items()
    ]  # fmt: skip
    header = ["client", "wall p50 ms", "wall p99 ms", "CPU p50 ms", "raft writes",
              "leases left", "ours / it, wall", "ours / it, CPU"]  # fmt: skip
    notes = tuple(f"{name}: {row['does']}" for name, row in results.get("oneshot", {}).items())
    notes += ("each a fresh process: import, connect, take a free key, free it, exit",)
    return Table("Serverless one-shot, one process each (below 1: ours is faster)", header,
                 rows, notes)  # fmt: skip


def keepalive_table(results: dict[str, Any]) -> Table:
    rows = []
    for case in results["keepalive"]:
        for host in ("idle", "loaded"):
            window = case[host]
            rows.append([
                f"{case['leases']:,}", f"{case['ttl_s']:g}", host, fmt(window["cpu_per_s"], 3),
                fmt(window["etcd_cpu_per_s"], 3), fmt(window["requests_per_s"], 0),
                str(window["lost"]), fmt(case["taking_s"], 1),
                fmt(case.get("settling_s"), 1), str(case["lost_while_taking"] + case["not_taken"]),
            ])  # fmt: skip
    header = ["leases", "TTL s", "host", "CPU s/s", "etcd CPU s/s", "requests/s",
              "lost", "taking s", "settling s", "lost taking"]  # fmt: skip
    return Table("Keep-alive: leases held through provider.hold", header, rows)


def other_table(results: dict[str, Any]) -> Table:
    takeover, loss, race = results["takeover"], results["loss_detection"], results["races"]
    rows = [
        ["takeover: holder leaves hold -> waiter inside", fmt(takeover["p50_ms"]),
         fmt(takeover["p99_ms"])],
        ["loss: another client's transfer called -> lease.lost", fmt(loss["p50_ms"]),
         fmt(loss["p99_ms"])],
        [f"{race['racers']} providers race for one key: all answered",
         fmt(race["p50_ms"]), fmt(race["p99_ms"])],
    ]  # fmt: skip
    return Table("Takeover, loss detection, races", ["", "p50 ms", "p99 ms"], rows)


def goals_table(results: dict[str, Any]) -> Table:
    rows = []
    for goal in evaluate(results):
        met = "-" if goal.met is None else ("yes" if goal.met else "NO")
        rows.append([goal.name, fmt(goal.measured, 3), goal.target, met])
    return Table("Goals of issue 9", ["goal", "measured", "target", "met"], rows)


def tables(results: dict[str, Any]) -> list[Table]:
    return [
        calls_table(results),
        cycle_table(results),
        throughput_table(results),
        throughput_ratio_table(results),
        processes_table(results),
        keepalive_table(results),
        oneshot_table(results),
        other_table(results),
        goals_table(results),
    ]


def print_table(table: Table) -> None:
    """First column left-aligned, the figures right-aligned."""
    print(f"\n{table.title}")
    lines = (table.header, *table.rows)
    widths = [max(len(row[i]) for row in lines) for i in range(len(table.header))]
    for row in lines:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        print("  " + "  ".join(cells).rstrip())
    for note in table.notes:
        print(f"  - {note}")
    sys.stdout.flush()


def markdown(table: Table) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    aligns = ["---", *("---:" for _ in table.header[1:])]
    body = [line(table.header), line(aligns), *(line(row) for row in table.rows)]
    notes = "".join(f"- {note}\n" for note in table.notes)
    return f"### {table.title}\n\n" + "\n".join(body) + "\n" + (f"\n{notes}" if notes else "")


def write_markdown(results: dict[str, Any], path: Path) -> None:
    meta = results["meta"]
    head = [
        "# etcd_leases benchmark",
        "",
        f"- run: {meta['run']}, {meta['started']}",
        f"- etcd: {meta['etcd']}",
        f"- machine: {meta['machine']}; load average before {meta['load_before']},"
        f" after {meta['load_after']}",
        f"- python: {meta['python']}; packages: {meta['packages']}",
    ]
    if results.get("skipped"):
        head += [f"- skipped: {name}: {why}" for name, why in results["skipped"].items()]
    if results.get("errors"):
        head += [f"- ERROR: {error}" for error in results["errors"]]
    sections = "\n".join(markdown(table) for table in tables(results))
    path.write_text("\n".join(head) + "\n\n" + sections)


def write_json(results: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps({**results, "goals": [g.as_dict() for g in evaluate(results)]},
                               indent=2) + "\n")  # fmt: skip
