"""Clients that do the same job as ours: take a free key, then let it go.

Each peer is driven two ways: sequential cycles (latency) and as many cycles as
it can on distinct keys from N concurrent tasks (throughput). Async peers run N
tasks on this process's event loop; blocking ones (python3-etcd3) run N threads.
A peer whose package is missing is skipped, with the reason printed.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor


class CorrectnessError(Exception):
    """A peer answered what no lock may answer (say, a free key it could not take)."""


class Skipped(Exception):
    """The peer cannot run here; the message says why."""


class Peer(ABC):
    """One client under test; ``cycle`` takes a free key and releases it."""

    name: str
    #: What one cycle sends, for the notes under the table.
    does: str
    #: The process whose CPU its work costs, when not this one.
    pid: int | None = None

    async def open(self) -> None:  # noqa: B027 (a hook: most peers connect here)
        """Connect; raises :class:`Skipped` when the peer cannot run here."""

    async def close(self) -> None:  # noqa: B027 (a hook: most peers disconnect here)
        """Disconnect and free what ``open`` took."""

    @abstractmethod
    async def timed_cycles(self, keys: list[str]) -> list[float]:
        """One acquire+release cycle per key, one after the other; each cycle's seconds."""

    @abstractmethod
    async def cycles_until(self, keys: list[str], seconds: float) -> int:
        """Cycles on ``keys`` (one task or thread per key) for ``seconds``; how many."""


class AsyncPeer(Peer):
    @abstractmethod
    async def cycle(self, key: str) -> None: ...

    async def timed_cycles(self, keys: list[str]) -> list[float]:
        samples = []
        for key in keys:
            start = time.perf_counter()
            await self.cycle(key)
            samples.append(time.perf_counter() - start)
        return samples

    async def cycles_until(self, keys: list[str], seconds: float) -> int:
        deadline = time.perf_counter() + seconds

        async def loop(key: str) -> int:
            done = 0
            while time.perf_counter() < deadline:
                await self.cycle(key)
                done += 1
            return done

        return sum(await asyncio.gather(*(loop(key) for key in keys)))


class ThreadPeer(Peer):
    """A blocking client: sequential cycles run in one worker thread, N tasks in N."""

    @abstractmethod
    def cycle(self, key: str) -> None: ...

    async def timed_cycles(self, keys: list[str]) -> list[float]:
        def run() -> list[float]:
            samples = []
            for key in keys:
                start = time.perf_counter()
                self.cycle(key)
                samples.append(time.perf_counter() - start)
            return samples

        return await asyncio.to_thread(run)

    async def cycles_until(self, keys: list[str], seconds: float) -> int:
        deadline = time.perf_counter() + seconds

        def loop(key: str) -> int:
            done = 0
            while time.perf_counter() < deadline:
                self.cycle(key)
                done += 1
            return done

        loop_ = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(max_workers=len(keys))
        try:
            counts = await asyncio.gather(*(loop_.run_in_executor(pool, loop, k) for k in keys))
        finally:
            # Never wait here for a hung thread: the event loop would hang with it.
            pool.shutdown(wait=False, cancel_futures=True)
        return sum(counts)


#: A peer's class: called with the etcd endpoint and the key prefix of the run.
PeerFactory = Callable[[str, str], Peer]
