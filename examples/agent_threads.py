"""Agent threads: worker processes and senders share conversation threads through etcd.

Starts a throwaway etcd on 127.0.0.1 (or uses ETCDCTL_ENDPOINTS) and three worker
processes that serve every thread with a fake agent (no model calls: it "thinks" a
little and writes a reply, fenced by its run's token). Then, in order:

1. senders post follow-ups to four conversations: each goes to the run that owns
   the thread (delivered while it runs), or starts one; a run that ends with
   messages waiting hands the thread to a follow-up run;
2. a worker is killed in the middle of a run: its lease expires and another worker
   takes the thread over and answers every message it left;
3. a serverless invocation sends to an idle thread and runs it itself;
4. a message the agent can never answer (a poison message) is delivered three times,
   with a backoff in between, then lands in its thread's dead letters, where it is
   listed and dropped; the send that posted it, retried with its send id, stores
   nothing the second time;
5. a long agent turn is aborted from the demo's process: the worker running it sees
   the cancellation within milliseconds, and the thread is free again; then a note
   sent with ``wake=False`` waits for the next turn instead of starting one.

It ends once every message has its reply (or is a dead letter, or was aborted, or
waits quietly for a next turn).

    python examples/agent_threads.py
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from etcd_leases import EtcdLeaseProvider, HeldLease
from etcd_leases.testing import EtcdCluster
from etcd_leases.threads import Handler, ThreadMessages, Threads

TTL_MS = 2000
CONVERSATIONS = ["alice/chat-1", "bob/chat-2", "carol/chat-3", "dave/chat-4"]


def log(who: str, message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')}  {who:<10} {message}", flush=True)


def fake_agent(worker: str, think: float, replies: str) -> Handler:
    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        log(worker, f"runs {thread} (token {lease.token})")
        answered = 0
        async for message in messages:
            if message.text.startswith("long"):
                await long_turn(worker, thread, lease)
            await asyncio.sleep(think)  # the model call would go here
            if message.text.startswith("poison"):
                log(worker, f"  {thread} #{message.seq}: cannot answer (try {message.attempt})")
                return  # not acknowledged: delivered again, up to max_attempts times
            reply = f"{worker} answered {message.text!r}"
            # Fenced: a run that lost the thread cannot write a reply any more.
            if await lease.put(f"{replies}{thread}/{message.seq:06d}", reply):
                await messages.ack(message)
                log(worker, f"  {thread} #{message.seq}: {message.text!r} -> replied")
            answered += 1
            if answered == 2:  # one agent turn takes two messages at most: the rest of
                return  # the inbox goes to a follow-up run, handed the thread at once

    return handle


async def long_turn(worker: str, thread: str, lease: HeldLease) -> None:
    """A turn that takes a minute: it says so (fenced), then waits to be aborted."""
    log(worker, f"  {thread}: a long turn begins")
    await lease.put(f"{working_of(lease.key)}", worker)
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        log(worker, f"  {thread}: aborted mid-turn (cancelled)")
        raise


def working_of(key: str) -> str:
    """Where a run says it is in a long turn."""
    return f"working/{key}"


async def work(endpoints: str, prefix: str, worker: str) -> None:
    """A worker process: serve every thread until killed."""
    logging.basicConfig(format=f"%(asctime)s  {worker:<10} %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("etcd_leases.threads").setLevel(logging.INFO)
    async with EtcdLeaseProvider(endpoints, prefix=prefix) as provider:
        handler = fake_agent(worker, think=0.15, replies=replies_of(prefix))
        threads = Threads(
            provider, handler, worker=worker, ttl_ms=TTL_MS, linger=0.1, max_attempts=3
        )
        await threads.serve()


def replies_of(prefix: str) -> str:
    return prefix.rstrip("/") + ".replies/"


def start_workers(endpoints: list[str], prefix: str) -> dict[str, subprocess.Popen[bytes]]:
    command = [sys.executable, __file__, "worker", ",".join(endpoints), prefix]
    return {
        name: subprocess.Popen([*command, name]) for name in ("worker-a", "worker-b", "worker-c")
    }


def run_demo(endpoints: list[str]) -> None:
    prefix = f"/agent-threads-demo/{os.getpid()}/"  # a fresh run every time
    workers = start_workers(endpoints, prefix)
    try:
        asyncio.run(demo(endpoints, prefix, workers))
    finally:
        for process in workers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            process.wait(10)


async def demo(
    endpoints: list[str], prefix: str, workers: dict[str, subprocess.Popen[bytes]]
) -> None:
    sent = 0
    async with EtcdLeaseProvider(endpoints, prefix=prefix) as provider:
        handler = fake_agent("serverless", think=0.05, replies=replies_of(prefix))
        senders = Threads(provider, handler, worker="sender")

        async def post(thread: str, text: str) -> None:
            nonlocal sent
            message = await senders.send(thread, text)
            sent += 1
            log("sender", f"-> {thread} #{message.seq}: {text!r} (stored)")

        log("demo", "1. four conversations, follow-ups arriving while their runs work")
        for turn in range(3):
            for thread in CONVERSATIONS:
                await post(thread, f"question {turn + 1}")
                await asyncio.sleep(random.uniform(0, 0.05))
        await asyncio.sleep(1)

        log("demo", "2. kill a worker in the middle of a run")
        thread = CONVERSATIONS[0]
        for turn in range(4):
            await post(thread, f"follow-up {turn + 1}")
        owner = await next_owner(provider, senders.key(thread), lambda owner: owner is not None)
        victim = str(owner).split("/")[0]  # owners are "<worker>/<run>"
        await asyncio.sleep(0.2)  # let it answer one, mid-run
        workers[victim].kill()
        waiting = len(await provider.inbox.pending(thread))
        log("demo", f"killed {victim} while it ran {thread}; {waiting} messages waiting")
        log("demo", f"   its lease expires within {TTL_MS} ms, then another worker takes over")

        log("demo", "3. a serverless invocation finds a thread idle and runs it itself")
        sent += 1
        await senders.send("erin/chat-5", "hello from a lambda", run=True)

        await wait_for_replies(provider, replies_of(prefix), sent)
        for thread in [*CONVERSATIONS, "erin/chat-5"]:  # the last runs releasing them
            await next_owner(provider, senders.key(thread), lambda owner: owner is None)
        log("demo", f"every one of the {sent} messages has its reply; no thread is held")

        log("demo", "4. a poison message, posted by a client that retries its send")
        for _ in range(2):
            posted = await senders.send("frank/chat-6", "poison pill", send_id="request-77")
            log("sender", f"-> frank/chat-6 #{posted.seq} (duplicate: {posted.duplicate})")
        for _ in range(600):  # three tries take well under a minute
            if letters := await senders.dead_letters("frank/chat-6"):
                break
            await asyncio.sleep(0.1)
        for letter in letters:
            log("demo", f"dead letter #{letter.seq} {letter.text!r}: {letter.attempts} tries")
            await senders.drop_dead_letter(letter)
        log("demo", "the poison message is in the dead letters (dropped); nothing waits")

        log("demo", "5. a long turn, aborted from here; a quiet note for the next turn")
        thread = "grace/chat-7"
        await senders.send(thread, "long task: plan the quarter")
        working = working_of(senders.key(thread))
        for _ in range(1200):  # until its handler says it is at work
            if await provider.get_value(working) is not None:
                break
            await asyncio.sleep(0.05)
        aborted = await senders.abort(thread)  # the worker logs when its handler sees it
        log("demo", f"abort({thread!r}) -> {aborted}")
        await next_owner(provider, senders.key(thread), lambda owner: owner is None)
        left = len(await provider.inbox.pending(thread))
        log("demo", f"{thread} is free; the aborted turn's message is gone ({left} waiting)")
        await senders.send(thread, "note: the budget is due friday", wake=False)
        quiet = [m.text for m in await provider.inbox.pending(thread)]
        log("demo", f"a quiet note waits for the next turn, no run started: {quiet}")


async def next_owner(
    provider: EtcdLeaseProvider, key: str, wanted: Callable[[str | None], bool]
) -> str | None:
    """Watch ``key`` until its owner is ``wanted``."""
    async with contextlib.aclosing(provider.watch_owner(key)) as states:
        async for state in states:
            if wanted(state.owner):
                return state.owner
    raise AssertionError("the watch ended")


async def wait_for_replies(provider: EtcdLeaseProvider, prefix: str, expected: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        replies = await provider.client.range_prefix(prefix.encode())
        if len(replies) >= expected:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(replies)} of {expected} replies after 60 s")
        await asyncio.sleep(0.2)


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        asyncio.run(work(*sys.argv[2:5]))
        return
    if "ETCDCTL_ENDPOINTS" in os.environ:
        run_demo(os.environ["ETCDCTL_ENDPOINTS"].split(","))
        return
    with EtcdCluster(1) as cluster:
        log("demo", f"started a throwaway etcd at {cluster.endpoint_string}")
        run_demo(cluster.endpoints)


if __name__ == "__main__":
    main()
