"""The history checker catches each kind of violation in hand-made histories (no etcd)."""

from __future__ import annotations

from etcd_leases.etcd.kept_lease import DEADLINE_PASSED, LEASE_NOT_FOUND
from tests.chaos.checker import Record, Report, check

V = "3.4.23"


def acquire(worker: str, token: int, end: float, key: str = "k") -> Record:
    return {
        "op": "acquire",
        "worker": worker,
        "key": key,
        "token": token,
        "start": end - 0.01,
        "end": end,
        "outcome": "ok",
        "lease": 1000 + token,  # the tenure's lease, as the worker read it
    }


def write(
    op: str, worker: str, token: int, start: float, *, ok: bool = True, remaining: float = 1.0
) -> Record:
    outcome = "ok" if ok else "rejected"
    return {
        "op": op,
        "worker": worker,
        "key": "k",
        "token": token,
        "start": start,
        "end": start + 0.01,
        "remaining": remaining,
        "outcome": outcome,
    }


def ended(
    op: str, worker: str, token: int, at: float, owner: str | None, to: str | None = None
) -> list[Record]:
    done = {
        "op": op,
        "worker": worker,
        "key": "k",
        "token": token,
        "start": at - 0.005,
        "end": at,
        "outcome": "ok",
        "to": to,
    }
    read = {
        "op": "read_owner",
        "worker": worker,
        "key": "k",
        "token": token,
        "after": op,
        "owner": owner,
        "to": to,
    }
    return [done, read]


def lost(worker: str, token: int, at: float, reason: str, deadline: float) -> Record:
    return {
        "op": "lost",
        "worker": worker,
        "key": "k",
        "token": token,
        "at": at,
        "reason": reason,
        "deadline": deadline,
    }


def ext(worker: str, token: int, at: float, accepted: bool = True) -> Record:
    """A decision of the register outside etcd, as it logs them."""
    return {"key": "k", "token": token, "worker": worker, "accepted": accepted, "at": at}


CLEAN: list[Record] = [
    acquire("a", 10, 1.0),
    write("etcd_write", "a", 10, 1.1),
    write("ext_write", "a", 10, 1.2),
    *ended("release", "a", 10, 1.3, None),
    lost("a", 10, 1.3, "released by its holder", 3.0),
    acquire("b", 12, 1.4),
    write("etcd_write", "b", 12, 1.5),
    write("ext_write", "b", 12, 1.6),
    write("ext_write", "a", 10, 1.7, remaining=0.0),  # a paused holder, refused below
    *ended("transfer", "b", 12, 1.8, "b-heir", to="b-heir"),
    lost("b", 12, 1.8, "transferred to 'b-heir'", 3.5),
]
CLEAN_EXT = [ext("a", 10, 1.205), ext("b", 12, 1.605), ext("a", 10, 1.705, accepted=False)]
FAULTS = [{"kind": "kill_leader", "start": 0.2, "heal": 0.5}]


def run(
    records: list[Record],
    ext_log: list[Record] = CLEAN_EXT,
    faults: list[Record] = FAULTS,
    leases_left: int = 0,
    version: str = V,
) -> Report:
    return check(records, ext_log, faults, leases_left, version)


def kinds(report: Report) -> set[str]:
    return {finding.kind for finding in report.violations}


def test_a_clean_history_passes_with_its_figures() -> None:
    report = run(CLEAN)
    assert report.violations == [] and report.bug_15247 == []
    assert report.figures["tenures"] == 2
    assert report.figures["faults"] == {"kill_leader": 1}
    assert report.figures["longest heal -> next acquire (s)"] == {"kill_leader": 0.5}
    assert report.figures["outside register accepted/rejected"] == (2, 1)
    assert "SAFETY VIOLATIONS: 0" in report.summary()


def test_overlapping_tenures() -> None:
    # a still acted with time left after b had acquired the key.
    report = run([*CLEAN, write("etcd_write", "a", 10, 1.45, ok=False, remaining=0.5)])
    assert kinds(report) == {"overlapping tenures"}


def test_etcd_write_from_a_superseded_tenure() -> None:
    report = run([*CLEAN, write("etcd_write", "a", 10, 1.55, remaining=0.0)])
    assert kinds(report) == {"write from a superseded tenure", "write accepted out of token order"}


def test_one_token_granted_to_two_holders() -> None:
    # The library gave b the token a still held: the register accepts both (equal).
    records = [acquire("a", 10, 1.0), write("ext_write", "a", 10, 1.1)]
    records += [acquire("b", 10, 1.2), write("ext_write", "b", 10, 1.3)]
    records += [write("ext_write", "a", 10, 1.4)]
    ext_log = [ext("a", 10, 1.105), ext("b", 10, 1.305), ext("a", 10, 1.405)]
    report = run(records, ext_log=ext_log)
    assert kinds(report) == {"one token, two holders"}
    assert "accepted token 10 from a, b" in report.violations[0].detail


def test_a_token_lower_than_one_in_use() -> None:
    # b's acquire began after the register had accepted a's 12, and got 11.
    records = [acquire("a", 12, 1.0), write("ext_write", "a", 12, 1.1)]
    records += [*ended("release", "a", 12, 1.3, None), acquire("b", 11, 1.5)]
    records += [write("ext_write", "b", 11, 1.6, ok=False)]
    ext_log = [ext("a", 12, 1.105), ext("b", 11, 1.605, accepted=False)]
    report = run(records, ext_log=ext_log)
    assert kinds(report) == {"token lower than one in use"}
    # Had b's acquire begun before the register accepted 12, its 11 could be older.
    records[4] = acquire("b", 11, 1.1)
    assert kinds(run(records, ext_log=ext_log)) == set()


def test_release_and_transfer_not_reflected() -> None:
    records = [acquire("a", 10, 1.0), *ended("release", "a", 10, 1.3, "a")]
    records += [acquire("b", 12, 2.0), *ended("transfer", "b", 12, 2.3, "b", to="b-heir")]
    report = run(records, ext_log=[])
    assert kinds(report) == {
        "acknowledged release not reflected",
        "acknowledged transfer not reflected",
    }


def test_leases_left() -> None:
    assert kinds(run(CLEAN, leases_left=2)) == {"etcd leases left"}


def test_early_deletion_is_ours_unless_a_leader_stall_explains_it_on_an_affected_etcd() -> None:
    early = [
        acquire("a", 10, 1.0),
        write("ext_write", "a", 10, 1.1),
        lost("a", 10, 1.2, "the key was released, deleted or expired", 3.0),
    ]
    assert kinds(run(early, ext_log=[])) == {"early deletion"}
    stall = [{"kind": "pause_leader", "start": 0.1, "heal": 1.19, "target": "etcd0", "expired": 1}]
    report = run(early, ext_log=[], faults=stall)
    assert report.violations == []
    assert [f.kind for f in report.bug_15247] == ["early deletion"]
    assert "pause_leader healed 0.010 s before" in report.bug_15247[0].detail
    fixed = run(early, ext_log=[], faults=stall, version="3.5.13")
    assert kinds(fixed) == {"early deletion"} and fixed.bug_15247 == []
    # Only what the bug can do: the stalled leader revoked a lease it judged expired...
    quiet = [{**stall[0], "expired": 0}]
    assert kinds(run(early, ext_log=[], faults=quiet)) == {"early deletion"}
    # ...and never one the library revoked, or a key it deleted, before the loss.
    revoked = [*early, {"op": "sent_revoke", "worker": "a", "key": "", "token": None,
                        "at": 1.15, "lease": 1010}]  # fmt: skip
    assert kinds(run(revoked, ext_log=[], faults=stall)) == {"early deletion"}
    # Each says what ended it, and the fault before.
    (found,) = run(revoked, ext_log=[], faults=stall).violations
    assert "a's library revoked its lease 3f2 at 1.150" in found.detail
    assert "pause_leader of etcd0, begun 1.100 s and healed 0.010 s before" in found.detail
    deleted = [*early, {"op": "sent_delete", "worker": "b", "key": "k", "token": None,
                        "at": 1.15}]  # fmt: skip
    assert kinds(run(deleted, ext_log=[], faults=stall)) == {"early deletion"}
    (found,) = run(deleted, ext_log=[], faults=stall).violations
    assert "b's library sent a delete of the key at 1.150" in found.detail
    (found,) = run(early, ext_log=[], faults=quiet).violations
    assert "nothing the library sent could end it (lease 3f2)" in found.detail
    revoked_after = [*early, {"op": "sent_revoke", "worker": "a", "key": "", "token": None,
                              "at": 1.25, "lease": 1010}]  # fmt: skip
    assert run(revoked_after, ext_log=[], faults=stall).violations == []
    # A revoke the worker saw sent once its tenure was lost (a lost session lease's) is
    # no cause, though the worker's own record of the loss comes a moment later.
    cleared_up = [*early, {"op": "sent_revoke_after_loss", "worker": "a", "key": "",
                           "token": None, "at": 1.198, "lease": 1010}]  # fmt: skip
    report = run(cleared_up, ext_log=[], faults=stall)
    assert report.violations == [] and [f.kind for f in report.bug_15247] == ["early deletion"]
    # A keep-alive told the lease is gone counts as etcd's doing too; the holder's own
    # clock running out does not (that is the deadline, not early).
    early[-1] = lost("a", 10, 1.2, LEASE_NOT_FOUND, 3.0)
    assert kinds(run(early, ext_log=[])) == {"early deletion"}
    early[-1] = lost("a", 10, 3.0, DEADLINE_PASSED, 3.0)
    assert run(early, ext_log=[]).violations == []


def test_overlap_after_a_15247_deletion_is_reported_separately() -> None:
    records = [
        acquire("a", 10, 1.0),
        lost("a", 10, 1.205, "the key was released, deleted or expired", 3.0),
        write("ext_write", "a", 10, 1.21, remaining=1.7),  # its clock still gave it time
        acquire("b", 12, 1.203),
    ]
    stall = [{"kind": "pause_leader", "start": 0.1, "heal": 1.19, "target": "etcd0", "expired": 2}]
    report = run(records, ext_log=[], faults=stall)
    assert report.violations == []
    assert {f.kind for f in report.bug_15247} == {"early deletion", "overlap after early deletion"}
    # The library revoked the lease itself: both are ours.
    revoked = [*records, {"op": "sent_revoke", "worker": "a", "key": "", "token": None,
                          "at": 1.2, "lease": 1010}]  # fmt: skip
    both = run(revoked, ext_log=[], faults=stall)
    assert kinds(both) == {"early deletion", "overlapping tenures"} and both.bug_15247 == []


def test_a_tenure_acquired_again_by_its_holder_is_one_tenure() -> None:
    # w lost it on its own clock (a frozen leader), etcd kept the key, w took it back.
    records = [
        acquire("a", 10, 1.0),
        write("ext_write", "a", 10, 1.1),
        lost("a", 10, 3.0, "deadline passed without a renewal", 3.0),
        acquire("a", 10, 3.5),
        write("ext_write", "a", 10, 3.6),
        *ended("release", "a", 10, 3.7, None),
        acquire("b", 12, 3.8),
        write("ext_write", "b", 12, 3.9),
    ]
    report = run(records, ext_log=[ext("a", 10, 1.105), ext("a", 10, 3.605), ext("b", 12, 3.905)])
    assert report.violations == []
    assert report.figures["tenures"] == 2


def test_the_holders_own_release_seen_by_its_watch_is_not_an_early_deletion() -> None:
    records = [
        acquire("a", 10, 1.0),
        write("ext_write", "a", 10, 1.1),
        *ended("release", "a", 10, 1.3, None),  # began at 1.295
        lost("a", 10, 1.297, "the key was released, deleted or expired", 3.0),
    ]
    assert run(records, ext_log=[]).violations == []


def test_a_violation_prints_the_history_around_it() -> None:
    records = [
        acquire("a", 10, 1.0),
        acquire("b", 3, 0.2, key="other"),  # another key: not shown
        {"op": "sent_revoke", "worker": "b", "key": "", "token": None, "at": 1.1, "lease": 7},
        lost("a", 10, 1.2, "the key was released, deleted or expired", 3.0),
        acquire("b", 12, 9.0),  # long after: not shown
    ]
    faults = [
        {"kind": "defrag", "start": 0.5, "heal": 0.6, "target": "etcd1"},
        {"kind": "kill_leader", "start": 5.0, "heal": 6.0, "target": "etcd0"},
    ]
    summary = run(records, ext_log=[], faults=faults).summary()
    history = summary[summary.index("history around [early deletion] key='k', 0.000 to 1.700") :]
    assert "'kind': 'defrag'" in history and "kill_leader" not in history
    shown = [line.split()[0] for line in history.splitlines()[1:]]
    assert shown == ["0.500-0.600", "0.990", "1.100", "1.200"]
