"""The history checker: what a chaos run's recorded operations say about safety.

Pure: it reads records (dicts, as the workers write them to JSONL) and returns a
:class:`Report`. Times are ``time.monotonic()`` seconds, comparable across the
processes of one machine (Linux's CLOCK_MONOTONIC is system-wide).

Records (``op`` field), all with ``worker``, ``key`` and ``token`` where they apply:

- ``acquire``: ``start``, ``end``, ``outcome`` ("ok", "held" or "error: ...");
- ``etcd_write`` / ``ext_write``: a fenced write to the register in etcd or to the
  register outside etcd; ``start``, ``end``, ``remaining`` (``lease.remaining()`` read
  at ``start``), ``outcome`` ("ok", "rejected" or "error: ...");
- ``release`` / ``transfer``: acknowledged ends of a tenure (``end``; ``to`` for a
  transfer), followed by ``read_owner`` (``owner`` read just after, ``after``);
- ``lost``: the holder saw its tenure end: ``at``, ``reason``, ``deadline`` (what its
  own clock still promised, from the last ``remaining()`` reading).

The register outside etcd logs what it decided (``ext_log``: key, token, worker,
accepted, at), the
nemesis what it did (``faults``: kind, start, heal, ``leader`` when the leader was hit).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from etcd_leases.etcd.kept_lease import LEASE_NOT_FOUND
from etcd_leases.etcd.version import has_bug_15247

Record = dict[str, Any]

# How long after a stalled leader resumes etcd bug 15247 may still delete keys early.
BUG_15247_WINDOW = 5.0
# Fault kinds that stall an etcd leader (the trigger of bug 15247).
LEADER_STALLS = frozenset({"pause_leader", "partition_leader"})
# Reasons a holder gives when etcd, not the holder, ended the tenure: the key's watch
# saw it deleted, or a keep-alive was told the lease is gone.
DELETED_BY_ETCD = ("deleted or expired", LEASE_NOT_FOUND)


@dataclass(frozen=True)
class Finding:
    kind: str
    key: str
    detail: str
    #: The stretch of time whose history explains it (printed with the summary).
    around: tuple[float, float] | None = field(default=None, compare=False)


@dataclass
class Report:
    violations: list[Finding] = field(default_factory=list)
    #: Early deletions by etcd right after a leader stall, on a version with bug 15247.
    bug_15247: list[Finding] = field(default_factory=list)
    #: Not safety, but worth reading (liveness, notes).
    notes: list[Finding] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    #: The history around the first violations: what a failed CI run leaves to read.
    context: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"{name}: {value}" for name, value in self.figures.items()]
        for title, findings in (
            ("SAFETY VIOLATIONS", self.violations),
            ("etcd bug 15247 (early deletions after a leader stall)", self.bug_15247),
            ("notes", self.notes),
        ):
            lines.append(f"{title}: {len(findings)}")
            lines += [f"  [{f.kind}] key={f.key!r}: {f.detail}" for f in findings[:20]]
        return "\n".join(lines + self.context)


@dataclass
class Tenure:
    worker: str
    key: str
    token: int
    acquired_at: float
    last_valid_act: float | None = None  # the last act with remaining() > 0
    early_deletion: Record | None = None  # a loss etcd caused before the holder's deadline
    released_at: float | None = None  # when its holder began to release it
    lease: int = 0  # the lease the tenure's key was put under (0: unknown)


def _tenures(records: Sequence[Record]) -> dict[tuple[str, int], Tenure]:
    tenures: dict[tuple[str, int], Tenure] = {}
    for record in records:
        # A holder that lost its tenure on its own clock while etcd kept the key may
        # acquire it again: the same tenure (same token), held since the first time.
        if record["op"] == "acquire" and record["outcome"] == "ok":
            tenures.setdefault(
                (record["key"], record["token"]),
                Tenure(
                    record["worker"],
                    record["key"],
                    record["token"],
                    record["end"],
                    lease=record.get("lease", 0),
                ),
            )
    for record in records:
        tenure = tenures.get((record.get("key", ""), record.get("token") or 0))
        if tenure is None or record.get("worker") != tenure.worker:
            continue
        if record["op"] in ("etcd_write", "ext_write") and record["remaining"] > 0:
            tenure.last_valid_act = max(tenure.last_valid_act or 0.0, record["start"])
        elif record["op"] == "lost" and _deleted_early(record):
            tenure.early_deletion = tenure.early_deletion or record
        elif record["op"] == "release":
            tenure.released_at = record["start"]
    for tenure in tenures.values():
        deleted, released = tenure.early_deletion, tenure.released_at
        if deleted is not None and released is not None and deleted["at"] >= released:
            tenure.early_deletion = None  # the holder's own release, seen by its watch
    return tenures


def _recent_stall(faults: Sequence[Record], at: float) -> Record | None:
    """The leader stall that healed last before ``at``, within the bug's window.

    Half a second of slack before the heal: the member runs again a moment before the
    nemesis notes the time.
    """
    stalls = [
        f
        for f in faults
        if f["kind"] in LEADER_STALLS
        and f["heal"] - 0.5 <= at <= f["heal"] + BUG_15247_WINDOW
        # The bug is the stalled leader revoking leases it judged expired: it counted them.
        and (f.get("expired") or 0) > 0
    ]
    return max(stalls, key=lambda f: f["heal"], default=None)


@dataclass(frozen=True)
class Sent:
    """The revokes and deletes the workers' library sent: a loss it caused is ours.

    Not the revokes a worker saw sent once its tenures on that lease were lost
    (``sent_revoke_after_loss``): the library clearing up, never a cause.
    """

    revoked: dict[int, tuple[float, str]]
    deleted: dict[str, list[tuple[float, str]]]

    @classmethod
    def of(cls, records: Sequence[Record]) -> Sent:
        revoked: dict[int, tuple[float, str]] = {}
        deleted: dict[str, list[tuple[float, str]]] = defaultdict(list)
        for record in records:
            if record["op"] == "sent_revoke":
                revoked.setdefault(record["lease"], (record["at"], record["worker"]))
            elif record["op"] == "sent_delete":
                deleted[record["key"]].append((record["at"], record["worker"]))
        return cls(revoked, deleted)

    def before(self, tenure: Tenure, at: float) -> str | None:
        """What the library sent that could have ended the tenure before ``at`` (its
        lease revoked, its key deleted after the tenure began), or None; an unknown
        lease is never excused."""
        if not tenure.lease:
            return "its lease is unknown"
        revoked_at, by = self.revoked.get(tenure.lease, (math.inf, ""))
        if revoked_at < at:
            return f"{by}'s library revoked its lease {tenure.lease:x} at {revoked_at:.3f}"
        for sent_at, by in self.deleted.get(tenure.key, []):
            if tenure.acquired_at <= sent_at < at:
                return f"{by}'s library sent a delete of the key at {sent_at:.3f}"
        return None


def _last_fault(faults: Sequence[Record], at: float) -> str:
    """The fault that began last before ``at``, for a finding's detail."""
    begun = [f for f in faults if f["start"] <= at]
    if not begun:
        return "no fault had begun"
    last = max(begun, key=lambda f: f["start"])
    return (
        f"the last fault before: {last['kind']} of {last.get('target', '?')}, begun "
        f"{at - last['start']:.3f} s and healed {at - last['heal']:.3f} s before"
    )


def _deleted_early(lost: Record) -> bool:
    """The key vanished (etcd's doing) while the holder's clock still gave it time."""
    by_etcd = any(reason in lost["reason"] for reason in DELETED_BY_ETCD)
    return by_etcd and lost["at"] < lost["deadline"]


def check_overlaps(
    tenures: Iterable[Tenure],
    faults: Sequence[Record],
    version: str,
    report: Report,
    sent: Sent,
) -> None:
    """Two tenures of a key its holders both believed valid at once."""
    by_key: dict[str, list[Tenure]] = defaultdict(list)
    for tenure in tenures:
        by_key[tenure.key].append(tenure)
    for key, held in by_key.items():
        held.sort(key=lambda t: t.acquired_at)
        for i, earlier in enumerate(held):
            if earlier.last_valid_act is None:
                continue
            for later in held[i + 1 :]:
                if later.acquired_at >= earlier.last_valid_act:
                    continue
                detail = (
                    f"{earlier.worker} (token {earlier.token}) acted with remaining() > 0 at "
                    f"{earlier.last_valid_act:.3f}, after {later.worker} acquired it (token "
                    f"{later.token}) at {later.acquired_at:.3f}"
                )
                stall = _recent_stall(faults, later.acquired_at)
                deleted = earlier.early_deletion
                if (
                    deleted is not None
                    and stall is not None
                    and has_bug_15247(version)
                    and sent.before(earlier, deleted["at"]) is None
                ):
                    report.bug_15247.append(Finding("overlap after early deletion", key, detail))
                else:
                    around = (later.acquired_at - 1.0, earlier.last_valid_act + 0.5)
                    report.violations.append(
                        Finding("overlapping tenures", key, detail, around=around)
                    )


def check_early_deletions(
    tenures: Iterable[Tenure],
    faults: Sequence[Record],
    version: str,
    report: Report,
    sent: Sent,
) -> None:
    """Keys etcd deleted while their holders' clocks still gave them time."""
    for tenure in tenures:
        lost = tenure.early_deletion
        if lost is None:
            continue
        stall = _recent_stall(faults, lost["at"])
        detail = (
            f"{tenure.worker} (token {tenure.token}) saw {lost['reason']!r} at {lost['at']:.3f}, "
            f"{lost['deadline'] - lost['at']:.3f} s before its own deadline"
        )
        ours = sent.before(tenure, lost["at"])
        if stall is not None and has_bug_15247(version) and ours is None:
            detail += (
                f"; {stall['kind']} healed {lost['at'] - stall['heal']:.3f} s before, and the "
                f"stalled leader revoked {stall['expired']} lease(s) it judged expired"
            )
            report.bug_15247.append(Finding("early deletion", tenure.key, detail))
        else:
            cause = ours or f"nothing the library sent could end it (lease {tenure.lease:x})"
            detail += f"; {cause}; {_last_fault(faults, lost['at'])}"
            around = (tenure.acquired_at - 1.0, lost["at"] + 0.5)
            report.violations.append(Finding("early deletion", tenure.key, detail, around=around))


def check_etcd_register(
    records: Sequence[Record], tenures: dict[tuple[str, int], Tenure], report: Report
) -> None:
    """Fenced etcd writes accepted out of token order or after a newer tenure began."""
    accepted = [r for r in records if r["op"] == "etcd_write" and r["outcome"] == "ok"]
    newest: dict[str, list[Tenure]] = defaultdict(list)
    for tenure in tenures.values():
        newest[tenure.key].append(tenure)
    for write in accepted:
        for other in newest[write["key"]]:
            if other.token > write["token"] and other.acquired_at < write["start"]:
                report.violations.append(
                    Finding(
                        "write from a superseded tenure",
                        write["key"],
                        f"{write['worker']} wrote with token {write['token']} at "
                        f"{write['start']:.3f}, after token {other.token} was acquired at "
                        f"{other.acquired_at:.3f}",
                    )
                )
                break
    _check_order(
        "etcd register", [(w["key"], w["token"], w["start"], w["end"]) for w in accepted], report
    )


def check_ext_register(
    records: Sequence[Record], ext_log: Sequence[Record], report: Report
) -> None:
    """What the register outside etcd accepted against the tokens the library granted.

    The register accepts a token equal to the highest it saw, so it cannot tell two
    holders apart if the library gave them one token; and it refuses a holder whose
    token the library made lower than one already in use. Both are the library's
    faults: a token is one tenure, and tokens only grow.
    """
    accepted = sorted((e for e in ext_log if e["accepted"]), key=lambda e: e["at"])
    writers: dict[tuple[str, int], set[str]] = defaultdict(set)
    by_key: dict[str, list[Record]] = defaultdict(list)
    for entry in accepted:
        writers[entry["key"], entry["token"]].add(entry["worker"])
        by_key[entry["key"]].append(entry)
    for (key, token), workers in writers.items():
        if len(workers) > 1:
            report.violations.append(
                Finding(
                    "one token, two holders",
                    key,
                    f"outside register accepted token {token} from {', '.join(sorted(workers))}",
                )
            )
    times = {key: [e["at"] for e in entries] for key, entries in by_key.items()}
    highest = {
        key: list(itertools.accumulate((e["token"] for e in entries), max))
        for key, entries in by_key.items()
    }
    for record in records:
        if record["op"] != "acquire" or record["outcome"] != "ok":
            continue
        key, token = record["key"], record["token"]
        before = bisect.bisect_left(times.get(key, []), record["start"])
        if before and highest[key][before - 1] > token:
            report.violations.append(
                Finding(
                    "token lower than one in use",
                    key,
                    f"{record['worker']} acquired token {token} in a call begun at "
                    f"{record['start']:.3f}, after the outside register had accepted "
                    f"token {highest[key][before - 1]}",
                )
            )


def _check_order(
    where: str, writes: Sequence[tuple[str, int, float, float]], report: Report
) -> None:
    """A write with a lower token must not begin after one with a higher token ended."""
    by_key: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for key, token, start, end in writes:
        by_key[key].append((token, start, end))
    for key, items in by_key.items():
        by_end = sorted(items, key=lambda item: item[2])
        ends = [end for _, _, end in by_end]
        highest = list(itertools.accumulate((token for token, _, _ in by_end), max))
        for token, start, _ in items:
            done = bisect.bisect_left(ends, start)  # writes that ended before this began
            if done and highest[done - 1] > token:
                report.violations.append(
                    Finding(
                        "write accepted out of token order",
                        key,
                        f"{where} accepted token {token} after token {highest[done - 1]}",
                    )
                )


def check_acknowledged_ends(records: Sequence[Record], report: Report) -> None:
    """After an acknowledged release or transfer, the key must not still be the holder's."""
    for record in records:
        if record["op"] != "read_owner":
            continue
        if record["owner"] == record["worker"]:
            report.violations.append(
                Finding(
                    f"acknowledged {record['after']} not reflected",
                    record["key"],
                    f"{record['worker']} read itself as owner right after its {record['after']} "
                    f"(token {record['token']}) returned",
                )
            )
        elif record["after"] == "transfer" and record["owner"] != record["to"]:
            report.notes.append(
                Finding(
                    "transfer read back",
                    record["key"],
                    f"read {record['owner']!r} right after a transfer to {record['to']!r}",
                )
            )


def recovery_times(records: Sequence[Record], faults: Sequence[Record]) -> dict[str, float]:
    """Per kind of fault, the longest time from its healing to the next successful acquire."""
    acquired = sorted(r["end"] for r in records if r["op"] == "acquire" and r["outcome"] == "ok")
    longest: dict[str, float] = {}
    for fault in faults:
        following = [t for t in acquired if t >= fault["heal"]]
        if following:
            delay = following[0] - fault["heal"]
            longest[fault["kind"]] = max(longest.get(fault["kind"], 0.0), delay)
    return longest


_CONTEXT_FINDINGS = 3  # violations whose history is printed
_CONTEXT_LINES = 60  # records printed per violation, at most


def _when(record: Record) -> float:
    """When a record's operation began (a fault record: when it began)."""
    for name in ("start", "at", "end"):
        if name in record:
            return float(record[name])
    return 0.0


def history_around(
    finding: Finding, records: Sequence[Record], faults: Sequence[Record]
) -> list[str]:
    """The faults and the records of the finding's key (and every revoke sent, after
    a loss too) in its stretch of time, in time order."""
    assert finding.around is not None
    begin, end = finding.around
    lines = [f"history around [{finding.kind}] key={finding.key!r}, {begin:.3f} to {end:.3f}:"]
    for fault in faults:
        if fault["start"] <= end and fault["heal"] >= begin:
            lines.append(f"  {fault['start']:.3f}-{fault['heal']:.3f} fault {fault}")
    shown = [
        r
        for r in records
        if begin <= _when(r) <= end
        and (r.get("key") == finding.key or r["op"].startswith("sent_revoke"))
    ]
    for record in sorted(shown, key=_when)[:_CONTEXT_LINES]:
        lines.append(f"  {_when(record):.3f} {record}")
    return lines


def check(
    records: Sequence[Record],
    ext_log: Sequence[Record],
    faults: Sequence[Record],
    leases_left: int,
    etcd_version: str,
) -> Report:
    report = Report()
    tenures = _tenures(records)
    sent = Sent.of(records)
    check_overlaps(tenures.values(), faults, etcd_version, report, sent)
    check_early_deletions(tenures.values(), faults, etcd_version, report, sent)
    check_etcd_register(records, tenures, report)
    check_ext_register(records, ext_log, report)
    check_acknowledged_ends(records, report)
    for finding in [f for f in report.violations if f.around][:_CONTEXT_FINDINGS]:
        report.context += history_around(finding, records, faults)
    if leases_left:
        report.violations.append(
            Finding("etcd leases left", "*", f"{leases_left} lease(s) left when the run ended")
        )
    ops = Counter(f"{r['op']} {r.get('outcome', '')}".split(":")[0].strip() for r in records)
    lost = Counter(r["reason"].split(":")[0] for r in records if r["op"] == "lost")
    recovery = recovery_times(records, faults)
    report.figures = {
        "etcd": etcd_version,
        "faults": dict(Counter(f["kind"] for f in faults)),
        "operations": dict(sorted(ops.items())),
        "tenures": len(tenures),
        "tenures lost (by reason)": dict(lost),
        "outside register accepted/rejected": (
            sum(1 for e in ext_log if e["accepted"]),
            sum(1 for e in ext_log if not e["accepted"]),
        ),
        "leases left": leases_left,
        "longest heal -> next acquire (s)": {k: round(v, 3) for k, v in recovery.items()},
        "violations": len(report.violations),
        "bug 15247 early deletions": len(report.bug_15247),
    }
    return report
