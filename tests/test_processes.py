"""Holders and candidates in real processes, frozen and killed; etcd members killed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from etcd_leases import Election, EtcdLeaseProvider, LeaseLost
from etcd_leases.testing import EtcdCluster
from tests.conftest import freeze, unique_prefix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def children(*commands: list[str]) -> Iterator[list[subprocess.Popen[str]]]:
    """Start ``python -m tests.children ...`` processes; kill and reap them at the end."""
    started: list[subprocess.Popen[str]] = []
    try:
        for command in commands:
            started.append(
                subprocess.Popen(
                    [sys.executable, "-u", "-m", "tests.children", *command],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        yield started
    finally:
        for child in started:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGCONT)
                child.kill()
            child.wait(10)
            if child.stdout is not None and not child.stdout.closed:
                child.stdout.close()


async def read_line(child: subprocess.Popen[str], within: float = 10) -> str:
    assert child.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), within)
    assert line, f"child {child.pid} ended (exit {child.poll()})"
    return line.strip()


async def lead_term(candidate: subprocess.Popen[str]) -> tuple[int, float]:
    """The fencing token and start of the term a candidate reports next."""
    kind, _, token, at = (await read_line(candidate)).split()
    assert kind == "lead"
    return int(token), float(at)


async def test_frozen_holder_wakes_to_find_its_lease_gone(etcd: EtcdCluster) -> None:
    prefix = unique_prefix()
    with children(["holder", etcd.endpoint_string, prefix]) as (child,):
        assert (await read_line(child)).startswith("held")
        await freeze(child.pid)
        try:
            async with (
                EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as provider,
                provider.hold("res", "parent", 5000, wait=5) as lease,
            ):
                assert await lease.put(prefix + "data", "parent")
                os.kill(child.pid, signal.SIGCONT)
                seen = json.loads(await read_line(child))
                assert seen == {"remaining": 0.0, "check": "LeaseLost", "put": False}
                assert await provider.get_value(prefix + "data") == b"parent"
        finally:
            os.kill(child.pid, signal.SIGCONT)


async def test_ten_candidates_one_leader_and_failover(etcd: EtcdCluster) -> None:
    prefix = unique_prefix()
    names = [f"c{i}" for i in range(10)]
    commands = [["candidate", etcd.endpoint_string, prefix, name] for name in names]
    async with EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as provider:
        leaders: asyncio.Queue[tuple[str | None, float]] = asyncio.Queue()

        async def observe() -> None:
            async for leader in Election(provider, "leader", "observer", 1000).observe():
                leaders.put_nowait((leader, time.monotonic()))

        observer = asyncio.create_task(observe())
        try:
            with children(*commands) as procs:
                by_name = dict(zip(names, procs, strict=True))
                assert (await asyncio.wait_for(leaders.get(), 10))[0] is None
                first, _ = await asyncio.wait_for(leaders.get(), 20)
                assert first in names
                for proc in procs:  # everyone campaigning, one leading
                    assert (await read_line(proc, 20)).startswith("ready")
                # The observer can see the seat taken before the winner's callback runs:
                # wait for the winner's own word before killing it.
                first_term = await lead_term(by_name[first])
                killed_at = time.monotonic()
                by_name[first].kill()
                assert await asyncio.to_thread(by_name[first].wait, 10) == -signal.SIGKILL
                seat, _ = await asyncio.wait_for(leaders.get(), 5)
                second, second_at = await asyncio.wait_for(leaders.get(), 5)
                assert seat is None and second in names and second != first
                print(f"new leader {second_at - killed_at:.2f} s after SIGKILL (TTL 1 s)")
                second_term = await lead_term(by_name[second])
                await asyncio.sleep(1.0)
                assert leaders.empty()  # nobody else led meanwhile
                for proc in procs:
                    proc.kill()
                later_terms: list[tuple[str, str]] = []
                for name, proc in by_name.items():
                    proc.wait(10)
                    assert proc.stdout is not None  # read through its buffer
                    later_terms += [
                        (name, x) for x in proc.stdout.read().splitlines() if x.startswith("lead")
                    ]
                # Exactly one leader at any time: the second term began after the kill.
                assert later_terms == []
                assert second_term[0] > first_term[0] and second_term[1] > killed_at
        finally:
            observer.cancel()
            await asyncio.gather(observer, return_exceptions=True)


async def test_holder_sees_loss_within_ttl_when_etcd_dies(etcd_binary: str) -> None:
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        async with (
            EtcdLeaseProvider(etcd.endpoints, timeout=1.0) as provider,
            provider.hold("k", "alice", 2000) as lease,
        ):
            await asyncio.sleep(0.8)
            killed_at = time.monotonic()
            etcd.members[0].kill()
            assert not etcd.members[0].running
            # Its last answered renewal was sent before the kill: a TTL after the kill
            # the holder vouches for nothing, however late this task wakes.
            await asyncio.sleep(killed_at + 2.0 - time.monotonic())
            assert lease.remaining() == 0
            with pytest.raises(LeaseLost):
                lease.check()
            await asyncio.wait_for(lease.lost.wait(), 5)
            print(f"loss seen {time.monotonic() - killed_at:.2f} s after etcd died (TTL 2 s)")


async def test_etcdctl_delete_is_seen_at_once(
    etcd: EtcdCluster, etcd_provider: EtcdLeaseProvider
) -> None:
    async with etcd_provider.hold("k", "alice", 10_000) as lease:
        deleted_at = time.monotonic()
        await asyncio.to_thread(etcd.etcdctl, "del", etcd_provider.etcd_key("k").decode())
        await asyncio.wait_for(lease.lost.wait(), 5)  # half the TTL: not by expiry
        seen = time.monotonic() - deleted_at
        print(f"etcdctl del seen {1000 * seen:.0f} ms after etcdctl started")
        assert "deleted" in (lease.lost_reason or "")  # the key's watch saw it


@pytest.mark.timeout(300)
async def test_five_thousand_leases_held_through_one_stream(etcd: EtcdCluster) -> None:
    """Issue 9: 5,000 held keys (TTL 3 s) survive a loaded host: they share one session
    lease, so renewal does not grow with their number (1,700-3,000 lost before)."""
    async with (
        EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider,
        contextlib.AsyncExitStack() as stack,
    ):
        started = time.monotonic()
        leases = []
        for batch in range(50):
            leases += await asyncio.gather(
                *(
                    stack.enter_async_context(provider.hold(f"k{batch}-{i}", "me", 3000))
                    for i in range(100)
                )
            )
        print(f"5,000 holds taken in {time.monotonic() - started:.1f} s")
        await asyncio.sleep(7)  # over two TTLs
        lost = [(lease.key, lease.lost_reason) for lease in leases if lease.lost.is_set()]
        assert not lost, (len(lost), lost[:5])
        assert all(lease.remaining() > 0 for lease in leases)
        owners = await asyncio.gather(
            *(provider.get_lease_owner(lease.key) for lease in leases[::50])
        )
        assert set(owners) == {"me"}


async def test_a_leader_stopped_with_sigterm_hands_over_at_once(etcd: EtcdCluster) -> None:
    """As Kubernetes stops a pod: with the README's SIGTERM handler, the successor takes
    the seat within moments, not after the 30 s TTL (issue 7: 9.8 s before)."""
    prefix = unique_prefix()
    with children(["sigterm_leader", etcd.endpoint_string, prefix]) as (child,):
        assert (await read_line(child)).startswith("lead")
        async with EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as provider:
            successor = asyncio.create_task(_take(provider, "seat"))
            child.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            took = await asyncio.wait_for(successor, 15) - signalled
            print(f"successor took the seat {1000 * took:.0f} ms after SIGTERM (TTL 30 s)")
        assert await asyncio.to_thread(child.wait, 10) == 0


async def _take(provider: EtcdLeaseProvider, key: str) -> float:
    async with provider.hold(key, "successor", 30_000, wait=True):
        return time.monotonic()
