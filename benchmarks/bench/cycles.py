"""Acquire+release cycles: sequential latency and throughput, ours against each peer.

Rounds are interleaved (each pass runs every peer in turn, the order rotating), so
a busy neighbour or a warming disk hits every peer alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from .checks import Checks
from .config import WARMUP_ROUNDS, Config
from .peers import CorrectnessError, Peer, PeerFactory, Skipped
from .peers.aetcd_lock import AetcdLock
from .peers.bare import BareLoop
from .peers.etcd3_lock import Etcd3Lock
from .peers.etcd_client_lock import EtcdClientLock
from .peers.isolated import IsolatedPeer
from .peers.ours import OurProvider
from .peers.redis_lock import RedisLock
from .stats import CpuMeter, Latency, split_evenly

T = TypeVar("T")

# Past its work's own length, how long a peer may take before it counts as hung.
HANG_S = 60.0

PEER_FACTORIES: tuple[PeerFactory, ...] = (
    OurProvider,
    BareLoop,
    Etcd3Lock,
    # python3-etcd3 and aetcd cannot share a process (see peers/isolated.py).
    functools.partial(IsolatedPeer, AetcdLock),
    EtcdClientLock,
    RedisLock,
)


class Peers:
    """The peers that run here, and why each other one does not.

    A peer that fails mid-run is dropped from what follows: a wrong answer as a
    correctness error, anything else (its client broke under load) as a reason.
    """

    def __init__(self, checks: Checks) -> None:
        self.running: list[Peer] = []
        self.skipped: dict[str, str] = {}
        self._checks = checks
        self._opened: list[Peer] = []  # closed at the end, dropped or not

    async def open(self, endpoint: str, prefix: str) -> None:
        for make_peer in PEER_FACTORIES:
            peer = make_peer(endpoint, prefix)
            try:
                await peer.open()
            except Exception as exc:  # Skipped says why; anything else is a failed start
                with contextlib.suppress(Exception):  # half open: free what it took
                    await peer.close()
                self._drop(
                    peer, str(exc) if isinstance(exc, Skipped) else f"did not start: {exc!r}"
                )
                continue
            self.running.append(peer)
            self._opened.append(peer)

    async def close(self) -> None:
        for peer in self._opened:
            await peer.close()

    def _drop(self, peer: Peer, reason: str) -> None:
        print(f"SKIPPED {peer.name}: {reason}", flush=True)
        self.skipped[peer.name] = reason
        if peer in self.running:
            self.running.remove(peer)

    async def attempt(self, peer: Peer, work: Awaitable[T], timeout: float) -> T | None:
        """``work``'s result, or ``None`` once the peer is dropped for failing it, or for
        not finishing in ``timeout`` seconds (a hung client must not hang the run)."""
        try:
            return await asyncio.wait_for(work, timeout)
        except CorrectnessError as exc:
            self._checks.error(str(exc))
            self._drop(peer, f"answered wrongly: {exc}")
        except TimeoutError:
            self._drop(peer, f"hung: not done in {timeout:g} s")
        except Exception as exc:
            self._drop(peer, f"failed: {type(exc).__name__}: {exc}")
        return None

    def in_turn(self, turn: int) -> list[Peer]:
        """Every running peer, starting from a different one each turn."""
        shift = turn % len(self.running) if self.running else 0
        return self.running[shift:] + self.running[:shift]


def slug(peer: Peer) -> str:
    return "".join(c if c.isalnum() else "-" for c in peer.name.lower())


async def sequential_cycles(peers: Peers, cfg: Config) -> dict[str, dict[str, Any]]:
    """Each peer's cycle latency, one cycle at a time, interleaved passes."""
    samples: dict[str, list[float]] = {}
    for turn, per_pass in enumerate([WARMUP_ROUNDS, *split_evenly(cfg.cycle_rounds, cfg.passes)]):
        for peer in peers.in_turn(turn):
            keys = [f"seq/{slug(peer)}"] * per_pass
            taken = await peers.attempt(peer, peer.timed_cycles(keys), HANG_S + per_pass)
            if taken is not None and turn > 0:  # the first pass warms up
                samples.setdefault(peer.name, []).extend(taken)
    return {
        peer.name: {**Latency.of(samples[peer.name]).as_dict(), "does": peer.does}
        for peer in peers.running
        if peer.name in samples
    }


async def throughput(
    peers: Peers, cfg: Config, etcd_pid: int | None
) -> dict[str, dict[str, dict[str, float | None]]]:
    """Cycles/s on distinct keys from N tasks (threads for blocking peers), per peer.

    Each level is split into ``cfg.passes`` passes that take turns among the peers.
    Also the CPU of the client and of etcd while it ran: who is busy tells who limits.
    """
    results: dict[str, dict[str, dict[str, float | None]]] = {}
    for level, tasks in enumerate(cfg.concurrency):
        totals: dict[str, Window] = {}
        for turn in range(cfg.passes):
            for peer in peers.in_turn(level + turn):
                keys = [f"tp/{slug(peer)}/{tasks}/{i}" for i in range(tasks)]
                meter = CpuMeter(etcd_pid, peer.pid)
                start = time.perf_counter()
                seconds = cfg.seconds_per_level / cfg.passes
                done = await peers.attempt(peer, peer.cycles_until(keys, seconds), HANG_S + seconds)
                if done is None:
                    totals.pop(peer.name, None)
                    continue
                # Until the last task's last cycle ends, a little past the deadline.
                elapsed = time.perf_counter() - start
                totals.setdefault(peer.name, Window()).add(done, elapsed, meter)
        for name, window in totals.items():
            results.setdefault(name, {})[str(tasks)] = window.figures()
            print(f"  {name:<28} {tasks:>4} tasks: {window.cycles_per_s():8,.0f} cycles/s")
    return results


class Window:
    """Cycles, wall time and CPU of one peer at one level, added up over its passes."""

    def __init__(self) -> None:
        self.cycles = 0
        self.seconds = 0.0
        self.client_cpu: float | None = 0.0
        self.etcd_cpu: float | None = 0.0

    def add(self, cycles: int, seconds: float, meter: CpuMeter) -> None:
        client, etcd = meter.per_second(seconds)
        self.cycles += cycles
        self.seconds += seconds
        self.client_cpu = _add(self.client_cpu, client, seconds)
        self.etcd_cpu = _add(self.etcd_cpu, etcd, seconds)

    def cycles_per_s(self) -> float:
        return self.cycles / self.seconds

    def figures(self) -> dict[str, float | None]:
        return {
            "cycles_per_s": self.cycles_per_s(),
            "cpu": None if self.client_cpu is None else self.client_cpu / self.seconds,
            "etcd_cpu": None if self.etcd_cpu is None else self.etcd_cpu / self.seconds,
        }


def _add(total: float | None, per_second: float | None, seconds: float) -> float | None:
    return None if total is None or per_second is None else total + per_second * seconds
