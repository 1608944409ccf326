"""What the contract allows a provider to answer, given what it answered before.

A model of one provider as a *set* of possible states, one state per key, so that
timing it cannot see (when exactly a TTL runs out, when etcd gets round to deleting
an expired key, in which order concurrent calls land) widens the set instead of
making the test flaky. Each observed answer narrows it again; an answer no state
allows is a violation.

Times are ``time.monotonic()`` seconds, the clock etcd's lessor also uses here.
A call that ran from ``start`` to ``end`` took effect at one instant in between, so
a tenure granted or renewed by it expires between ``start + ttl`` and ``end + ttl``.
Only expiry is uncertain; a release, renewal or transfer takes effect at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from etcd_leases import AcquireResult
from tests.linearizability.history import Answer, Call

# Clock granularity and rounding between our reading and etcd's, in seconds.
CLOCK_SLACK = 0.02


@dataclass(frozen=True)
class Free:
    """Nobody holds the key; the next tenure's token is at least ``min_token``."""

    min_token: int = 1


@dataclass(frozen=True)
class Held:
    """``owner`` holds the key with a TTL of ``ttl_ms`` (as granted).

    ``token`` is the tenure's token when an answer told it (else it is at least
    ``min_token``). ``expired``: the TTL ran out but the key is still there (etcd
    deletes expired keys a little later; the memory model never shows this).
    """

    owner: str
    ttl_ms: int
    token: int | None
    min_token: int
    expires_from: float
    expires_by: float
    expired: bool = False

    def next_token(self) -> int:
        """The least token the next tenure may have."""
        return (self.min_token if self.token is None else self.token) + 1


KeyState = Free | Held


@dataclass(frozen=True)
class Timing:
    """How a backend treats TTLs.

    ``granted``: the TTL it grants for one asked. ``deletion_slack``: how long after
    expiry an expired key may still be seen (``0``: never, as in memory; etcd checks
    expiries every 500 ms and deletes through raft).
    """

    granted: Callable[[int], int]
    deletion_slack: float


MEMORY = Timing(granted=lambda ttl_ms: ttl_ms, deletion_slack=0.0)
# etcd grants whole seconds, at least 1 s on the test members; a key is deleted
# within about 0.6 s of expiry when etcd is idle, later on a busy machine.
ETCD = Timing(granted=lambda ttl_ms: max(1, -(-ttl_ms // 1000)) * 1000, deletion_slack=3.0)


def phases(state: KeyState, start: float, end: float, timing: Timing) -> list[KeyState]:
    """What ``state`` may have become by some instant in [start, end] through expiry alone."""
    if isinstance(state, Free):
        return [state]
    alive = not state.expired and start < state.expires_by + CLOCK_SLACK
    may_have_expired = end + CLOCK_SLACK >= state.expires_from
    still_visible = start < state.expires_by + timing.deletion_slack
    found: list[KeyState] = [state] if alive else []
    if may_have_expired or state.expired:
        if timing.deletion_slack > 0 and still_visible:
            found.append(replace(state, expired=True))
        found.append(Free(state.next_token()))
    return found


def _tenure(
    owner: str, ttl_ms: int, token: int | None, min_token: int, start: float, end: float
) -> Held:
    return Held(owner, ttl_ms, token, min_token, start + ttl_ms / 1000, end + ttl_ms / 1000)


def step(
    state: KeyState, call: Call, answer: Answer, start: float, end: float, timing: Timing
) -> list[KeyState]:
    """The states ``call`` may leave the key in, if ``state`` allows ``answer``; else []."""
    held = state if isinstance(state, Held) else None
    alive = held is not None and not held.expired
    if call.name == "get_owner":
        return [state] if answer == (held.owner if held else None) else []
    if call.name == "acquire":
        return _acquire(state, call, answer, start, end, timing)
    if call.name == "release":
        if answer is not None:
            return []
        if held is None or held.owner != call.owner:
            return [state]
        # An expired tenure's lease is already gone: its key vanishes when etcd gets to it.
        return [Free(held.next_token())] + ([] if alive else [held])
    if call.name == "renew":
        if held is not None and alive and held.owner == call.owner:
            if answer is not True:
                return []
            ttl = timing.granted(call.ttl_ms)
            token = held.token if ttl == held.ttl_ms else None  # another TTL may move it
            min_token = held.min_token if held.token is None else held.token
            return [_tenure(call.owner, ttl, token, min_token, start, end)]
        return [state] if answer is False else []
    # Transfer: only a live tenure of from_owner moves, to a new tenure.
    if held is not None and alive and held.owner == call.owner:
        if answer is not True:
            return []
        ttl = timing.granted(call.ttl_ms)
        return [_tenure(call.to_owner, ttl, None, held.next_token(), start, end)]
    return [state] if answer is False else []


def _acquire(
    state: KeyState, call: Call, answer: Answer, start: float, end: float, timing: Timing
) -> list[KeyState]:
    if not isinstance(answer, AcquireResult):
        return []
    ttl = timing.granted(call.ttl_ms)
    if isinstance(state, Held) and state.owner != call.owner:
        return [state] if answer == AcquireResult(False, state.owner) else []
    if isinstance(state, Held) and state.expired:
        return []  # the owner's re-acquire waits for the deletion: the Free phase covers it
    if answer.acquired is not True or answer.owner != call.owner or answer.ttl_ms != ttl:
        return []
    token = answer.token
    if not isinstance(token, int):
        return []
    if isinstance(state, Free):
        allowed = token >= state.min_token
    elif state.token is not None and ttl == state.ttl_ms:
        allowed = token == state.token  # same tenure, same TTL: same token
    else:
        allowed = token >= (state.min_token if state.token is None else state.token)
    return [_tenure(call.owner, ttl, token, token, start, end)] if allowed else []


States = frozenset[tuple[KeyState, ...]]


def observe(
    states: States,
    calls: Sequence[tuple[int, Call]],
    answers: Sequence[Answer],
    start: float,
    end: float,
    timing: Timing,
) -> States:
    """The states that explain ``answers`` to ``calls`` made concurrently in [start, end].

    Concurrent calls may land in any order: every order is tried.
    """
    found: set[tuple[KeyState, ...]] = set()
    for order in itertools.permutations(range(len(calls))):
        current: Iterable[tuple[KeyState, ...]] = states
        for index in order:
            key, call = calls[index]
            current = {
                (*keys[:key], after, *keys[key + 1 :])
                for keys in current
                for now in phases(keys[key], start, end, timing)
                for after in step(now, call, answers[index], start, end, timing)
            }
        found.update(current)
    return frozenset(found)
