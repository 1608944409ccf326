"""etcd-native lock and election: latency alone, and hand-offs with the real etcdctl.

    python benchmarks/native.py              # starts a throwaway one-member etcd
    python benchmarks/native.py --quick

Times, on our clock: an uncontended ``NativeLock`` acquire + release (one grant, one
txn, one revoke); our ``resign()`` to another of our candidates leading, and to
``etcdctl elect`` printing that it leads (its watch sees our key's delete); from
``etcdctl lock`` sent SIGINT to our waiting ``acquire()`` returning. The etcdctl is
the one beside the etcd binary (else on PATH); its process start is not timed.
Prints figures; asserts no timing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import time
import uuid
from collections.abc import Sequence

from etcd_leases import EtcdLeaseProvider
from etcd_leases.etcd.native import NativeElection, NativeLock
from etcd_leases.testing import EtcdCluster, etcd_version
from etcd_leases.testing.binaries import find_etcdctl


def row(what: str, seconds: list[float]) -> None:
    ms = sorted(s * 1000 for s in seconds)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    print(f"{what:<52} {statistics.median(ms):>8.2f} {p99:>8.2f} {len(ms):>6}")


async def etcdctl(cluster: EtcdCluster, *args: str) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCDCTL_")}
    return await asyncio.create_subprocess_exec(
        find_etcdctl(cluster.binary),
        f"--endpoints={cluster.endpoint_string}",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        env=env | {"ETCDCTL_API": "3"},
    )


async def queued(provider: EtcdLeaseProvider, name: str, count: int) -> None:
    """Wait until ``count`` keys queue under ``name`` (an etcdctl process has started)."""
    deadline = time.monotonic() + 30
    while len(await provider.client.range_prefix(f"{name}/".encode())) < count:
        assert time.monotonic() < deadline, f"fewer than {count} keys under {name}/ in 30 s"
        await asyncio.sleep(0.005)


async def run(cluster: EtcdCluster, quick: bool) -> None:
    rounds = 10 if quick else 40
    async with EtcdLeaseProvider(cluster.endpoints) as provider:
        alone = []
        for _ in range(rounds * 10):
            lock = NativeLock(provider, f"bench-{uuid.uuid4().hex}")
            started = time.perf_counter()
            await lock.acquire()
            await lock.release()
            alone.append(time.perf_counter() - started)

        to_ours_alone = []
        for _ in range(rounds):
            name = f"bench-{uuid.uuid4().hex}"
            first, second = NativeElection(provider, name), NativeElection(provider, name)
            await first.campaign("first", timeout=30)
            campaign = asyncio.create_task(second.campaign("second", timeout=30))
            await queued(provider, name, 2)
            started = time.perf_counter()
            await first.resign()
            await campaign
            to_ours_alone.append(time.perf_counter() - started)
            await second.resign()

        to_etcdctl = []
        for _ in range(rounds):
            name = f"bench-{uuid.uuid4().hex}"
            election = NativeElection(provider, name, ttl_s=10)
            await election.campaign("ours", timeout=30)
            theirs = await etcdctl(cluster, "elect", name, "theirs")
            await queued(provider, name, 2)
            started = time.perf_counter()
            await election.resign()
            assert theirs.stdout is not None
            await asyncio.wait_for(theirs.stdout.readline(), 30)
            to_etcdctl.append(time.perf_counter() - started)
            theirs.send_signal(signal.SIGINT)
            await theirs.wait()

        to_ours = []
        for _ in range(rounds):
            name = f"bench-{uuid.uuid4().hex}"
            theirs = await etcdctl(cluster, "lock", name)
            assert theirs.stdout is not None
            await asyncio.wait_for(theirs.stdout.readline(), 30)
            lock = NativeLock(provider, name, ttl_s=10)
            acquiring = asyncio.create_task(lock.acquire(timeout=30))
            await queued(provider, name, 2)
            started = time.perf_counter()
            theirs.send_signal(signal.SIGINT)
            await acquiring
            to_ours.append(time.perf_counter() - started)
            await lock.release()
            await theirs.wait()

    print(f"{'':<52} {'p50 ms':>8} {'p99 ms':>8} {'n':>6}")
    row("NativeLock acquire + release, uncontended", alone)
    row("our resign() -> our other candidate leads", to_ours_alone)
    row("our resign() -> etcdctl elect prints it leads", to_etcdctl)
    row("SIGINT to etcdctl lock -> our acquire() returns", to_ours)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--etcd-bin", help="the etcd binary (its etcdctl is used too)")
    args = parser.parse_args(argv)
    with EtcdCluster(1, binary=args.etcd_bin) as cluster:
        version = etcd_version(cluster.binary)
        print(f"throwaway etcd {version} at {cluster.endpoint_string}, load {os.getloadavg()}")
        asyncio.run(run(cluster, args.quick))


if __name__ == "__main__":
    main()
