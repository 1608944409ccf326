"""The agent threads' inbox as its own model: a FIFO queue per thread.

A history holds three kinds of event per thread, each with its start and end on the
shared monotonic clock: a **send** (its answer: the message's ``seq``, or none if it
raised), a **delivery** (a run, named by its owner and token, was handed the message
by ``async for message in messages``) and an **ack** (``True``, refused ``False``, or
no answer). The queue must lose nothing, deliver nothing twice once acknowledged,
deliver in order, and deliver only to the thread's current run, across takeovers.

A direct check, not a search: the answers themselves give the order a search would
have to guess. Seqs order the sends (the inbox numbers them as it stores them), and
tokens order the runs (a new tenure's token exceeds every earlier one), so the only
freedom left is where each event falls within its interval, and each rule below is
checked with the most lenient placement (an ack counted from its start, a takeover
from its end). Each rule is one the FIFO model implies:

- sends: distinct seqs, in real-time order (a send that ended before another began
  has the lower seq);
- deliveries: only of messages sent (the payload's send, the same seq), each run's
  in increasing seq, never one acknowledged before the delivery began, and each
  message the first in line: every message of a lower seq acknowledged already, or
  delivered earlier in the same run;
- takeovers: no delivery or acknowledged ack by a run once a run of a higher token
  was seen to act (a delivery or ack of it ended before);
- acks: at most one acknowledged per message;
- nothing lost (``drained``: the inbox was seen empty at the end): every answered
  send, and every message delivered, acknowledged.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Literal

Kind = Literal["send", "deliver", "ack"]


@dataclass(frozen=True)
class InboxEvent:
    """One event; ``end`` is infinite without an answer. A send's ``seq`` is its
    answer; a delivery or ack names its run (``owner``, ``token``) and message."""

    kind: Kind
    thread: str
    payload: str
    start: float
    end: float = math.inf
    seq: int | None = None
    owner: str = ""
    token: int = 0
    answer: bool | None = None

    def show(self) -> str:
        run = f" by {self.owner} (token {self.token})" if self.kind != "send" else ""
        answer = "" if self.kind != "ack" else f" -> {self.answer}"
        end = "(none)" if self.end == math.inf else f"{self.end:.3f}"
        return (
            f"{self.kind} {self.payload!r} seq {self.seq}{run}{answer} [{self.start:.3f} - {end}]"
        )


def dump(events: Iterable[InboxEvent]) -> str:
    """JSON lines (infinite ends as null)."""
    rows = [{**asdict(e), "end": None if e.end == math.inf else e.end} for e in events]
    return "".join(json.dumps(row) + "\n" for row in rows)


def load(lines: Iterable[str]) -> list[InboxEvent]:
    """The events :func:`dump` (or a worker's log) wrote; a torn last line is skipped."""
    events = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a process killed mid-line
        fields = {k: v for k, v in row.items() if k in InboxEvent.__dataclass_fields__}
        fields["end"] = math.inf if fields.get("end") is None else fields["end"]
        events.append(InboxEvent(**fields))
    return events


def check_inbox(events: Iterable[InboxEvent], drained: bool) -> list[str]:
    """Every violation of the FIFO model, thread by thread ([] when there is none)."""
    threads: dict[str, list[InboxEvent]] = defaultdict(list)
    for event in events:
        threads[event.thread].append(event)
    found: list[str] = []
    for thread, its in sorted(threads.items()):
        found += [f"thread {thread!r}: {v}" for v in _check_thread(its, drained)]
    return found


def _check_thread(events: list[InboxEvent], drained: bool) -> list[str]:
    found: list[str] = []
    sends = [e for e in events if e.kind == "send"]
    deliveries = sorted((e for e in events if e.kind == "deliver"), key=lambda e: e.end)
    acks = _answered_acks([e for e in events if e.kind == "ack"])
    found += _check_sends(sends)
    sent = {e.payload: e for e in sends}
    seqs: dict[str, int | None] = {e.payload: e.seq for e in sends if e.seq is not None}
    seqs.update({e.payload: e.seq for e in deliveries})
    acked = [e for e in acks if e.answer is True]
    may_be_acked = [e for e in acks if e.answer is not False]  # no answer: it may have landed
    for payload in {e.payload for e in acked}:
        times = [e for e in acked if e.payload == payload]
        if len(times) > 1:
            found.append(f"{payload!r} acknowledged twice: {[e.show() for e in times]}")
    acting = sorted(deliveries + acked, key=lambda e: e.end)
    for delivery in deliveries:
        send = sent.get(delivery.payload)
        if send is None or (send.seq is not None and send.seq != delivery.seq):
            found.append(f"delivered what no send stored: {delivery.show()}")
        before = [e for e in acked if e.payload == delivery.payload and e.end < delivery.start]
        if before:
            found.append(
                f"delivered again after its ack: {delivery.show()}, acked {before[0].show()}"
            )
        found += _check_first_in_line(delivery, deliveries, may_be_acked, seqs)
    for event in acting:
        later = [e for e in acting if e.token > event.token and e.end < event.start]
        if later:
            found.append(
                f"{event.kind} by a run that had been taken over: {event.show()}, "
                f"after the later run's {later[0].show()}"
            )
    if drained:
        for payload in sorted(seqs, key=lambda p: seqs[p] or 0):
            if not any(e.payload == payload for e in may_be_acked):
                its = sent.get(payload)
                what = its.show() if its else repr(payload)
                found.append(f"lost: {what} was never acknowledged")
    return found


def _answered_acks(acks: list[InboxEvent]) -> list[InboxEvent]:
    """Each ack once: a worker records an ack before sending it (no answer yet, in case
    it dies meanwhile) and again once answered; the answered record stands for both."""
    answered = {(e.payload, e.owner, e.token, e.start) for e in acks if e.end != math.inf}
    return [
        e
        for e in acks
        if e.end != math.inf or (e.payload, e.owner, e.token, e.start) not in answered
    ]


def _check_sends(sends: list[InboxEvent]) -> list[str]:
    found: list[str] = []
    answered = sorted((e for e in sends if e.seq is not None), key=lambda e: e.start)
    by_seq: dict[int | None, InboxEvent] = {}
    for send in answered:
        if send.seq in by_seq:
            found.append(f"two sends stored as seq {send.seq}: {by_seq[send.seq].show()}")
        by_seq[send.seq] = send
        earlier = [e for e in answered if e.end < send.start and (e.seq or 0) > (send.seq or 0)]
        if earlier:
            found.append(f"seqs out of send order: {earlier[0].show()} before {send.show()}")
    return found


def _check_first_in_line(
    delivery: InboxEvent,
    deliveries: list[InboxEvent],
    may_be_acked: list[InboxEvent],
    seqs: dict[str, int | None],
) -> list[str]:
    """``delivery`` came in order: every lower seq was acknowledged by then (an ack
    counted from its start) or delivered earlier in the same run, and the run's own
    deliveries go up."""
    run = [
        e
        for e in deliveries
        if (e.owner, e.token) == (delivery.owner, delivery.token) and e.end < delivery.end
    ]
    if any((e.seq or 0) >= (delivery.seq or 0) for e in run):
        return [f"delivered out of order within its run: {delivery.show()} after {run[-1].show()}"]
    skipped = [
        payload
        for payload, seq in seqs.items()
        if seq is not None
        and seq < (delivery.seq or 0)
        and not any(e.payload == payload for e in run)
        and not any(e.payload == payload and e.start < delivery.end for e in may_be_acked)
    ]
    if skipped:
        return [
            f"delivered out of order: {delivery.show()} while {sorted(skipped)} (lower seqs) "
            "were neither acknowledged nor delivered earlier in the run"
        ]
    return []
