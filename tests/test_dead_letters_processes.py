"""A message that kills every worker process that handles it: its delivery count
survives each crash and takeover, and after ``max_attempts`` (3) it is dead-lettered,
letting the message behind it through. Then the command line lists, retries, drops."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from etcd_leases import EtcdLeaseProvider, HeldLease
from etcd_leases.testing import EtcdCluster
from etcd_leases.threads import ThreadMessages, Threads
from tests.cli import cli_env, json_of, run_cli
from tests.conftest import unique_prefix
from tests.test_threads_processes import processes, read_history


async def _unused(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
    raise AssertionError("this process only sends")


async def test_a_message_that_crashes_its_workers_reaches_the_dead_letters(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    prefix = unique_prefix()
    async with EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as provider:
        threads = Threads(provider, _unused)
        await threads.send("t", "crash")
        await threads.send("t", "behind it")
        with processes(",".join(etcd.endpoints), prefix, tmp_path) as procs:
            started, deadline = 0, time.monotonic() + 90
            while True:
                history = read_history(tmp_path)
                if any(r["ev"] == "acked" for r in history):
                    break
                assert time.monotonic() < deadline, f"{started} workers, still not through"
                if not any(child.poll() is None for child in procs.everyone):
                    started += 1
                    procs.start("crasher", f"crasher-{started}")
                await asyncio.sleep(0.1)
        attempts = [r["attempt"] for r in history if r.get("payload") == "crash"]
        assert attempts == [1, 2, 3]
        (letter,) = await threads.dead_letters("t")
        assert (letter.text, letter.attempts) == ("crash", 3)

    env = cli_env(etcd, prefix)
    listed = run_cli("dead-letters", "t", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert json_of(listed) == [{"seq": 1, "attempts": 3, "payload": "crash"}]
    retried = run_cli("dead-letters", "t", "retry", "1", env=env)
    assert retried.stdout == "1: sent again as 3\n"
    assert run_cli("dead-letters", "t", "drop", "1", env=env).returncode == 1  # gone
    assert run_cli("dead-letters", "t", env=env).stdout == "SEQ  ATTEMPTS  PAYLOAD\n"
