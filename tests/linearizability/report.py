"""The printout of a violation: where no order of the calls can go on.

It shows the end of the longest order the search found, each call with the states
it may have left the key in, then each call that could come next by its times, with
what the contract answers to it there: the reader sees which answer no order explains.
"""

from __future__ import annotations

from etcd_leases import AcquireResult
from tests.linearizability.checker import CheckResult, KeyResult, States
from tests.linearizability.history import Answer, Op, show_answer
from tests.linearizability.model import INITIAL, KeyState, Timing, contract_answer, step

TAIL = 12  # calls of the longest order shown
MAKERS = 3  # calls shown that could have made a named owner the holder


def _show_call(op: Op, origin: float) -> str:
    end = f"{op.end - origin:.3f}" if op.answered else "(none)"
    who = f"[{op.client}] " if op.client else ""
    return f"{op.start - origin:8.3f} - {end:>8}  {who}{op.call} -> {show_answer(op)}"


def _show_contract(answer: Answer) -> str:
    if isinstance(answer, AcquireResult):
        return f"refused, held by {answer.owner}" if not answer.acquired else "acquired"
    return repr(answer)


def _why_not(op: Op, states: States, timing: Timing, origin: float) -> list[str]:
    lines = []
    for state in sorted(states, key=KeyState.show):
        if op.end < state.now:
            lines.append(f"it ended before {state.now - origin:.3f}, the last step's earliest time")
        elif step(state, op, timing):
            lines.append(f"{state.show(origin)}: allowed, but no order of the calls left goes on")
        else:
            expected = _show_contract(contract_answer(state, op))
            lines.append(f"{state.show(origin)}: the contract answers {expected}")
    return lines


def explain_key(result: KeyResult, timing: Timing, origin: float = 0.0) -> str:
    """Why ``result``'s key is not linearizable (times in s from ``origin``)."""
    if result.ok is None:
        undecided = (
            f"key {result.key!r}: undecided, the search ran out of time on its "
            f"{result.calls} calls (calls without an answer that stay pending long make it "
            "costly: each may land at any moment)"
        )
        if result.bounded is None:
            return undecided
        lands = result.bounded.landing_bound
        return f"{undecided}.\nIf each landed within {lands:g} s of its start, or never:\n" + (
            explain_key(result.bounded, timing, origin)
        )
    if result.ok:
        return f"key {result.key!r}: linearizable"
    lines = [
        f"key {result.key!r}: NOT linearizable; the longest order places "
        f"{len(result.longest)} of {result.calls} calls.",
        "The end of that order (times in s; each call, then the states it may leave):",
    ]
    if len(result.longest) > TAIL:
        lines.append(f"    ... {len(result.longest) - TAIL} calls before")
    for placed in result.longest[-TAIL:]:
        lines.append("  " + _show_call(placed.op, origin))
        lines += [
            f"        => {state.show(origin)}" for state in sorted(placed.after, key=KeyState.show)
        ]
    final = result.longest[-1].after if result.longest else frozenset({INITIAL})
    lines.append("Calls that cannot follow it:")
    for op in result.stuck:
        lines.append("  " + _show_call(op, origin))
        lines += [f"        {line}" for line in _why_not(op, final, timing, origin)]
    named: set[str] = set()
    for op in result.stuck:
        owner = _named_owner(op)
        if owner is not None and owner not in named:
            named.add(owner)
            lines.append(f"The latest calls before it that could have made {owner} the owner:")
            makers = [m for m in result.ops if _makes(m, owner) and m.start <= op.end]
            lines += ["  " + _show_call(m, origin) for m in makers[-MAKERS:]] or ["  none"]
    return "\n".join(lines)


def _named_owner(op: Op) -> str | None:
    """The holder ``op``'s answer names, if any."""
    if op.call.name == "get_owner" and isinstance(op.answer, str):
        return op.answer
    if isinstance(op.answer, AcquireResult) and not op.answer.acquired:
        return op.answer.owner
    return None


def _makes(op: Op, owner: str) -> bool:
    return (op.call.name == "acquire" and op.call.owner == owner) or (
        op.call.name == "transfer" and op.call.to_owner == owner
    )


def explain(result: CheckResult, origin: float = 0.0) -> str:
    """Every key not shown linearizable, one after another."""
    keys = [key for key in result.keys if key.ok is not True]
    return "\n\n".join(explain_key(key, result.timing, origin) for key in keys)
