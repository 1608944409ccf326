"""The inbox's FIFO model (tests/linearizability/inbox.py): hand-made histories, a
deliberately wrong inbox caught on a real etcd, and a recorded run of worker processes
SIGKILLed and SIGSTOPped past their TTL while messages go out, checked."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from etcd_leases import EtcdLeaseProvider
from etcd_leases.etcd.inbox import EtcdInbox
from etcd_leases.inbox import Message
from etcd_leases.testing import EtcdCluster
from etcd_leases.threads import Threads
from tests.conftest import freeze, unique_prefix
from tests.linearizability.inbox import InboxEvent, check_inbox, load
from tests.linearizability.inbox_child import TTL_MS, recording_handler
from tests.thread_children import Log

ROOT = Path(__file__).resolve().parents[1]


def sent(payload: str, seq: int, start: float, end: float) -> InboxEvent:
    return InboxEvent("send", "t", payload, start, end, seq)


def delivered(payload: str, seq: int, token: int, start: float, end: float) -> InboxEvent:
    return InboxEvent("deliver", "t", payload, start, end, seq, f"run{token}", token)


def acked(
    payload: str, seq: int, token: int, start: float, end: float, answer: bool | None = True
) -> InboxEvent:
    return InboxEvent("ack", "t", payload, start, end, seq, f"run{token}", token, answer)


# Run 5 takes a and b, acks a, is frozen holding b; run 9 takes over and gets b again.
CORRECT = [
    sent("a", 1, 0.0, 0.1),
    sent("b", 2, 0.2, 0.3),
    delivered("a", 1, 5, 0.3, 0.4),
    acked("a", 1, 5, 0.4, 0.5),
    delivered("b", 2, 5, 0.5, 0.6),
    acked("b", 2, 5, 3.0, 3.1, answer=False),  # refused: taken over meanwhile
    delivered("b", 2, 9, 2.0, 2.1),
    sent("c", 3, 2.0, 2.2),
    acked("b", 2, 9, 2.2, 2.3),
    delivered("c", 3, 9, 2.3, 2.4),
    acked("c", 3, 9, 2.4, math.inf, answer=None),  # no answer: it may have landed
]


def test_a_correct_history_with_a_takeover_is_accepted() -> None:
    assert check_inbox(CORRECT, drained=True) == []


def test_an_ack_recorded_before_it_is_sent_counts_by_its_answer() -> None:
    """Workers record each ack before sending it, then with its answer."""
    sending = acked("a", 1, 5, 0.4, math.inf, answer=None)
    killed_while_acking = [*CORRECT[:3], sending, *CORRECT[4:]]  # no answered record
    assert check_inbox(killed_while_acking, drained=True) == []
    refused = [*CORRECT[:3], sending, acked("a", 1, 5, 0.4, 0.5, answer=False)]
    assert any("lost: send 'a'" in v for v in check_inbox(refused, drained=True))


@pytest.mark.parametrize(
    "name, events, says",
    [
        ("a lost message", [*CORRECT, sent("d", 4, 2.5, 2.6)], "lost: send 'd'"),
        (
            "a duplicate delivery after an ack",
            [*CORRECT, delivered("a", 1, 9, 2.5, 2.6)],
            "delivered again after its ack",
        ),
        (
            "an out-of-order delivery",
            [
                sent("a", 1, 0.0, 0.1),
                sent("b", 2, 0.2, 0.3),
                delivered("b", 2, 5, 0.4, 0.5),
                acked("b", 2, 5, 0.5, 0.6),
                delivered("a", 1, 5, 0.7, 0.8),
                acked("a", 1, 5, 0.8, 0.9),
            ],
            "delivered out of order",
        ),
        (
            "a delivery to a non-owner after takeover",
            [
                sent("a", 1, 0.0, 0.1),
                sent("b", 2, 0.2, 0.3),
                delivered("a", 1, 9, 0.3, 0.4),
                acked("a", 1, 9, 0.4, 0.5),
                delivered("b", 2, 5, 0.6, 0.7),  # run 5 ended when run 9 began
                acked("b", 2, 9, 0.8, 0.9),
            ],
            "deliver by a run that had been taken over",
        ),
        (
            "an ack by a non-owner after takeover",
            [*CORRECT[:5], delivered("b", 2, 9, 2.0, 2.1), acked("b", 2, 5, 3.0, 3.1)],
            "ack by a run that had been taken over",
        ),
        (
            "sends numbered against their order",
            [sent("a", 2, 0.0, 0.1), sent("b", 1, 0.2, 0.3)],
            "seqs out of send order",
        ),
    ],
)
def test_a_wrong_history_is_rejected(name: str, events: list[InboxEvent], says: str) -> None:
    found = check_inbox(events, drained=True)
    assert any(says in violation for violation in found), (name, found)


async def test_an_inbox_that_redelivers_an_acked_message_is_caught(
    etcd: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrong inbox: ``ack`` answers True and removes nothing."""

    async def ack_and_keep(
        self: EtcdInbox, key: str, owner: str, token: int, message: Message
    ) -> bool:
        return True

    log = str(tmp_path / "run.jsonl")
    handler = recording_handler(Log(log, "here"))
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        threads = Threads(provider, handler, ttl_ms=TTL_MS, max_attempts=None)
        events = []
        for payload in ("a", "b"):
            start = time.monotonic()
            message = await threads.send("t", payload)
            events.append(sent(payload, message.seq, start, time.monotonic()))
        right = check_inbox(events + await _run_a_while(threads, log), drained=True)
        assert right == []
        monkeypatch.setattr(EtcdInbox, "ack", ack_and_keep)
        start = time.monotonic()
        message = await threads.send("t", "c")
        events.append(sent("c", message.seq, start, time.monotonic()))
        wrong = check_inbox(events + await _run_a_while(threads, log), drained=False)
    assert any("delivered again after its ack" in violation for violation in wrong), wrong


async def _run_a_while(threads: Threads, log: str) -> list[InboxEvent]:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(2):
            await threads.run("t")
    return read_logs([Path(log)])


def read_logs(paths: list[Path] | Path) -> list[InboxEvent]:
    """The events in ``paths`` (a folder: its ``*.jsonl``)."""
    files = sorted(paths.glob("*.jsonl")) if isinstance(paths, Path) else paths
    return [event for path in files for event in load(path.read_text().splitlines())]


WORKERS = 3
THREADS = [f"thread-{i}" for i in range(6)]
MESSAGES = 300


@pytest.mark.timeout(120)
async def test_the_inbox_is_fifo_with_workers_killed_and_frozen(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    prefix = unique_prefix()
    endpoints = ",".join(etcd.endpoints)
    started: dict[str, subprocess.Popen[bytes]] = {}
    everyone: list[subprocess.Popen[bytes]] = []

    def start(name: str) -> None:
        command = [sys.executable, "-m", "tests.linearizability.inbox_child", endpoints, prefix]
        child = subprocess.Popen([*command, name, str(tmp_path / f"{name}.jsonl")], cwd=ROOT)
        started[name] = child
        everyone.append(child)

    rng = random.Random(19)
    events: list[InboxEvent] = []
    faults: list[str] = []
    try:
        for number in range(WORKERS):
            start(f"w{number}")
        async with EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as provider:
            threads = Threads(provider, recording_handler(Log(os.devnull, "")), ttl_ms=TTL_MS)
            next_fault = time.monotonic() + 1.5
            for number in range(MESSAGES):
                thread, payload = rng.choice(THREADS), f"m{number}"
                begun = time.monotonic()
                message = await threads.send(thread, payload)
                events.append(
                    InboxEvent("send", thread, payload, begun, time.monotonic(), message.seq)
                )
                await asyncio.sleep(rng.uniform(0, 0.04))
                if time.monotonic() > next_fault:
                    victim = rng.choice(sorted(started))
                    if len(faults) % 2 == 0:
                        started.pop(victim).kill()
                        start(f"w{len(everyone)}")
                        faults.append(f"killed {victim}")
                    else:
                        await freeze(started[victim].pid)
                        await asyncio.sleep(TTL_MS / 1000 + 1.5)  # its threads are taken over
                        os.kill(started[victim].pid, signal.SIGCONT)
                        faults.append(f"froze {victim}")
                    next_fault = time.monotonic() + 1.5
            deadline = time.monotonic() + 60
            for thread in THREADS:
                while await provider.inbox.count_pending(thread):
                    assert time.monotonic() < deadline, f"{thread} still has messages waiting"
                    await asyncio.sleep(0.1)
    finally:
        for child in everyone:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGCONT)
                child.kill()
            child.wait(10)
    events += read_logs(tmp_path)
    found = check_inbox(events, drained=True)
    deliveries = [e for e in events if e.kind == "deliver"]
    runs = {(e.thread, e.token) for e in deliveries}
    print(
        f"\n{MESSAGES} sent, {len(deliveries)} deliveries in {len(runs)} runs; {faults}; "
        f"violations: {found[:10]}"
    )
    assert any(f.startswith("killed") for f in faults) and any(
        f.startswith("froze") for f in faults
    )
    assert found == []
