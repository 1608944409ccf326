"""``demo``: workers sharing threads and a leader role through etcd, narrated.

With no endpoints given it starts a throwaway three-member etcd on 127.0.0.1 and
removes it afterwards. Against your own etcd (``--endpoints`` / ``ETCDCTL_ENDPOINTS``)
it writes only under ``<prefix>/<random id>/`` (prefix ``/etcd-leases-demo/`` unless
``--prefix`` says otherwise) and deletes everything there when it ends.

In order: one owner per conversation thread, the others routed to it; a holder
paused past its TTL, fenced out by the token of the worker that took over; an
atomic hand-over; leader election, the leader's process killed (SIGKILL) and a
successor taking over after the TTL, then resigning and handing over at once; an
etcd member (the raft leader) killed under a leader that keeps its lease.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from etcd_leases.cli import exits
from etcd_leases.cli.connection import connection_env, endpoints_given, open_provider
from etcd_leases.cli.options import Commands
from etcd_leases.cli.output import Output
from etcd_leases.election import Election
from etcd_leases.etcd.txn import prefix_end
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.hold import HeldLease
from etcd_leases.providers import EtcdLeaseProvider

if TYPE_CHECKING:
    from etcd_leases.testing import EtcdCluster

TTL_MS = 2000
NAMES = ("worker-a", "worker-b", "worker-c")
# Longer than any step takes on a busy machine; a demo that hangs is a failure.
_DEADLINE_S = 120


def add_commands(commands: Commands) -> None:
    demo = commands.add_parser("demo", help="watch leases, fencing and election at work")
    demo.set_defaults(handler=_demo, long_lived=True)


async def _demo(args: argparse.Namespace, out: Output) -> int:
    base = args.prefix or "/etcd-leases-demo/"
    prefix = f"{base.rstrip('/')}/{uuid.uuid4().hex[:8]}/"
    if endpoints_given(args):
        await Demo(args, out, prefix, None).run()
        return exits.OK
    from etcd_leases.testing import EtcdCluster  # only here: it is slow to import

    with EtcdCluster(3) as cluster:
        args.endpoints = cluster.endpoint_string
        out.event(
            "etcd",
            f"started a throwaway 3-member etcd at {args.endpoints}",
            endpoints=cluster.endpoints,
            pids=[member.pid for member in cluster.members],
        )
        await Demo(args, out, prefix, cluster).run()
    out.event("etcd", "stopped the throwaway etcd and removed its data")
    return exits.OK


class DemoFailed(Exception):
    """Something the demo shows did not happen as it should."""


def expect(condition: bool, failure: str) -> None:
    if not condition:
        raise DemoFailed(failure)


class Demo:
    def __init__(
        self, args: argparse.Namespace, out: Output, prefix: str, cluster: EtcdCluster | None
    ) -> None:
        self.args = args
        self.out = out
        self.prefix = prefix
        self.cluster = cluster
        self.say = out.event

    async def run(self) -> None:
        async with AsyncExitStack() as stack:
            workers = [
                await stack.enter_async_context(open_provider(self.args, prefix=self.prefix))
                for _ in NAMES
            ]
            stack.push_async_callback(self.clean_up)
            self.say(
                "start",
                f"three workers, each with its own connection, keys under "
                f"{self.prefix}; lease TTL {TTL_MS} ms",
                prefix=self.prefix,
            )
            async with asyncio.timeout(_DEADLINE_S):
                await self.route(workers)
                await self.fence(workers)
                await self.hand_over(workers)
                await self.elect(workers)

    async def route(self, workers: list[EtcdLeaseProvider]) -> None:
        self.out.heading("1. one owner per conversation thread")
        thread = "resource-1\0thread-42"  # Mastra's key shape: resourceId NUL threadId
        results = await asyncio.gather(
            *(w.acquire_lease(thread, n, TTL_MS) for w, n in zip(workers, NAMES, strict=True))
        )
        winner = next(r for r in results if r.acquired)
        self.say(
            "owner",
            f"{winner.owner} owns thread-42 (token {winner.token}); "
            f"the others are told to route to {[r.owner for r in results if not r.acquired]}",
            owner=winner.owner,
            token=winner.token,
        )
        await workers[NAMES.index(winner.owner or "")].release_lease(thread, winner.owner or "")

    async def fence(self, workers: list[EtcdLeaseProvider]) -> None:
        self.out.heading("2. a paused holder is fenced out")
        a, b = workers[0], workers[1]
        first = await a.acquire_lease("job:7", "worker-a", TTL_MS)
        assert first.token is not None
        data = self.prefix + "data/job:7"
        await a.put_fenced("job:7", "worker-a", first.token, data, b"step 1 by worker-a")
        self.say(
            "held",
            f"worker-a holds job:7 (token {first.token}) and writes step 1; "
            f"then it freezes (a GC pause, SIGSTOP): no more renewals",
            owner="worker-a",
            token=first.token,
        )
        started = time.monotonic()
        async with AsyncExitStack() as stack:
            async with self.out.waiting("worker-b waits for job:7 to expire"):
                taking = b.hold("job:7", "worker-b", TTL_MS, wait=True)
                lease = await stack.enter_async_context(taking)
            took = time.monotonic() - started
            self.say(
                "takeover",
                f"worker-b took job:7 {took:.2f} s later, when etcd expired "
                f"worker-a's lease (token {lease.token})",
                token=lease.token,
                seconds=took,
            )
            await lease.put(data, "step 2 by worker-b")
            late = await a.put_fenced("job:7", "worker-a", first.token, data, b"stale write")
            stored = (await b.get_value(data) or b"").decode()
            self.say(
                "fenced",
                f"worker-a wakes and writes with token {first.token}: "
                f"{'applied' if late else 'refused'}; the data says {stored!r}",
                applied=late,
                stored=stored,
            )

    async def hand_over(self, workers: list[EtcdLeaseProvider]) -> None:
        self.out.heading("3. an atomic hand-over")
        b, c = workers[1], workers[2]
        async with b.hold("job:8", "worker-b", TTL_MS) as lease:
            started = time.monotonic()
            await lease.transfer("worker-c")
            async with c.adopt("job:8", "worker-c", TTL_MS) as adopted:
                took = (time.monotonic() - started) * 1000
                self.say(
                    "handover",
                    f"worker-b handed job:8 (token {lease.token}) to worker-c "
                    f"(token {adopted.token}) in {took:.0f} ms; the key was never free",
                    token=adopted.token,
                    ms=took,
                )

    async def elect(self, workers: list[EtcdLeaseProvider]) -> None:
        self.out.heading("4. leader election: a crash, a resignation, an etcd member lost")
        terms: asyncio.Queue[tuple[str, float]] = asyncio.Queue()
        stops = {name: asyncio.Event() for name in NAMES[1:]}

        def lead_as(name: str) -> Callable[[HeldLease], Awaitable[None]]:
            async def lead(lease: HeldLease) -> None:
                terms.put_nowait((name, time.monotonic()))
                self.say(
                    "leader", f"{name} leads (token {lease.token})", leader=name, token=lease.token
                )
                await asyncio.Event().wait()

            return lead

        # The first leader campaigns from a process of its own, so that its crash is
        # real: SIGKILL, nothing released, its lease left to expire.
        first = NAMES[0]
        crashing = await self.start_candidate(first)
        runs: dict[str, asyncio.Task[None]] = {}
        try:
            leading = await self.first_leading(crashing)
            self.say(
                "leader",
                f"{first} leads (token {leading['token']}), in process {crashing.pid}",
                leader=first,
                token=leading["token"],
                pid=crashing.pid,
            )
            runs = {
                name: asyncio.create_task(
                    Election(w, "leader", name, TTL_MS).run(lead_as(name), stop=stops[name])
                )
                for w, name in zip(workers[1:], NAMES[1:], strict=True)
            }
            crashing.kill()
            await crashing.wait()
            crashed_at = time.monotonic()
            self.say(
                "crash",
                f"{first}'s process {crashing.pid} is killed (SIGKILL): nothing is released; "
                f"the others wait for its TTL",
                crashed=first,
                pid=crashing.pid,
            )
            async with self.out.waiting(f"the others wait for {first}'s TTL"):
                second, at = await terms.get()
            self.say(
                "takeover",
                f"{second} took over {at - crashed_at:.2f} s after the crash, "
                f"when etcd expired {first}'s lease",
                leader=second,
                seconds=at - crashed_at,
            )
            resigned_at = time.monotonic()
            stops[second].set()
            await runs.pop(second)
            third, at = await terms.get()
            took = (at - resigned_at) * 1000
            self.say(
                "handover",
                f"{second} resigned; {third} took over {took:.0f} ms later",
                leader=third,
                ms=took,
            )
            await self.lose_member(workers[NAMES.index(third)], third)
        finally:
            if crashing.returncode is None:
                crashing.kill()
                await crashing.wait()
            for run in runs.values():
                run.cancel()
            await asyncio.gather(*runs.values(), return_exceptions=True)

    async def start_candidate(self, name: str) -> asyncio.subprocess.Process:
        """``etcd-leases elect leader --id NAME`` in a child process, on our connection."""
        env = {**os.environ, **connection_env(self.args), "ETCD_LEASES_PREFIX": self.prefix}
        if self.args.user is not None:
            env["ETCDCTL_USER"] = self.args.user
        if self.args.password is not None:
            env["ETCDCTL_PASSWORD"] = self.args.password
        sleep = [sys.executable, "-c", "import time; time.sleep(3600)"]
        return await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "etcd_leases", "elect", "leader", "--id", name],
            *["--ttl", f"{TTL_MS}ms", "--json", "--log-level", "error", "--", *sleep],
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    async def first_leading(self, candidate: asyncio.subprocess.Process) -> dict[str, Any]:
        """The candidate's ``leading`` event, read from its ``--json`` output."""
        assert candidate.stdout is not None and candidate.stderr is not None
        async for line in candidate.stdout:
            event: dict[str, Any] = json.loads(line)
            if event["event"] == "leading":
                return event
        error = (await candidate.stderr.read()).decode(errors="replace").strip()
        raise DemoFailed(f"the candidate process exited with {await candidate.wait()}: {error}")

    async def lose_member(self, provider: EtcdLeaseProvider, leader: str) -> None:
        if self.cluster is None:
            return
        member = await asyncio.to_thread(self.cluster.leader)
        member.kill()
        self.say(
            "member_killed",
            f"killed etcd member {member.name}, the raft leader; waiting two TTLs",
            member=member.name,
        )
        async with self.out.waiting("two TTLs pass"):
            await asyncio.sleep(2 * TTL_MS / 1000)
        now = await provider.get_lease_owner("leader")
        self.say(
            "survived",
            f"the leader is still {now}: its renewals moved to another member",
            leader=now,
            unchanged=now == leader,
        )

    async def clean_up(self) -> None:
        """Revoke the leases left under our prefix (a crashed worker's) and delete it all."""
        prefix = self.prefix.encode()
        async with open_provider(self.args, prefix=self.prefix) as provider:
            client = provider.client
            request = pb.RangeRequest(key=prefix, range_end=prefix_end(prefix))
            response = await client.call("/etcdserverpb.KV/Range", request, pb.RangeResponse)
            for kv in response.kvs:
                if kv.lease:
                    await client.revoke(kv.lease)
            delete = pb.DeleteRangeRequest(key=prefix, range_end=prefix_end(prefix))
            await client.call("/etcdserverpb.KV/DeleteRange", delete, pb.DeleteRangeResponse)
        self.say("clean", f"removed everything under {self.prefix}", prefix=self.prefix)
