"""A worker serving agent threads, its deliveries and acks recorded for the inbox check.

``python -m tests.linearizability.inbox_child <endpoints> <prefix> <name> <log>``
serves every thread with a handler that writes each delivery and each ack as an
:class:`~tests.linearizability.inbox.InboxEvent` line (one ``os.write`` a line, so a
SIGKILL leaves no half line but the last); an ack twice, before it is sent (no answer
yet) and once answered.
"""

from __future__ import annotations

import asyncio
import sys
import time

from etcd_leases import EtcdLeaseProvider, HeldLease, LeaseLost
from etcd_leases.threads import Handler, ThreadMessages, Threads
from tests.thread_children import Log

TTL_MS = 1000


def recording_handler(log: Log) -> Handler:
    """Takes each message (recorded with when it asked and when it got it), acks it."""

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        run = {"thread": thread, "owner": lease.owner, "token": lease.token}
        waiting = aiter(messages)
        while True:
            start = time.monotonic()
            try:
                message = await anext(waiting)
            except StopAsyncIteration:
                return
            seen = {**run, "payload": message.text, "seq": message.seq}
            log.write("deliver", kind="deliver", start=start, end=time.monotonic(), **seen)
            await asyncio.sleep(0.005)  # the agent's turn
            start, answer = time.monotonic(), None
            # Written before the ack is sent: a SIGKILL may end the process while the
            # ack is on its way, and it may land all the same.
            log.write("ack", kind="ack", start=start, end=None, answer=None, **seen)
            try:
                await messages.ack(message)
                answer = True
            except LeaseLost:
                answer = False
                raise
            finally:
                if answer is not None:
                    end = time.monotonic()
                    log.write("ack", kind="ack", start=start, end=end, answer=answer, **seen)

    return handle


async def serve(endpoints: str, prefix: str, name: str, path: str) -> None:
    async with EtcdLeaseProvider(endpoints.split(","), prefix=prefix) as provider:
        handler = recording_handler(Log(path, name))
        threads = Threads(provider, handler, worker=name, ttl_ms=TTL_MS, max_attempts=None)
        await threads.serve()


if __name__ == "__main__":
    asyncio.run(serve(*sys.argv[1:]))
