"""Latency figures, ratios and CPU time: the arithmetic every section shares."""

from __future__ import annotations

import math
import os
import resource
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: with fewer than 100 samples, p99 is the maximum."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class Latency:
    n: int
    p50_ms: float
    p99_ms: float
    mean_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Latency:
        return cls(
            n=len(seconds),
            p50_ms=percentile(seconds, 50) * 1000,
            p99_ms=percentile(seconds, 99) * 1000,
            mean_ms=statistics.fmean(seconds) * 1000,
        )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; ``None`` when either is unknown or the divisor is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` cut into ``parts`` near-equal counts (for interleaved passes)."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def cpu_seconds_self() -> float:
    """CPU time of this process, all threads (gRPC's and the tokio runtime's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_seconds_of(pid: int | None) -> float | None:
    """CPU time of another process (the etcd we started) from /proc; None elsewhere."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # After the command name (which may hold spaces): utime, stime are 12th, 13th.
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds per wall second of the client and of etcd over one window.

    The client is this process, or the child process ``client_pid`` names.
    """

    def __init__(self, etcd_pid: int | None, client_pid: int | None = None) -> None:
        self._etcd_pid = etcd_pid
        self._client_pid = client_pid
        self._client = self._client_seconds()
        self._etcd = cpu_seconds_of(etcd_pid)

    def _client_seconds(self) -> float | None:
        return cpu_seconds_self() if self._client_pid is None else cpu_seconds_of(self._client_pid)

    def per_second(self, wall_s: float) -> tuple[float | None, float | None]:
        """(client's, etcd's) CPU seconds per second since the meter was made."""
        return (
            _rate(self._client, self._client_seconds(), wall_s),
            _rate(self._etcd, cpu_seconds_of(self._etcd_pid), wall_s),
        )


def _rate(before: float | None, after: float | None, wall_s: float) -> float | None:
    return None if before is None or after is None else (after - before) / wall_s
