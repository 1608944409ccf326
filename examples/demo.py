"""The demo: three workers share threads and a leader role through etcd.

Starts a throwaway three-member etcd cluster on 127.0.0.1 (or uses ETCDCTL_ENDPOINTS),
then shows, in order: one owner per thread with followers routed to it, fencing, an
atomic hand-off, leader election, the leader's crash and another taking over, and an
etcd member dying underneath without anyone noticing.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

from etcd_leases import Election, EtcdLeaseProvider, HeldLease
from etcd_leases.testing import EtcdCluster

TTL_MS = 2000


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')}  {message}", flush=True)


async def demo(endpoints: list[str], cluster: EtcdCluster | None) -> None:
    async with AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(EtcdLeaseProvider(endpoints, prefix="/demo/"))
            for _ in range(3)
        ]
        names = ["worker-a", "worker-b", "worker-c"]

        # 1. One owner per conversation thread; the others route to it.
        thread = "resource-1\0thread-42"  # Mastra's key shape: resourceId NUL threadId
        results = await asyncio.gather(
            *(w.acquire_lease(thread, n, TTL_MS) for w, n in zip(workers, names, strict=True))
        )
        owner = next(r.owner for r in results if r.acquired)
        log(f"thread owned by {owner}; the others route to {[r.owner for r in results]}")
        await workers[0].release_lease(thread, owner or "")

        # 2. Holding, fencing, handing on.
        async with workers[0].hold("job:42", "worker-a", TTL_MS) as lease:
            log(
                f"worker-a holds job:42 (token {lease.token}); fenced write applied: "
                f"{await lease.put('/demo-data/job:42', 'step 1')}"
            )
            await lease.transfer("worker-b")
            log(
                f"handed to worker-b; worker-a's lease lost: {lease.lost.is_set()}; "
                f"worker-a's late write applied: {await lease.put('/demo-data/job:42', 'x')}"
            )
        async with workers[1].adopt("job:42", "worker-b", TTL_MS) as lease:
            log(f"worker-b adopted job:42 with token {lease.token}")

        # 3. Leader election; the leader crashes; another takes over.
        terms: asyncio.Queue[str] = asyncio.Queue()

        def lead_as(name: str) -> Callable[[HeldLease], Awaitable[None]]:
            async def lead(lease: HeldLease) -> None:
                terms.put_nowait(name)
                log(f"{name} leads (token {lease.token})")
                await asyncio.Event().wait()

            return lead

        runs = [
            asyncio.create_task(Election(w, "leader", n, TTL_MS).run(lead_as(n)))
            for w, n in zip(workers, names, strict=True)
        ]
        first = await terms.get()
        crashed = names.index(first)
        # As if the process died: its connections drop, nothing is released.
        await workers[crashed].close()
        runs[crashed].cancel()
        await asyncio.gather(runs[crashed], return_exceptions=True)
        started = time.monotonic()
        second = await asyncio.wait_for(terms.get(), 10)
        log(f"{first} crashed; {second} took over {time.monotonic() - started:.1f} s later")

        # 4. An etcd member dies under the leader: renewals move to another member.
        if cluster is not None:
            cluster.members[0].kill()
            log("killed etcd member 0; waiting two TTLs")
            await asyncio.sleep(2 * TTL_MS / 1000)
            survivor = workers[names.index(second)]
            log(f"leader is still {await survivor.get_lease_owner('leader')}")
        for run in runs:
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)


def main() -> None:
    if "ETCDCTL_ENDPOINTS" in os.environ:
        asyncio.run(demo(os.environ["ETCDCTL_ENDPOINTS"].split(","), None))
        return
    with EtcdCluster(3) as cluster:
        log(f"started a throwaway 3-member etcd at {cluster.endpoint_string}")
        asyncio.run(demo(cluster.endpoints, cluster))


if __name__ == "__main__":
    main()
