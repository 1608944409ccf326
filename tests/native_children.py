"""Our side of the etcdctl interop tests, as a process the test can SIGKILL:
``python -m tests.native_children <role> ENDPOINTS NAME``. Prints one line per event."""

from __future__ import annotations

import asyncio
import sys

from etcd_leases import EtcdLeaseProvider
from etcd_leases.etcd.native import NativeElection, NativeLock


async def leader(endpoints: str, name: str) -> None:
    """Campaign in the etcd election ``name`` (1 s session) and lead until killed."""
    async with EtcdLeaseProvider(endpoints) as provider:
        election = NativeElection(provider, name, ttl_s=1)
        token = await election.campaign("child")
        print("lead", token, election.key, flush=True)
        await asyncio.Event().wait()


async def holder(endpoints: str, name: str) -> None:
    """Take the etcd lock ``name`` (1 s session) and hold it until killed."""
    async with EtcdLeaseProvider(endpoints) as provider:
        lock = NativeLock(provider, name, ttl_s=1)
        token = await lock.acquire()
        print("held", token, lock.key, flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    role, endpoints, name = sys.argv[1:]
    asyncio.run({"leader": leader, "holder": holder}[role](endpoints, name))
