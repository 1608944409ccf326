"""The linearizability checker on hand-made histories of one key (times in seconds)."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import replace

import pytest

from etcd_leases import AcquireResult
from tests.linearizability.checker import DEFAULT_SLACK, check, check_key
from tests.linearizability.generate import OWNERS, valid_history
from tests.linearizability.history import (
    Answer,
    Call,
    History,
    Op,
    acquire,
    get_owner,
    release,
    renew,
    transfer,
)
from tests.linearizability.model import INITIAL, Timing, step_all
from tests.linearizability.report import explain

TTL = 10_000  # ms: long enough not to expire unless a test says so

Row = tuple[Call, float, float | None, Answer]


def won(owner: str, token: int, ttl_ms: int = TTL) -> AcquireResult:
    return AcquireResult(True, owner, token, ttl_ms)


def lost_to(holder: str) -> AcquireResult:
    return AcquireResult(False, holder)


def history(*rows: Row, client: str = "") -> History:
    made = History()
    for call, start, end, answer in rows:
        made.add("k", call, start, end, answer, client)
    return made


def linearizable(*rows: Row) -> bool | None:
    return check(history(*rows)).ok


HELD_BY_O1: list[Row] = [(acquire("o1", TTL), 0.0, 0.1, won("o1", 5))]


@pytest.mark.parametrize(
    "name, rows",
    [
        (
            "a read still sees a released owner",
            [*HELD_BY_O1, (release("o1"), 1.0, 1.1, None), (get_owner(), 1.2, 1.3, "o1")],
        ),
        (
            "a release is lost (an acquire after it is refused)",
            [
                *HELD_BY_O1,
                (release("o1"), 1.0, 1.1, None),
                (acquire("o2", TTL), 1.2, 1.3, lost_to("o1")),
            ],
        ),
        ("two owners", [*HELD_BY_O1, (acquire("o2", TTL), 1.0, 1.1, won("o2", 6))]),
        (
            "a transfer by a former owner",
            [
                *HELD_BY_O1,
                (transfer("o1", "o2", TTL), 1.0, 1.1, True),
                (transfer("o1", "o3", TTL), 1.2, 1.3, True),
            ],
        ),
        (
            "a token goes down",
            [
                *HELD_BY_O1,
                (release("o1"), 1.0, 1.1, None),
                (acquire("o2", TTL), 1.2, 1.3, won("o2", 4)),
            ],
        ),
        (
            "a token is reused",
            [
                *HELD_BY_O1,
                (release("o1"), 1.0, 1.1, None),
                (acquire("o2", TTL), 1.2, 1.3, won("o2", 5)),
            ],
        ),
        (
            "an owner's re-acquire moves its token back",
            [*HELD_BY_O1, (acquire("o1", TTL), 1.0, 1.1, won("o1", 4))],
        ),
        (
            "an expiry before the TTL",
            [(acquire("o1", 2000), 0.0, 0.1, won("o1", 5, 2000)), (get_owner(), 1.5, 1.6, None)],
        ),
        (
            "a renewal expires before its TTL",
            [
                (acquire("o1", 1000), 0.0, 0.1, won("o1", 5, 1000)),
                (renew("o1", 3000), 0.5, 0.6, True),
                (acquire("o2", TTL), 2.0, 2.1, won("o2", 6)),
            ],
        ),
        ("a renew by a non-owner", [*HELD_BY_O1, (renew("o2", TTL), 1.0, 1.1, True)]),
        ("a renew by the owner refused", [*HELD_BY_O1, (renew("o1", TTL), 1.0, 1.1, False)]),
        (
            "a refusal names another holder",
            [*HELD_BY_O1, (acquire("o2", TTL), 1.0, 1.1, lost_to("o3"))],
        ),
        (
            "a read placed inside the wrong call",
            [*HELD_BY_O1, (release("o1"), 1.0, 2.0, None), (get_owner(), 2.5, 2.6, "o1")],
        ),
    ],
)
def test_it_rejects(name: str, rows: list[Row]) -> None:
    assert linearizable(*rows) is False, name


# Issue 19, violation A: o1's re-acquire with another TTL from another provider moved
# its token on while o1's transfer ran; o1 held the key throughout; the transfer said False.
VIOLATION_A: list[Row] = [
    (acquire("o1", 2000), 0.0, 0.1, won("o1", 208, 2000)),
    (get_owner(), 1.0, 1.01, "o1"),
    (transfer("o1", "o4", 2000), 1.1, 1.5, False),
    (acquire("o1", 3000), 1.2, 1.3, won("o1", 213, 3000)),
    (get_owner(), 1.6, 1.61, "o1"),
]

# Violation B: o2's acquire lost its first answer; its copy, sent again, found the key
# held by o0 and said "refused" although the first copy had landed: readers saw o2
# holding it until o2's transfer moved it to o0.
VIOLATION_B: list[Row] = [
    (acquire("o0", 2000), 0.0, 0.1, won("o0", 5, 2000)),
    (release("o0"), 0.5, 0.6, None),
    (acquire("o2", 2000), 1.0, 2.0, lost_to("o0")),
    (get_owner(), 1.1, 1.2, "o2"),
    (get_owner(), 1.5, 1.6, "o2"),
    (transfer("o2", "o0", 2000), 1.7, 1.8, True),
    (get_owner(), 1.9, 1.95, "o0"),
]


@pytest.mark.parametrize("rows", [VIOLATION_A, VIOLATION_B], ids=["A", "B"])
def test_it_rejects_the_violations_of_issue_19(rows: list[Row]) -> None:
    assert linearizable(*rows) is False


@pytest.mark.parametrize(
    "name, rows",
    [
        (
            "a read overlapping an acquire, before it",
            [(acquire("o1", TTL), 0.0, 1.0, won("o1", 5)), (get_owner(), 0.5, 0.6, None)],
        ),
        (
            "a read overlapping an acquire, after it",
            [(acquire("o1", TTL), 0.0, 1.0, won("o1", 5)), (get_owner(), 0.5, 0.6, "o1")],
        ),
        (
            "a release and an acquire, the acquire first",
            [
                *HELD_BY_O1,
                (release("o1"), 1.0, 2.0, None),
                (acquire("o2", TTL), 1.5, 1.6, lost_to("o1")),
            ],
        ),
        (
            "a release and an acquire, the release first",
            [
                *HELD_BY_O1,
                (release("o1"), 1.0, 2.0, None),
                (acquire("o2", TTL), 1.5, 1.6, won("o2", 7)),
            ],
        ),
        (
            "concurrent acquires, one winner",
            [
                (acquire("o1", TTL), 0.0, 1.0, lost_to("o3")),
                (acquire("o2", TTL), 0.1, 1.1, lost_to("o3")),
                (acquire("o3", TTL), 0.2, 1.2, won("o3", 9)),
                (get_owner(), 1.3, 1.4, "o3"),
            ],
        ),
        (
            "an expiry after the TTL",
            [
                (acquire("o1", 1000), 0.0, 0.1, won("o1", 5, 1000)),
                (get_owner(), 1.2, 1.3, None),
                (acquire("o2", TTL), 1.4, 1.5, won("o2", 6)),
            ],
        ),
        (
            "a key kept past its TTL",
            [
                (acquire("o1", 1000), 0.0, 0.1, won("o1", 5, 1000)),
                (get_owner(), 1.5, 1.6, "o1"),
                (renew("o1", 1000), 3.0, 3.1, True),
                (get_owner(), 3.5, 3.6, "o1"),
            ],
        ),
        (
            "a lost acquire that took effect",
            [(acquire("o2", TTL), 0.0, None, None), (get_owner(), 1.0, 1.1, "o2")],
        ),
        (
            "a lost acquire that did not",
            [(acquire("o2", TTL), 0.0, None, None), (get_owner(), 1.0, 1.1, None)],
        ),
        (
            "a lost acquire that took effect late",
            [
                *HELD_BY_O1,
                (acquire("o2", TTL), 0.5, None, None),
                (get_owner(), 0.6, 0.7, "o1"),
                (release("o1"), 1.0, 1.1, None),
                (get_owner(), 2.0, 2.1, "o2"),
            ],
        ),
        (
            "a transfer, then the new owner's token grows",
            [
                *HELD_BY_O1,
                (transfer("o1", "o2", TTL), 1.0, 1.1, True),
                (acquire("o2", TTL), 1.2, 1.3, won("o2", 6)),
                (release("o2"), 1.4, 1.5, None),
                (acquire("o3", TTL), 1.6, 1.7, won("o3", 8)),
            ],
        ),
    ],
)
def test_it_accepts(name: str, rows: list[Row]) -> None:
    assert linearizable(*rows) is True, name


def test_a_renewal_counts_from_its_own_start() -> None:
    renewed: list[Row] = [
        (acquire("o1", 1000), 0.0, 0.1, won("o1", 5, 1000)),
        (renew("o1", 1000), 0.8, 0.9, True),
    ]
    assert linearizable(*renewed, (get_owner(), 1.5, 1.6, None)) is False
    assert linearizable(*renewed, (get_owner(), 1.9, 2.0, None)) is True


def test_violation_a_is_printed_as_a_transfer_refused_to_the_holder() -> None:
    result = check(history(*VIOLATION_A, client="P0"))
    printed = explain(result)
    print(printed)
    stuck = printed.split("Calls that cannot follow it:")[1]
    assert "transfer_lease(o1 -> o4, 2000 ms) -> False" in stuck
    assert "the contract answers True" in stuck
    assert "acquired, token 213" in printed.split("Calls that cannot follow it:")[0]


def test_violation_b_is_printed_as_a_refusal_while_readers_see_the_caller() -> None:
    printed = explain(check(history(*VIOLATION_B)))
    print(printed)
    stuck = printed.split("Calls that cannot follow it:")[1]
    assert "get_lease_owner() -> 'o2'" in stuck
    assert "the contract answers None" in stuck
    makers = printed.split("could have made o2 the owner:")[1]
    assert "acquire_lease(o2, 2000 ms) -> refused, held by o0" in makers


def test_violation_b_of_a_transfer_is_printed_with_the_transfer_that_said_no() -> None:
    """Found by the soak under faults: the transfer's first copy moved the key."""
    printed = explain(
        check(
            history(
                (acquire("o2", 2000), 0.0, 0.1, won("o2", 5, 2000)),
                (transfer("o2", "o1", 2000), 1.0, 2.0, False),
                (get_owner(), 1.3, 1.4, "o1"),
            )
        )
    )
    print(printed)
    makers = printed.split("could have made o1 the owner:")[1]
    assert "transfer_lease(o2 -> o1, 2000 ms) -> False" in makers


def test_a_generated_valid_history_of_20000_calls_passes_in_seconds() -> None:
    """12 tasks over 4 keys for 40 s, some answers lost; the figure is printed, not timed."""
    made = valid_history(20_000, 40.0, keys=4, tasks=12, seed=19)
    began = time.monotonic()
    result = check(made, timeout=100)
    took = time.monotonic() - began
    print(f"checked 20,000 calls in {took:.2f} s ({20_000 / took:,.0f} calls/s)")
    assert result.ok is True, explain(result)


@pytest.mark.parametrize("seed", range(3))
def test_a_generated_history_with_one_answer_changed_fails(seed: int) -> None:
    """A read answered with an owner nobody was given the key as: no order explains it."""
    made = valid_history(2_000, 4.0, keys=2, tasks=8, seed=seed)
    index = len(made.ops) // 2
    while made.ops[index].call.name != "get_owner" or not made.ops[index].answered:
        index += 1
    made.ops[index] = replace(made.ops[index], answer="nobody")
    result = check(made)
    assert result.ok is False
    assert "get_lease_owner() -> 'nobody'" in explain(result)


def test_an_early_expiry_after_a_leader_stall_is_allowed_and_counted_apart() -> None:
    """etcd bug 15247: a stalled leader that resumes may revoke leases early."""
    early = history(
        (acquire("o1", 5000), 0.0, 0.1, won("o1", 5, 5000)),
        (get_owner(), 2.0, 2.1, None),
    )
    assert check(early).ok is False
    assert check(early, early=[(3.0, 4.0)]).ok is False  # not in the span
    allowed = check(early, early=[(1.5, 2.5)])
    assert allowed.ok is True
    assert allowed.early == ("k",)
    assert check(history(*HELD_BY_O1), early=[(1.5, 2.5)]).early == ()


def linearizable_by_brute_force(ops: list[Op]) -> bool:
    """Try every order (the model's times rule out those that break real time)."""
    timing = Timing(DEFAULT_SLACK)
    for order in itertools.permutations(ops):
        states = frozenset({INITIAL})
        for op in order:
            states = step_all(states, op, timing)
            if not states:
                break
        else:
            return True
    return False


def mutated(op: Op, rng: random.Random) -> Op:
    """``op`` with another answer, of the right type."""
    answer = op.answer
    if op.call.name == "get_owner":
        return replace(op, answer=rng.choice([None, *OWNERS]))
    if isinstance(answer, AcquireResult):
        if answer.acquired and answer.token is not None and rng.random() < 0.5:
            return replace(op, answer=replace(answer, token=answer.token - 1))
        return replace(op, answer=lost_to(rng.choice(OWNERS)))
    return replace(op, answer=not answer) if isinstance(answer, bool) else op


@pytest.mark.parametrize("seconds", [0.02, 4.0], ids=["overlapping", "expiring"])
def test_the_search_agrees_with_trying_every_order(seconds: float) -> None:
    """Small histories, some answers changed: the search (with its cache and its calls
    placed without loss) finds an order exactly when one exists."""
    rng = random.Random(19)
    verdicts = []
    for seed in range(150):
        made = valid_history(7, seconds, keys=1, tasks=3, seed=seed, lost=0.1)
        ops = [mutated(op, rng) if rng.random() < 0.15 else op for op in made.ops]
        made.ops = ops
        verdicts.append(linearizable_by_brute_force(ops))
        assert check(made).ok is verdicts[-1], ops
    assert 20 < verdicts.count(False) < 130  # both kinds were tried


def test_a_search_out_of_time_is_undecided_never_passed() -> None:
    result = check(valid_history(2_000, 4.0, keys=1, tasks=8, seed=1), timeout=0)
    assert result.ok is None
    assert "undecided" in explain(result)


def test_a_bound_on_when_unanswered_calls_land_narrows_the_search() -> None:
    """A lost acquire that can only have landed after o1's release, 5 s later."""
    made = history(
        *HELD_BY_O1,
        (acquire("o2", TTL), 0.5, None, None),
        (release("o1"), 5.0, 5.1, None),
        (get_owner(), 6.0, 6.1, "o2"),
    )
    timing = Timing(DEFAULT_SLACK)
    assert check_key("k", made.ops, timing, deadline=time.monotonic() + 10).ok is True
    bounded = [op if op.answered else replace(op, lands_by=op.start + 3) for op in made.ops]
    assert check_key("k", bounded, timing, deadline=time.monotonic() + 10).ok is False


def test_an_undecided_key_is_checked_again_with_unanswered_calls_landing_soon() -> None:
    made = valid_history(2_000, 4.0, keys=1, tasks=8, seed=1, lost=0.01)
    result = check(made, timeout=0)
    bounded = result.keys[0].bounded
    assert result.ok is None and bounded is not None
    assert "If each landed within 10 s of its start, or never:" in explain(result)
