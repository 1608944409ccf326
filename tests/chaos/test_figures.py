"""The per-kind figures of a chaos run, on a hand-made history (no etcd)."""

from __future__ import annotations

from tests.chaos.checker import Record
from tests.chaos.figures import by_fault_kind


def record(op: str, time: float, outcome: str = "ok", **fields: object) -> Record:
    return {"op": op, "worker": "w0", "key": "k", "token": 1, "start": time, "end": time,
            "outcome": outcome, **fields}  # fmt: skip


def test_counts_recovery_and_what_workers_saw_while_it_lasted() -> None:
    faults = [
        {"kind": "quota_full", "start": 10.0, "heal": 12.0},
        {"kind": "quota_full", "start": 20.0, "heal": 21.0},
        {"kind": "defrag", "start": 30.0, "heal": 30.5},
    ]
    records = [
        record("tenure", 11.0, "error: BackendFull: etcd's database is full"),
        record("etcd_write", 11.5, "error: BackendFull: etcd's database is full"),
        record("lost", 20.5, at=20.5, reason="deadline passed without a renewal: 2 s"),
        record("acquire", 12.5),
        record("acquire", 21.25),
        record("tenure", 40.0, "error: BackendUnavailable: later"),  # during no fault
        record("acquire", 25.0, token=2),
        record("acquire", 26.0, token=3),  # held through the defrag
        record("release", 30.1, token=2),
        record("lost", 30.2, token=2, at=30.2, reason="the key was released"),  # its own
        record("lost", 30.3, token=4, at=30.3, reason="released by its holder"),  # its own
    ]
    assert by_fault_kind(records, faults) == {
        "defrag": {
            "count": 1,
            "recovery s (median/max)": "none after it",
            "held through": 1,
            "seen while it lasted": {},
        },
        "quota_full": {
            "count": 2,
            "recovery s (median/max)": "0.38/0.50",
            "held through": 0,
            "seen while it lasted": {
                "hold: BackendFull": 1,
                "fenced put: BackendFull": 1,
                "lost: deadline passed without a renewal": 1,
            },
        },
    }
