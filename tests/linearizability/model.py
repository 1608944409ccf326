"""The contract's sequential object for one key, as the checker steps through it.

A state says who holds the key and what is known of the tenure's token. Time enters
in two ways. A tenure begun or renewed by a call started at ``c`` with a TTL of ``T``
may end by expiry at any moment from ``c + T - slack`` on, never before and never
necessarily (etcd may keep a key longer). And every step happens at one instant
within its call's interval, in the order of the linearization: ``now`` is the
earliest instant the last step can have happened, so a step that must follow it
(or an expiry) cannot be placed in a call that ended earlier.

Expiry is not a call but a choice the checker makes while placing a call: the key
is seen either still held or expired just before it, if that instant can be after
``expires_from``. A call without an answer took effect at its instant, or never.
So one step may lead to several states; :func:`step_all` keeps them as a set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from etcd_leases import AcquireResult
from tests.linearizability.history import Answer, Op


class KeyState(NamedTuple):
    """``owner`` (``None``: free); ``token`` of the tenure when an answer told it.

    ``min_token``: while held with ``token`` unknown, the least the token can be;
    while free, the least the next tenure's token can be (tokens only grow).
    """

    owner: str | None
    token: int | None
    min_token: int
    expires_from: float
    now: float

    def next_token(self) -> int:
        """The least token a new tenure may have after this one."""
        if self.owner is None:
            return self.min_token
        return (self.min_token if self.token is None else self.token) + 1

    def current_token(self) -> int:
        """The least the held tenure's token can be."""
        return self.min_token if self.token is None else self.token

    def show(self, origin: float = 0.0) -> str:
        """The state in words, times in s from ``origin``."""
        if self.owner is None:
            return f"free (next token >= {self.min_token})"
        token = self.token if self.token is not None else f">= {self.min_token}"
        expiry = self.expires_from - origin
        return f"owner {self.owner}, token {token}, may expire from {expiry:.3f}"


INITIAL = KeyState(None, None, 0, math.inf, -math.inf)


@dataclass(frozen=True)
class Timing:
    """``slack``: how long before ``start + TTL`` an expiry may come (clock granularity,
    clock rates). ``early``: spans of time in which any tenure may end (etcd bug 15247,
    right after a leader stall, on the versions that have it)."""

    slack: float
    early: tuple[tuple[float, float], ...] = ()

    def expiry(self, state: KeyState, at: float, end: float) -> float | None:
        """The earliest moment from ``at`` to ``end`` when ``state``'s tenure may have
        expired; ``None`` if there is none (or the key is free)."""
        if state.owner is None:
            return None
        if max(at, state.expires_from) <= end:
            return max(at, state.expires_from)
        return min(
            (max(at, lo) for lo, hi in self.early if max(at, lo) <= min(end, hi)), default=None
        )


def _free(state: KeyState, now: float) -> KeyState:
    return KeyState(None, None, state.next_token(), math.inf, now)


def _tenure(
    owner: str, min_token: int, op: Op, ttl_ms: int, timing: Timing, now: float
) -> KeyState:
    return KeyState(owner, None, min_token, op.start + ttl_ms / 1000 - timing.slack, now)


def contract_answer(state: KeyState, op: Op) -> Answer:
    """What the contract answers to ``op`` in ``state`` (an acquire's token aside)."""
    call, owner = op.call, state.owner
    if call.name == "get_owner":
        return owner
    if call.name == "acquire":
        if owner is not None and owner != call.owner:
            return AcquireResult(False, owner)
        return AcquireResult(True, call.owner)
    if call.name == "release":
        return None
    return owner == call.owner


def _effect(state: KeyState, op: Op, timing: Timing) -> KeyState:
    """The state after ``op`` took effect in ``state``, the token of a new tenure unknown."""
    call, now = op.call, state.now
    holds = state.owner == call.owner
    if call.name == "acquire" and (state.owner is None or holds):
        least = state.next_token() if state.owner is None else state.current_token()
        return _tenure(call.owner, least, op, call.ttl_ms, timing, now)
    if call.name == "release" and holds:
        return _free(state, now)
    if call.name == "renew" and holds:
        # The token stays as known: another TTL may move it forward unseen (an acquire
        # or refusal that tells a larger one later is allowed), never back.
        return state._replace(expires_from=op.start + call.ttl_ms / 1000 - timing.slack)
    if call.name == "transfer" and holds:
        return _tenure(call.to_owner, state.next_token(), op, call.ttl_ms, timing, now)
    return state


def _answered(state: KeyState, op: Op, timing: Timing) -> KeyState | None:
    """The state after ``op`` gave its recorded answer in ``state``; ``None`` if it cannot."""
    expected, answer = contract_answer(state, op), op.answer
    if not isinstance(expected, AcquireResult):
        return _effect(state, op, timing) if answer == expected else None
    if not isinstance(answer, AcquireResult) or answer.acquired != expected.acquired:
        return None
    if not answer.acquired:
        # "None only if the holder vanished before it could be read".
        if answer.owner not in (expected.owner, None):
            return None
        return _learn_token(state, answer.token)
    if answer.owner != op.call.owner or answer.token is None:
        return None
    granted = op.call.ttl_ms if answer.ttl_ms is None else answer.ttl_ms
    if granted < op.call.ttl_ms:
        return None  # a coarser clock rounds up, never down
    if answer.token < _effect(state, op, timing).min_token:
        return None  # a new tenure's token exceeds every earlier one; a re-acquire's never drops
    after = _tenure(op.call.owner, answer.token, op, granted, timing, state.now)
    return after._replace(token=answer.token)


def _learn_token(state: KeyState, token: int | None) -> KeyState | None:
    """A refused acquire may tell the holder's token: never below what is known."""
    if token is None:
        return state
    return state._replace(token=token) if token >= state.current_token() else None


def step(state: KeyState, op: Op, timing: Timing) -> list[KeyState]:
    """The states ``op`` may leave the key in, placed after ``state``; [] if none."""
    if op.latest < state.now:
        return []
    at = max(state.now, op.start)
    seen = [state._replace(now=at)]
    expired_at = timing.expiry(state, at, op.latest)
    if expired_at is not None:
        seen.append(_free(state, expired_at))
    found: list[KeyState] = []
    for before in seen:
        if op.answered:
            after = _answered(before, op, timing)
            if after is not None:
                found.append(after)
        else:
            found += [before, _effect(before, op, timing)]
    return found


def _no_op_answer(op: Op) -> bool:
    """Whether ``op``'s answer is one the contract gives only where the call changes
    nothing: a read, a refused acquire (telling no token), a renew or transfer "False"."""
    name, answer = op.call.name, op.answer
    if name == "acquire":
        return isinstance(answer, AcquireResult) and not answer.acquired and answer.token is None
    return name == "get_owner" or (name in ("renew", "transfer") and answer is False)


def placed_without_loss(states: frozenset[KeyState], op: Op, timing: Timing) -> bool:
    """Whether ``op`` may be placed now without losing any order: its answer changes
    nothing anywhere it is allowed, and every state allows it now.

    Any order that places it later then works with it moved here: it changes nothing
    the calls in between see, and each of them ended after it began (it could be
    placed next), so each can still come after it.
    """
    if not op.answered or not _no_op_answer(op):
        return False
    for state in states:
        after = _answered(state, op, timing)
        if op.end < state.now or after is None or after[:4] != state[:4]:
            return False
    return True


def step_all(states: frozenset[KeyState], op: Op, timing: Timing) -> frozenset[KeyState]:
    """:func:`step` from each state; of states alike but for ``now``, the earliest is kept
    (it allows everything a later one does)."""
    earliest: dict[tuple[str | None, int | None, int, float], KeyState] = {}
    for state in states:
        for after in step(state, op, timing):
            core = (after.owner, after.token, after.min_token, after.expires_from)
            kept = earliest.get(core)
            if kept is None or after.now < kept.now:
                earliest[core] = after
    return frozenset(earliest.values())
