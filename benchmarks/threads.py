"""Agent threads: send-to-handled latency and messages per second, on a local etcd.

    python benchmarks/threads.py              # starts a throwaway one-member etcd
    python benchmarks/threads.py --quick
    python benchmarks/threads.py --endpoints 127.0.0.1:2379

One process: a serving worker (its own provider, so its own connection) and senders
(another provider). Latency is from just before ``send()`` to the handler receiving
the message, and to its acknowledgement returning; for ``abort()``, from just before
the call to the handler seeing its cancellation. Prints figures; asserts no timing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from etcd_leases import EtcdLeaseProvider, HeldLease
from etcd_leases.testing import EtcdCluster
from etcd_leases.threads import InboxFull, ThreadMessages, Threads


@dataclass
class Handled:
    delivered: list[float] = field(default_factory=list)  # send -> handler, seconds
    acked: list[float] = field(default_factory=list)  # send -> ack returned
    count: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    expected: int = 0

    async def acked_at_least(self, count: int) -> None:
        while len(self.acked) < count:
            self.progress.clear()
            await self.progress.wait()

    async def handle(self, thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for message in messages:
            self.delivered.append(time.monotonic() - float(message.text))
            await messages.ack(message)
            self.acked.append(time.monotonic() - float(message.text))
            self.progress.set()
            if len(self.acked) >= self.expected:
                self.count.set()


def ms(samples: Sequence[float], q: int) -> str:
    if len(samples) < 2:
        return "-"
    return f"{statistics.quantiles(samples, n=100, method='inclusive')[q - 1] * 1000:.1f}"


async def send_retrying(threads: Threads, thread: str) -> None:
    while True:
        try:
            await threads.send(thread, repr(time.monotonic()))
            return
        except InboxFull:
            await asyncio.sleep(0.01)


async def scenario(
    endpoints: Sequence[str], name: str, n: int, threads_n: int, senders: int, linger: float
) -> None:
    """``n`` messages to ``threads_n`` threads from ``senders`` tasks (1: one at a time)."""
    prefix = f"/etcd-leases-bench-threads/{uuid.uuid4().hex}/"
    handled = Handled(expected=n)
    async with (
        EtcdLeaseProvider(endpoints, prefix=prefix) as worker_side,
        EtcdLeaseProvider(endpoints, prefix=prefix) as sender_side,
    ):
        worker = Threads(worker_side, handled.handle, worker="bench", linger=linger)
        sender = Threads(sender_side, handled.handle, worker="sender")
        stop = asyncio.Event()
        serving = asyncio.create_task(worker.serve(stop))
        await asyncio.sleep(0.3)  # the worker's watch is up
        started = time.monotonic()

        async def send_share(first: int) -> None:
            for i in range(first, n, senders):
                if senders == 1:  # one at a time: each waits for the previous to be acked
                    await handled.acked_at_least(i)
                await send_retrying(sender, f"thread-{i % threads_n}")

        await asyncio.gather(*(send_share(first) for first in range(senders)))
        await asyncio.wait_for(handled.count.wait(), 300)
        took = time.monotonic() - started
        stop.set()
        await serving
    print(
        f"{name:<44} {ms(handled.delivered, 50):>7} {ms(handled.delivered, 99):>7} "
        f"{ms(handled.acked, 50):>7} {ms(handled.acked, 99):>7} {n / took:>8.0f}"
    )


async def aborts(endpoints: Sequence[str], n: int) -> None:
    """``n`` runs, each aborted from the sender's provider while its handler works."""
    prefix = f"/etcd-leases-bench-threads/{uuid.uuid4().hex}/"
    working, cancelled = asyncio.Event(), asyncio.Event()
    took: list[float] = []

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for _ in messages:
            working.set()
            try:
                await asyncio.Event().wait()  # an agent turn that never ends by itself
            except asyncio.CancelledError:
                cancelled.set()
                raise

    async with (
        EtcdLeaseProvider(endpoints, prefix=prefix) as worker_side,
        EtcdLeaseProvider(endpoints, prefix=prefix) as sender_side,
    ):
        stop = asyncio.Event()
        serving = asyncio.create_task(Threads(worker_side, handle, worker="bench").serve(stop))
        sender = Threads(sender_side, handle, worker="sender")
        for i in range(n):
            working.clear()
            cancelled.clear()
            await sender.send(f"thread-{i}", "work")
            await asyncio.wait_for(working.wait(), 60)
            started = time.monotonic()
            assert await sender.abort(f"thread-{i}")
            await asyncio.wait_for(cancelled.wait(), 60)
            took.append(time.monotonic() - started)
        stop.set()
        await serving
    print(f"{'abort() -> handler cancelled':<44} {ms(took, 50):>7} {ms(took, 99):>7}")


async def run(endpoints: Sequence[str], quick: bool) -> None:
    n = 300 if quick else 2000
    print(f"{'':<44} {'delivered ms':>15} {'acked ms':>15} {'msgs/s':>8}")
    print(f"{'scenario':<44} {'p50':>7} {'p99':>7} {'p50':>7} {'p99':>7}")
    await scenario(endpoints, "one thread, one send at a time, live run", n // 4, 1, 1, 30.0)
    await scenario(endpoints, "one thread, one send at a time, run per msg", n // 10, 1, 1, 0.0)
    await scenario(endpoints, "one thread, 16 concurrent senders", n, 1, 16, 0.05)
    await scenario(endpoints, "100 threads, 64 concurrent senders", n, 100, 64, 0.05)
    await aborts(endpoints, n // 20)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer messages")
    parser.add_argument("--endpoints", help="an etcd you already run (host:port,...)")
    args = parser.parse_args(argv)
    if args.endpoints:
        asyncio.run(run(args.endpoints.split(","), args.quick))
        return
    with EtcdCluster(1) as cluster:
        print(f"throwaway etcd at {cluster.endpoint_string}")
        asyncio.run(run(cluster.endpoints, args.quick))


if __name__ == "__main__":
    main()
