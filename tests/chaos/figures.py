"""Per kind of fault: how often it came, how long the workers took to recover, and what
they saw while it lasted (errors by call and type, losses their holders did not cause,
by reason; tenures held right through it). Not safety: the checker decides that; these
are the figures the README quotes."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from tests.chaos.checker import Record

# Records whose outcome may be an error ("error: Type: message"), by what the worker did.
_CALLS = {"acquire": "acquire", "tenure": "hold", "etcd_write": "fenced put"}
_CALLS |= {"release": "release", "transfer": "transfer"}
# The reason hold gives when its block ends (however it ends: an error in it, too).
OWN_RELEASE = "released by its holder"


Tenure = tuple[str, str, int]  # worker, key, token


def _ended_by_holder(records: Sequence[Record]) -> dict[Tenure, float]:
    """When each tenure's holder began to end it (a release or a transfer)."""
    ends: dict[Tenure, float] = {}
    for r in records:
        if r["op"] in ("release", "transfer"):
            tenure = (r["worker"], r["key"], r["token"])
            ends[tenure] = min(ends.get(tenure, r["start"]), r["start"])
    return ends


def _seen(record: Record, ended: dict[Tenure, float]) -> str | None:
    """What a worker saw, in a few words, if it was not plain success."""
    if record["op"] == "lost":
        own_end = ended.get((record["worker"], record["key"], record["token"]), 1e18)
        if record["at"] >= own_end or record["reason"] == OWN_RELEASE:
            return None  # its holder's own release or transfer
        return f"lost: {record['reason'].split(':')[0]}"
    outcome = str(record.get("outcome", ""))
    if record["op"] in _CALLS and outcome.startswith("error"):
        return f"{_CALLS[record['op']]}: {outcome.split(':')[1].strip()}"
    return None


def _during(record: Record, fault: Record) -> bool:
    """Whether the record's answer (its end: a tenure may begin before) came during it."""
    at = record.get("at", record.get("end", 0.0))
    return bool(fault["start"] <= at <= fault["heal"])


def _held_through(records: Sequence[Record], fault: Record, ended: dict[Tenure, float]) -> int:
    """Tenures acquired before the fault that nothing but their holder ended before it healed."""
    held = {
        (r["worker"], r["key"], r["token"])
        for r in records
        if r["op"] == "acquire" and r["outcome"] == "ok" and r["end"] < fault["start"]
    }
    gone = {
        (r["worker"], r["key"], r["token"])
        for r in records
        if r["op"] == "lost" and r["at"] <= fault["heal"]
    }
    return sum(1 for t in held - gone if ended.get(t, 1e18) > fault["heal"])


def by_fault_kind(records: Sequence[Record], faults: Sequence[Record]) -> dict[str, Any]:
    """``{kind: {"count", "recovery s (median/max)", "held through", "seen while it lasted"}}``.

    Recovery is from the heal to the next acquire that succeeded, by any worker.
    """
    acquired = sorted(r["end"] for r in records if r["op"] == "acquire" and r["outcome"] == "ok")
    ended = _ended_by_holder(records)
    delays: dict[str, list[float]] = defaultdict(list)
    held: Counter[str] = Counter()
    seen: dict[str, Counter[str]] = defaultdict(Counter)
    for fault in faults:
        following = [t for t in acquired if t >= fault["heal"]]
        if following:
            delays[fault["kind"]].append(following[0] - fault["heal"])
        held[fault["kind"]] += _held_through(records, fault, ended)
        seen[fault["kind"]].update(
            what for r in records if _during(r, fault) and (what := _seen(r, ended)) is not None
        )
    counts = Counter(f["kind"] for f in faults)
    return {
        kind: {
            "count": count,
            "recovery s (median/max)": (
                f"{statistics.median(delays[kind]):.2f}/{max(delays[kind]):.2f}"
                if delays[kind]
                else "none after it"
            ),
            "held through": held[kind],
            "seen while it lasted": dict(seen[kind].most_common()),
        }
        for kind, count in sorted(counts.items())
    }
