"""The sizes of one run: full, or ``--quick`` (a smoke run of every section)."""

from __future__ import annotations

from dataclasses import dataclass

# Long enough that no lease expires by itself while a latency section runs.
TTL_MS = 15_000
# Rounds run before anything is recorded, so connection set-up is not timed.
WARMUP_ROUNDS = 10
# Acquisitions in flight at once while the keep-alive section takes its leases:
# enough to fill the pipe, few enough that no call waits long behind the others.
ADMISSION = 64
# Rounds of the one-shot section in a full run (and of ``python -m benchmarks.oneshot``).
ONESHOT_ROUNDS = 20


@dataclass(frozen=True)
class HoldCase:
    """``leases`` held through ``provider.hold`` with ``ttl_ms``, for a measured window."""

    leases: int
    ttl_ms: int


@dataclass(frozen=True)
class Config:
    rounds: int  # interleaved rounds of the floor and the contract calls
    counted_rounds: int  # rounds whose raft writes and RPCs are counted, call by call
    cycle_rounds: int  # sequential acquire+release cycles per peer
    passes: int  # interleaved passes the rounds above are split into
    concurrency: tuple[int, ...]
    seconds_per_level: float  # per peer, per concurrency level
    processes: tuple[int, ...]  # client process counts of the multi-process section
    oneshot_rounds: int  # interleaved rounds of fresh one-shot processes, per client
    process_tasks: int  # tasks in each client process
    hold_cases: tuple[HoldCase, ...]
    hold_window_s: float  # measured window, idle host and loaded host each
    takeovers: int
    racers: int
    races: int


FULL = Config(
    rounds=300,
    counted_rounds=30,
    cycle_rounds=300,
    passes=3,
    concurrency=(1, 16, 128, 512),
    seconds_per_level=3.0,
    processes=(1, 2, 4),
    process_tasks=64,
    hold_cases=(HoldCase(1_000, 15_000), HoldCase(10_000, 15_000), HoldCase(5_000, 3_000)),
    hold_window_s=10.0,
    takeovers=30,
    racers=20,
    races=10,
    oneshot_rounds=ONESHOT_ROUNDS,
)
QUICK = Config(
    rounds=60,
    counted_rounds=10,
    cycle_rounds=60,
    passes=3,
    concurrency=(1, 16, 128, 512),
    seconds_per_level=1.0,
    processes=(1, 2, 4),
    process_tasks=64,
    hold_cases=(HoldCase(1_000, 15_000), HoldCase(10_000, 15_000), HoldCase(5_000, 3_000)),
    hold_window_s=4.0,
    takeovers=10,
    racers=20,
    races=3,
    oneshot_rounds=5,
)
