"""Processes of the agent-threads chaos test: ``python -m tests.thread_children <role> ...``.

Each appends one JSON line per event to its log file, written with a single
``os.write`` on an ``O_APPEND`` descriptor, so a line is either whole or absent when
the process is killed. Times are ``time.monotonic()``: one clock for every process
of the machine, so the parent can order events across processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from etcd_leases import EtcdLeaseProvider, HeldLease, LeaseError, LeaseLost
from etcd_leases.threads import Handler, InboxFull, ThreadMessages, Threads

TTL_MS = 1000


class Log:
    def __init__(self, path: str, process: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._process = process

    def write(self, event: str, **fields: object) -> None:
        record = {"ev": event, "proc": self._process, "t": time.monotonic(), **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())


def fake_agent(log: Log) -> Handler:
    """Handles each message like an agent turn (a few ms of 'thinking'), recording it."""

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        common = {"thread": thread, "token": lease.token, "owner": lease.owner}
        log.write("run", **common)
        try:
            async for message in messages:
                seen = {**common, "seq": message.seq, "payload": message.text}
                log.write("handled", **seen)
                await asyncio.sleep(random.uniform(0.001, 0.01))
                log.write("acking", **seen)
                try:
                    await messages.ack(message)
                except LeaseLost:
                    log.write("ack_refused", **seen)
                    raise
                log.write("acked", **seen)
        except asyncio.CancelledError:
            log.write("cancelled", **common)
            raise

    return handle


async def worker(endpoints: str, prefix: str, name: str, path: str) -> None:
    """A long-running worker: serve every thread."""
    log = Log(path, name)
    async with EtcdLeaseProvider(endpoints, prefix=prefix) as provider:
        threads = Threads(provider, fake_agent(log), worker=name, ttl_ms=TTL_MS, linger=0.05)
        log.write("ready")
        await threads.serve()


async def serverless(endpoints: str, prefix: str, name: str, path: str, count: str) -> None:
    """Each send runs the thread here when it is idle, as a serverless invocation would."""
    log = Log(path, name)
    rng = random.Random(name)
    async with EtcdLeaseProvider(endpoints, prefix=prefix) as provider:
        threads = Threads(provider, fake_agent(log), worker=name, ttl_ms=TTL_MS)
        log.write("ready")
        for i in range(int(count)):
            thread, payload = f"thread-{rng.randrange(20)}", f"{name}-{i}"
            try:
                message = await threads.send(thread, payload)
            except InboxFull:
                await asyncio.sleep(0.1)
                continue
            log.write("sent", thread=thread, seq=message.seq, payload=payload)
            # What send(..., run=True) does, with the send recorded in between.
            try:
                await threads.run(thread)
            except LeaseError as exc:
                # The invocation failed (its run lost the thread, or etcd refused a call
                # after a freeze); the message is stored all the same, for the workers.
                log.write("run_failed", thread=thread, error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(0.01)
        log.write("done")
        await asyncio.Event().wait()


async def retrier(endpoints: str, prefix: str, name: str, path: str, count: str) -> None:
    """Sends ``req-0`` .. ``req-<count - 1>`` (each id to its own thread), in an order
    of its own, each twice: as clients retrying across processes would."""
    log = Log(path, name)

    async def unused(*_: object) -> None:
        raise AssertionError("this process only sends")

    ids = [f"req-{i}" for i in range(int(count))] * 2
    random.Random(name).shuffle(ids)
    async with EtcdLeaseProvider(endpoints, prefix=prefix) as provider:
        threads = Threads(provider, unused, worker=name)
        for send_id in ids:
            thread = f"thread-{int(send_id[4:]) % 5}"
            message = await threads.send(thread, send_id, send_id=send_id)
            log.write("sent", send_id=send_id, seq=message.seq, duplicate=message.duplicate)
        log.write("done")


async def crasher(endpoints: str, prefix: str, name: str, path: str) -> None:
    """A worker whose process dies (``os._exit``) on the message ``crash``."""
    log = Log(path, name)

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for message in messages:
            log.write("handled", thread=thread, payload=message.text, attempt=message.attempt)
            if message.text == "crash":
                os._exit(1)
            await messages.ack(message)
            log.write("acked", thread=thread, payload=message.text)

    async with EtcdLeaseProvider(endpoints, prefix=prefix) as provider:
        threads = Threads(provider, handle, worker=name, ttl_ms=TTL_MS, max_attempts=3)
        log.write("ready")
        await threads.serve()


async def gated(endpoints: str, prefix: str, name: str, path: str) -> None:
    """A worker whose handler holds each message ``hold`` until the lease key ``go`` is
    taken (then acknowledges it), recording what it handles and each cancellation."""
    log = Log(path, name)

    async def until_go(provider: EtcdLeaseProvider) -> None:
        async with contextlib.aclosing(provider.watch_owner("go")) as states:
            async for state in states:
                if state.owner is not None:
                    return

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        try:
            async for message in messages:
                seen = {"thread": thread, "payload": message.text, "token": lease.token}
                log.write("handled", **seen)
                if message.text == "hold":
                    await until_go(provider)
                await messages.ack(message)
                log.write("acked", **seen)
        except asyncio.CancelledError:
            log.write("cancelled", thread=thread, token=lease.token)
            raise

    async with EtcdLeaseProvider(endpoints, prefix=prefix) as provider:
        threads = Threads(provider, handle, worker=name, ttl_ms=10_000)
        log.write("ready")
        await threads.serve()


ROLES: dict[str, Callable[..., Coroutine[Any, Any, None]]] = {
    "worker": worker,
    "serverless": serverless,
    "retrier": retrier,
    "crasher": crasher,
    "gated": gated,
}

if __name__ == "__main__":
    role, *args = sys.argv[1:]
    asyncio.run(ROLES[role](*args))
