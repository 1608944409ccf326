"""Delivery modes across processes, on etcd: two serving worker processes
(tests/thread_children.py, role ``gated``) and this process sending, waking,
aborting and cancelling. Each guarantee spans processes: the wake marks, the abort
and the cancel all go through etcd."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from etcd_leases import EtcdLeaseProvider, HeldLease
from etcd_leases.inbox import InboxProvider
from etcd_leases.testing import EtcdCluster
from etcd_leases.threads import ThreadMessages, Threads
from tests.cli import cli_env, json_of, run_cli
from tests.conftest import eventually, unique_prefix
from tests.test_threads_processes import Processes, processes, read_history

WORKERS = ("worker-a", "worker-b")


async def _unused(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
    raise AssertionError("this process only sends")


@pytest.fixture
def workers(etcd: EtcdCluster, tmp_path: Path) -> Iterator[tuple[str, Processes]]:
    prefix = unique_prefix()
    with processes(",".join(etcd.endpoints), prefix, tmp_path) as procs:
        for name in WORKERS:
            procs.start("gated", name)
        yield prefix, procs


@pytest.fixture
async def sender(
    etcd: EtcdCluster, tmp_path: Path, workers: tuple[str, Processes]
) -> AsyncIterator[Threads]:
    """This process's side, once the workers are up: it only sends."""
    await ready(tmp_path)
    async with EtcdLeaseProvider(etcd.endpoints, prefix=workers[0]) as provider:
        yield Threads(provider, _unused)


def events(logs: Path, event: str, **fields: Any) -> list[dict[str, Any]]:
    return [
        record
        for record in read_history(logs)
        if record["ev"] == event and all(record.get(k) == v for k, v in fields.items())
    ]


def happened(logs: Path, event: str, **fields: Any) -> bool:
    return bool(events(logs, event, **fields))


async def until_free(provider: InboxProvider, key: str) -> None:
    async with asyncio.timeout(60), contextlib.aclosing(provider.watch_owner(key)) as states:
        async for state in states:
            if state.owner is None:
                return


async def send_and_hold(threads: Threads, logs: Path, *payloads: str) -> dict[str, Any]:
    """Send ``payloads`` to thread ``t``; the record of a worker holding the first."""
    for payload in payloads:
        await threads.send("t", payload)
    await eventually(lambda: happened(logs, "handled", payload="hold"), "held", 60)
    return events(logs, "handled", payload="hold")[0]


async def ready(logs: Path) -> None:
    await eventually(lambda: len(events(logs, "ready")) == len(WORKERS), "workers up", 60)


async def test_a_quiet_send_wakes_no_worker_process(sender: Threads, tmp_path: Path) -> None:
    threads, provider = sender, sender.provider
    await threads.send("quiet", "q1", wake=False)
    # Sent after it: once a worker has handled this, it has seen any wake before.
    await threads.send("loud", "x")
    await eventually(lambda: happened(tmp_path, "acked", payload="x"), "x handled", 60)
    assert events(tmp_path, "handled", thread="quiet") == []
    assert await provider.get_lease_owner(threads.key("quiet")) is None
    assert await threads.wake("quiet")
    await eventually(lambda: happened(tmp_path, "acked", payload="q1"), "q1 handled", 60)


async def test_abort_from_another_process_cancels_the_handler_and_hands_on(
    sender: Threads, tmp_path: Path
) -> None:
    threads, provider = sender, sender.provider
    # The second waits behind: for the follow-up run.
    held = await send_and_hold(threads, tmp_path, "hold", "hold")
    aborting_at = time.monotonic()
    assert await threads.abort("t")
    await eventually(lambda: happened(tmp_path, "cancelled"), "the handler cancelled", 60)
    (cancelled,) = events(tmp_path, "cancelled")
    assert (cancelled["proc"], cancelled["token"]) == (held["proc"], held["token"])
    took = cancelled["t"] - aborting_at
    print(f"abort -> handler cancelled in another process: {took:.3f} s")
    # Handed on: the follow-up run holds the message that waited behind...
    await eventually(lambda: len(events(tmp_path, "handled", payload="hold")) == 2, "handed on", 60)
    follow_up = events(tmp_path, "handled", payload="hold")[1]
    assert follow_up["token"] > held["token"]
    # ... and the abort, which named the first run, never stops it (time for a
    # wrong one to: a correct one never does).
    await asyncio.sleep(0.3)
    assert one_cancel(tmp_path)
    assert (await provider.acquire_lease("go", "test", 60_000)).acquired
    await eventually(lambda: happened(tmp_path, "acked", payload="hold"), "acked", 60)
    await until_free(provider, threads.key("t"))
    (acked,) = events(tmp_path, "acked", payload="hold")
    assert acked["token"] == follow_up["token"]
    assert await provider.inbox.pending("t") == []  # the first went with the abort
    assert one_cancel(tmp_path)


def one_cancel(logs: Path) -> bool:
    return len(events(logs, "cancelled")) == 1


async def test_cancel_pending_from_another_process_keeps_the_message_being_handled(
    sender: Threads, tmp_path: Path
) -> None:
    threads, provider = sender, sender.provider
    await send_and_hold(threads, tmp_path, "hold")
    for text in ("a", "b", "c"):
        await threads.send("t", text)
    assert await threads.cancel_pending("t") == 3
    assert (await provider.acquire_lease("go", "test", 60_000)).acquired
    await eventually(lambda: happened(tmp_path, "acked", payload="hold"), "hold acked", 60)
    await until_free(provider, threads.key("t"))
    assert [r["payload"] for r in events(tmp_path, "handled")] == ["hold"]
    assert await provider.inbox.pending("t") == []


async def test_the_command_line_sends_wakes_aborts_and_cancels(
    etcd: EtcdCluster, tmp_path: Path, workers: tuple[str, Processes]
) -> None:
    prefix, _ = workers
    await ready(tmp_path)
    env = cli_env(etcd, prefix)
    sent = run_cli("send", "t", "hold", "--json", env=env)
    assert sent.returncode == 0, sent.stderr
    assert json_of(sent) == {"thread": "t", "seq": 1, "duplicate": False}
    await eventually(lambda: happened(tmp_path, "handled", payload="hold"), "held", 60)
    aborted = run_cli("abort", "t", env=env)
    assert (aborted.returncode, aborted.stdout) == (0, "t: its run aborted\n"), aborted.stderr
    await eventually(lambda: happened(tmp_path, "cancelled"), "the handler cancelled", 60)
    assert run_cli("abort", "nobody", env=env).returncode == 1
    for _ in range(2):
        quiet = run_cli("send", "q", "x", "--no-wake", "--send-id", "req-1", env=env)
        assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "q: already stored as 1\n"
    assert run_cli("wake", "empty", env=env).returncode == 1
    cancelled = run_cli("cancel-pending", "q", "--json", env=env)
    assert json_of(cancelled) == {"thread": "q", "cancelled": 1}
    assert events(tmp_path, "handled", thread="q") == []
