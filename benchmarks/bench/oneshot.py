"""The serverless one-shot: a fresh process imports, connects, takes one key, frees it, exits.

Run alone by ``python -m benchmarks.oneshot`` (see there), and as a section of
``python -m benchmarks.bench``.

Three clients, each a fresh ``python -c`` process per round, rounds interleaved so that
the host's load falls on all alike: etcd-leases, python3-etcd3's ``Lock`` and a bare
gRPC script (grant, put-if-absent, revoke: the least a one-shot that frees its lease
can send). Wall time is from spawning the process to its exit. Raft writes are
counted from etcd's metrics around one more process of each kind, run alone, and
the leases it left behind are counted too (python3-etcd3 leaves its lease to expire:
that expiry is one more raft write, later). Also part of ``python -m benchmarks.bench``.
Prints figures; asserts no timing.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import grpc

from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

from .checks import Checks
from .etcd_metrics import EtcdMetrics
from .peers.bare import NAME as BARE
from .peers.etcd3_lock import NAME as ETCD3
from .peers.ours import NAME as OURS
from .stats import Latency, ratio

# Each script gets the endpoint (host:port) and the key as arguments, and exits 0 only
# when it took the free key and gave it back.
SCRIPTS = {
    OURS: """
import asyncio, sys
from etcd_leases import EtcdLeaseProvider

async def main(endpoint, key):
    async with EtcdLeaseProvider(endpoint) as provider:
        taken = await provider.acquire_lease(key, "one-shot", 15_000)
        if not taken.acquired:
            sys.exit(f"not acquired: {taken}")
        await provider.release_lease(key, "one-shot")

asyncio.run(main(sys.argv[1], sys.argv[2]))
""",
    ETCD3: """
import sys
import etcd3

host, _, port = sys.argv[1].rpartition(":")
client = etcd3.client(host=host, port=int(port))
lock = client.lock(sys.argv[2], ttl=15)
if not lock.acquire(timeout=5):
    sys.exit("not acquired")
lock.release()
client.close()
""",
    BARE: """
import sys
import grpc
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

channel = grpc.insecure_channel(sys.argv[1])
def call(path, response):
    return channel.unary_unary(path, request_serializer=lambda r: r.SerializeToString(),
                               response_deserializer=response.FromString)
lease = call("/etcdserverpb.Lease/LeaseGrant", pb.LeaseGrantResponse)(pb.LeaseGrantRequest(TTL=15))
key = sys.argv[2].encode()
absent = pb.Compare(key=key, target=pb.Compare.CREATE, result=pb.Compare.EQUAL, create_revision=0)
put = pb.RequestOp(request_put=pb.PutRequest(key=key, value=b"one-shot", lease=lease.ID))
taken = call("/etcdserverpb.KV/Txn", pb.TxnResponse)(pb.TxnRequest(compare=[absent], success=[put]))
call("/etcdserverpb.Lease/LeaseRevoke", pb.LeaseRevokeResponse)(pb.LeaseRevokeRequest(ID=lease.ID))
channel.close()
if not taken.succeeded:
    sys.exit("not acquired")
""",
}
DOES = {
    OURS: "EtcdLeaseProvider: acquire_lease, release_lease, close",
    ETCD3: "etcd3.client().lock(): acquire, release (its lease is left to expire), close",
    BARE: "sync grpc: LeaseGrant, Txn put-if-absent on the lease, LeaseRevoke",
}

# As installed packages run: from compiled bytecode (pip writes it at install time; an
# editable install or PYTHONDONTWRITEBYTECODE would compile every module every time).
CHILD_ENV = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}


@dataclass(frozen=True)
class Counted:
    raft_writes: float | None
    leases_left: int | None


def leases_now(endpoint: str) -> int | None:
    """How many leases etcd has (``LeaseLeases``), or ``None`` if it cannot tell."""
    try:
        with grpc.insecure_channel(endpoint) as channel:
            leases = channel.unary_unary(
                "/etcdserverpb.Lease/LeaseLeases",
                request_serializer=lambda request: request.SerializeToString(),
                response_deserializer=pb.LeaseLeasesResponse.FromString,
            )
            answer = leases(pb.LeaseLeasesRequest(), timeout=5)
    except grpc.RpcError:
        return None
    return len(answer.leases)


@dataclass(frozen=True)
class Ran:
    wall_s: float  # from spawning the process to its exit
    cpu_s: float  # its CPU time, user and system: what load on the host inflates least


def run_one(name: str, endpoint: str, key: str) -> Ran:
    """Run ``name``'s script in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPTS[name], endpoint, key],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=CHILD_ENV,
    )
    wall_s = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{name} one-shot failed (rc {done.returncode}): {done.stderr[-500:]}")
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return Ran(wall_s, cpu_s)


def settled_writes(metrics: EtcdMetrics) -> float | None:
    """etcd's raft write count once it stopped moving (it is updated after the answer)."""
    last = metrics.sample()
    for _ in range(50):
        time.sleep(0.1)
        now = metrics.sample()
        if now is None or last is None or now.raft_writes == last.raft_writes:
            return None if now is None else now.raft_writes
        last = now
    return None


def count_one(name: str, endpoint: str, key: str, metrics: EtcdMetrics) -> Counted:
    """One process of ``name`` run alone: the raft writes etcd saw, the leases it left."""
    leases_before = leases_now(endpoint)
    before = settled_writes(metrics)
    run_one(name, endpoint, key)
    after = settled_writes(metrics)
    leases_after = leases_now(endpoint)
    writes = None if before is None or after is None else after - before
    left = None if leases_before is None or leases_after is None else leases_after - leases_before
    return Counted(writes, left)


def measure_oneshot(
    endpoint: str, prefix: str, metrics: EtcdMetrics, rounds: int, checks: Checks
) -> dict[str, Any]:
    """The raft writes and the leases left of one process per client, run alone; then
    wall and CPU time per process by client, over interleaved rounds."""
    target = endpoint.split(",")[0].rpartition("://")[2]
    names = [name for name in SCRIPTS if name != ETCD3 or importlib.util.find_spec("etcd3")]
    # Counted first, python3-etcd3 last: every lease it leaves expires 15 s later, a
    # raft write of its own that would land in the next counting window.
    counted = {
        name: count_one(name, target, f"{prefix}oneshot/counted/{name}", metrics)
        for name in sorted(names, key=lambda name: name == ETCD3)
    }
    ran: dict[str, list[Ran]] = {name: [] for name in names}
    for name in names:  # one untimed process each: the OS caches the files they read
        run_one(name, target, f"{prefix}oneshot/warm/{name}")
    for round_ in range(rounds):
        # Rotated, so that no client always runs right after another.
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            ran[name].append(run_one(name, target, f"{prefix}oneshot/{round_}/{name}"))
    results: dict[str, Any] = {}
    for name in names:
        results[name] = {
            **Latency.of([run.wall_s for run in ran[name]]).as_dict(),
            "cpu_p50_ms": Latency.of([run.cpu_s for run in ran[name]]).p50_ms,
            "raft_writes": counted[name].raft_writes,
            "leases_left": counted[name].leases_left,
            "does": DOES[name],
        }
    ours = results[OURS]
    checks.check(ours["leases_left"] in (0, None), f"the one-shot left {ours['leases_left']} lease")
    if ours["raft_writes"] not in (3, None):
        checks.warn(f"the one-shot made {ours['raft_writes']:g} raft writes, not 3")
    for name in names:
        results[name]["ours_vs_it"] = ratio(ours["p50_ms"], results[name]["p50_ms"])
        results[name]["ours_vs_it_cpu"] = ratio(ours["cpu_p50_ms"], results[name]["cpu_p50_ms"])
    return results
