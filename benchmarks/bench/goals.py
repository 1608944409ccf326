"""The goals of issue 9, read off a results dict: measured, target, met."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .peers.bare import NAME as BARE
from .peers.etcd3_lock import NAME as ETCD3
from .peers.ours import NAME as OURS
from .peers.redis_lock import NAME as REDIS
from .stats import ratio


@dataclass(frozen=True)
class Goal:
    name: str
    target: str
    measured: float | None
    met: bool | None  # None when the figure could not be measured

    def as_dict(self) -> dict[str, Any]:
        return {
            "goal": self.name,
            "target": self.target,
            "measured": self.measured,
            "met": self.met,
        }


def _goal(name: str, target: str, measured: float | None, ok: Callable[[float], bool]) -> Goal:
    return Goal(name, target, measured, None if measured is None else ok(measured))


def _get(results: dict[str, Any], *path: str) -> Any:
    node: Any = results
    for step in path:
        if not isinstance(node, dict) or step not in node:
            return None
        node = node[step]
    return node


def _hold_case(results: dict[str, Any], leases: int, ttl_s: float) -> dict[str, Any] | None:
    for case in results.get("keepalive", []):
        if case["leases"] == leases and case["ttl_s"] == ttl_s:
            return dict(case)
    return None


def fastest_etcd_peer(results: dict[str, Any]) -> tuple[str, float] | None:
    """The etcd lock library with the lowest sequential cycle p50 (not ours, bare or Redis)."""
    peers = [
        (name, figures["p50_ms"])
        for name, figures in (results.get("cycle") or {}).items()
        if name not in (OURS, BARE, REDIS)
    ]
    return min(peers, key=lambda peer: peer[1]) if peers else None


def evaluate(results: dict[str, Any]) -> list[Goal]:
    calls = results.get("calls", {})
    fastest = fastest_etcd_peer(results)
    our_cycle = _get(results, "cycle", OURS, "p50_ms")
    top = str(max((int(t) for t in _get(results, "throughput", OURS) or {}), default=512))
    ours_top = _get(results, "throughput", OURS, top, "cycles_per_s")
    big = _hold_case(results, 10_000, 15.0)
    short = _hold_case(results, 5_000, 3.0)

    def writes(call: str) -> float | None:
        value = _get(calls, call, "raft_writes")
        return None if value is None else float(value)

    return [
        _goal("acquire p50 / Txn put p50", "<= 1.3",
              _get(calls, "acquire (free key)", "p50_vs_floor"), lambda v: v <= 1.3),
        _goal("acquire (free key): raft writes", "1",
              writes("acquire (free key)"), lambda v: v <= 1.05),
        # The issue: "a losing racer: one round trip, no write it has to undo". Its one
        # Txn is a raft round (etcd proposes any Txn that may write), nothing more.
        _goal("acquire (held by other): raft writes", "<= 1, none to undo",
              writes("acquire (held by other)"), lambda v: v <= 1.05),
        _goal("release p50 / Txn put p50", "<= 1.2",
              _get(calls, "release_lease", "p50_vs_floor"), lambda v: v <= 1.2),
        _goal("release: raft writes", "1", writes("release_lease"), lambda v: v <= 1.05),
        _goal("transfer: raft writes", "<= 2", writes("transfer_lease"), lambda v: v <= 2.05),
        _goal("renew (same TTL): raft writes", "0",
              writes("renew_lease (same TTL)"), lambda v: v <= 0.05),
        _goal(f"cycle: {fastest[0] if fastest else 'fastest etcd peer'} p50 / ours",
              ">= 1.3", ratio(fastest[1] if fastest else None, our_cycle), lambda v: v >= 1.3),
        _goal(f"{top} tasks: ours / bare loop cycles/s", ">= 2",
              ratio(ours_top, _get(results, "throughput", BARE, top, "cycles_per_s")),
              lambda v: v >= 2),
        _goal(f"{top} tasks: ours / python3-etcd3 Lock cycles/s", ">= 5",
              ratio(ours_top, _get(results, "throughput", ETCD3, top, "cycles_per_s")),
              lambda v: v >= 5),
        _goal("10,000 leases @ 15 s: CPU, share of one core", "< 0.05",
              _get(big, "idle", "cpu_per_s") if big else None, lambda v: v < 0.05),
        _goal("10,000 leases @ 15 s: lost (idle + loaded)", "0",
              None if big is None else big["lost_while_taking"] + big["idle"]["lost"]
              + big["loaded"]["lost"] + big["not_taken"], lambda v: v == 0),
        _goal("5,000 leases @ 3 s, two CPU hogs: lost", "0",
              None if short is None else short["lost_while_taking"] + short["idle"]["lost"]
              + short["loaded"]["lost"] + short["not_taken"], lambda v: v == 0),
        _goal("takeover p50 ms", "< 15", _get(results, "takeover", "p50_ms"), lambda v: v < 15),
        _goal("one-shot process: ours / python3-etcd3 Lock wall p50", "<= 0.8",
              _get(results, "oneshot", ETCD3, "ours_vs_it"), lambda v: v <= 0.8),
        _goal("one-shot process: raft writes, its lease freed", "<= 3",
              _get(results, "oneshot", OURS, "raft_writes"), lambda v: v <= 3),
    ]  # fmt: skip
