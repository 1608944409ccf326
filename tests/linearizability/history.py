"""A history of contract calls: each with its start, its end and its answer, or no answer.

Times are seconds on one monotonic clock shared by every caller (``time.monotonic()``
is system-wide on Linux, so processes of one machine may share it). A call that
raised has no answer and no end: it may have taken effect at any moment after its
start, or never.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple

from etcd_leases import AcquireResult

CallName = Literal["acquire", "get_owner", "release", "renew", "transfer"]
Answer = AcquireResult | str | bool | None


class Call(NamedTuple):
    """One of the five calls on some key; ``owner`` is a transfer's ``from_owner``."""

    name: CallName
    owner: str = ""
    ttl_ms: int = 0
    to_owner: str = ""

    def __str__(self) -> str:
        if self.name == "get_owner":
            return "get_lease_owner()"
        if self.name == "release":
            return f"release_lease({self.owner})"
        if self.name == "transfer":
            return f"transfer_lease({self.owner} -> {self.to_owner}, {self.ttl_ms} ms)"
        return f"{self.name}_lease({self.owner}, {self.ttl_ms} ms)"


def acquire(owner: str, ttl_ms: int) -> Call:
    return Call("acquire", owner, ttl_ms)


def get_owner() -> Call:
    return Call("get_owner")


def release(owner: str) -> Call:
    return Call("release", owner)


def renew(owner: str, ttl_ms: int) -> Call:
    return Call("renew", owner, ttl_ms)


def transfer(from_owner: str, to_owner: str, ttl_ms: int) -> Call:
    return Call("transfer", from_owner, ttl_ms, to_owner)


@dataclass(frozen=True)
class Op:
    """A recorded call. ``end`` is infinite when no answer came (``answer`` is then moot)."""

    client: str
    key: str
    call: Call
    start: float
    end: float
    answer: Answer
    lands_by: float = math.inf  # without an answer: the latest it may land (a bound tried)

    @property
    def answered(self) -> bool:
        return self.end != math.inf

    @property
    def latest(self) -> float:
        """The latest moment the call may take effect."""
        return self.end if self.answered else self.lands_by


def show_answer(op: Op) -> str:
    if not op.answered:
        return "no answer"
    answer = op.answer
    if isinstance(answer, AcquireResult):
        if answer.acquired:
            return f"acquired, token {answer.token}, ttl {answer.ttl_ms} ms"
        return f"refused, held by {answer.owner}"
    return repr(answer)


@dataclass
class History:
    """Calls in the order they were recorded (any order will do for the checker)."""

    clock: Callable[[], float] = time.monotonic
    ops: list[Op] = field(default_factory=list)

    def add(
        self,
        key: str,
        call: Call,
        start: float,
        end: float | None,
        answer: Answer = None,
        client: str = "",
    ) -> None:
        """Record a call that ran from ``start`` to ``end`` (``None``: no answer came)."""
        finished = math.inf if end is None else end
        self.ops.append(Op(client, key, call, start, finished, answer))

    def dump(self, path: str) -> None:
        """Write the calls as JSON lines (how a child process hands its history over)."""
        with open(path, "w", encoding="utf-8") as out:
            for op in self.ops:
                out.write(json.dumps(_to_json(op)) + "\n")

    def load(self, path: str) -> None:
        """Add the calls :meth:`dump` wrote to ``path``."""
        with open(path, encoding="utf-8") as lines:
            self.ops += [_from_json(json.loads(line)) for line in lines]


def _to_json(op: Op) -> dict[str, Any]:
    answer = asdict(op.answer) if isinstance(op.answer, AcquireResult) else op.answer
    end = op.end if op.answered else None
    return {
        "client": op.client,
        "key": op.key,
        "call": list(op.call),
        "start": op.start,
        "end": end,
        "answer": answer,
    }


def _from_json(line: dict[str, Any]) -> Op:
    answer = line["answer"]
    if isinstance(answer, dict):
        answer = AcquireResult(**answer)
    end = math.inf if line["end"] is None else line["end"]
    return Op(line["client"], line["key"], Call(*line["call"]), line["start"], end, answer)
