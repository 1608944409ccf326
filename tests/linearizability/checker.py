"""Is a history linearizable? Wing & Gong's search with Lowe's memoisation, per key.

The algorithm is Porcupine's (``checker.go``): the history of one key becomes a
doubly linked list of call and return events in time order. A call may be placed
next if its call event comes before the first return event left in the list (no
call still unplaced ended before it began). Placing a call lifts both its events
out of the list; when no call can be placed before a return, the search takes the
last placement back and tries the next call. Each (set of placed calls, model
state) is explored once: the cache turns the search from factorial into, on
histories that real systems make, about linear. The model state is a set of
states (:func:`model.step_all`), as Porcupine does for non-deterministic models.

Beyond Porcupine: a call whose answer changes nothing wherever it is allowed (a read,
a refusal) and that every state allows is placed without loss, so the search never
tries it later (:func:`model.placed_without_loss`); and each step is worked out once.

Keys are independent objects: each is checked alone, which keeps the search small
and a violation's printout to the one key that has it.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from tests.linearizability.history import History, Op
from tests.linearizability.model import INITIAL, KeyState, Timing, placed_without_loss, step_all

#: Seconds an expiry may come before ``start + TTL``: clock granularity and the
#: difference between our clock's rate and etcd's.
DEFAULT_SLACK = 0.05

States = frozenset[KeyState]
_ZOBRIST = random.Random(19)
MAX_STEPS_KEPT = 200_000  # steps worked out and kept (memory stays in the 100s of MB)


@dataclass(frozen=True)
class Placed:
    """A call in the longest order found, and the states it may have left."""

    op: Op
    after: States


@dataclass(frozen=True)
class KeyResult:
    """``ok``: ``True`` linearizable, ``False`` not, ``None`` when time ran out first.

    When not linearizable: ``longest`` is the longest order the search found and
    ``stuck`` the calls that could come next by their times, none of which the
    model allows there (or every order after which was tried and failed).
    """

    key: str
    ok: bool | None
    calls: int
    longest: tuple[Placed, ...] = ()
    stuck: tuple[Op, ...] = ()
    ops: tuple[Op, ...] = ()  # all the key's calls
    # When undecided: the verdict if every call without an answer landed within
    # ``landing_bound`` s of its start, or never (a narrower search, often decided).
    bounded: KeyResult | None = None
    landing_bound: float = math.inf


class _Node:
    """A call or return event in the list; a call's ``match`` is its return."""

    __slots__ = ("index", "match", "next", "prev")

    def __init__(self, index: int, match: _Node | None) -> None:
        self.index = index
        self.match = match
        self.prev: _Node | None = None
        self.next: _Node | None = None


def _events(ops: list[Op]) -> _Node:
    """The list's head, then every call and return in time order (ties: calls first,
    so calls that touch count as concurrent)."""
    returns = [_Node(i, None) for i in range(len(ops))]
    events = [(op.start, 0, i, _Node(i, returns[i])) for i, op in enumerate(ops)]
    events += [(op.latest, 1, i, returns[i]) for i, op in enumerate(ops)]
    events.sort(key=lambda event: event[:3])
    head = previous = _Node(-1, None)
    for *_, node in events:
        previous.next, node.prev = node, previous
        previous = node
    return head


def _lift(node: _Node) -> None:
    for event in (node, node.match):
        assert event is not None and event.prev is not None
        event.prev.next = event.next
        if event.next is not None:
            event.next.prev = event.prev


def _unlift(node: _Node) -> None:
    for event in (node.match, node):
        assert event is not None and event.prev is not None
        event.prev.next = event
        if event.next is not None:
            event.next.prev = event


def _waiting(head: _Node, ops: list[Op]) -> tuple[Op, ...]:
    """The calls that could be placed next by their times, and the first unplaced return."""
    found: list[int] = []
    node = head.next
    while node is not None and node.index not in found:
        found.append(node.index)
        if node.match is None:
            break
        node = node.next
    return tuple(ops[index] for index in found)


def check_key(key: str, ops: list[Op], timing: Timing, deadline: float) -> KeyResult:
    """Search for an order of ``ops`` (all on ``key``) that the model allows."""
    head = _events(ops)
    states: States = frozenset({INITIAL})
    # The set of placed calls, as Zobrist hashing keeps it: the XOR of a random
    # 128-bit number per call (a collision is as likely as guessing one: never). A
    # bitset would cost memory and time in proportion to the calls, per placement.
    numbers = [_ZOBRIST.getrandbits(128) for _ in ops]
    placed = 0
    cache = {(placed, states)}
    stack: list[tuple[_Node, States, bool]] = []  # each placement, and the states before it
    longest: list[tuple[_Node, States, bool]] = []  # the longest stack seen, and its states
    last, stuck = states, _waiting(head, ops)
    node = head.next
    steps: dict[tuple[States, int], States] = {}
    tries = 0
    while head.next is not None:
        assert node is not None  # the list always ends with a return
        tries += 1
        if tries % 64 == 0 and time.monotonic() > deadline:
            return KeyResult(key, None, len(ops))
        if node.match is not None:
            op = ops[node.index]
            # The same call is tried from the same states again and again while the
            # search backtracks: each step is worked out once.
            after = steps.get((states, node.index))
            if after is None:
                if len(steps) > MAX_STEPS_KEPT:
                    steps.clear()
                after = steps[states, node.index] = step_all(states, op, timing)
            if after:
                bits = placed ^ numbers[node.index]
                if (bits, after) not in cache:
                    cache.add((bits, after))
                    stack.append((node, states, placed_without_loss(states, op, timing)))
                    states, placed = after, bits
                    _lift(node)
                    node = head.next
                    continue
            node = node.next
            continue
        # A return: its call could not be placed before it. Take the last placement back.
        if len(stack) > len(longest):
            longest, last, stuck = stack.copy(), states, _waiting(head, ops)
        # A call placed without loss (see placed_without_loss): no other order from
        # before it can work either, so its placement goes back too.
        forced = True
        while forced and stack:
            node, states, forced = stack.pop()
            placed ^= numbers[node.index]
            _unlift(node)
        if forced:
            afters = [before for _, before, _ in longest[1:]] + [last] if longest else []
            order = tuple(
                Placed(ops[n.index], a) for (n, _, _), a in zip(longest, afters, strict=True)
            )
            return KeyResult(key, False, len(ops), order, stuck, tuple(ops))
        node = node.next
    return KeyResult(key, True, len(ops))


@dataclass(frozen=True)
class CheckResult:
    """Every key's verdict. ``early``: keys linearizable only if a tenure ended early in
    a span :attr:`Timing.early` allows (etcd bug 15247), counted apart, never hidden."""

    keys: tuple[KeyResult, ...]
    timing: Timing
    early: tuple[str, ...] = ()

    @property
    def ok(self) -> bool | None:
        """``False`` if any key is not linearizable, else ``None`` if any was not decided."""
        verdicts = [result.ok for result in self.keys]
        if False in verdicts:
            return False
        return None if None in verdicts else True


def by_key(ops: Iterable[Op]) -> dict[str, list[Op]]:
    """Each key's calls; reads without an answer are left out (they change nothing)."""
    keys: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        if op.answered or op.call.name != "get_owner":
            keys[op.key].append(op)
    return keys


def check(
    history: History,
    slack: float = DEFAULT_SLACK,
    timeout: float = 60.0,
    early: Sequence[tuple[float, float]] = (),
    landing_bound: float = 10.0,
) -> CheckResult:
    """Check every key of ``history``; a key not decided in ``timeout`` s is undecided.

    A key that fails is checked again allowing tenures to end early within the spans
    ``early`` (etcd bug 15247 after a leader stall): if it passes so, it is counted in
    :attr:`CheckResult.early`. An undecided key is checked again (for ``timeout`` s
    more) as if its calls without an answer landed within ``landing_bound`` s of their
    start, or never: that verdict is kept beside it (:attr:`KeyResult.bounded`).
    """
    strict, lenient = Timing(slack), Timing(slack, tuple(early))
    results, early_keys = [], []
    for key, ops in by_key(history.ops).items():
        deadline = time.monotonic() + timeout
        result = check_key(key, ops, strict, deadline)
        if result.ok is False and early:
            again = check_key(key, ops, lenient, deadline)
            if again.ok is True:
                result = again
                early_keys.append(key)
        if result.ok is None and not all(op.answered for op in ops):
            bound = [
                op if op.answered else replace(op, lands_by=op.start + landing_bound) for op in ops
            ]
            bounded = check_key(key, bound, strict, time.monotonic() + timeout)
            result = replace(result, bounded=replace(bounded, landing_bound=landing_bound))
        results.append(result)
    return CheckResult(tuple(results), strict, tuple(early_keys))
