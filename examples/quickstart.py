"""The README's quickstart: acquire, route to the owner, release.

Uses the etcd named by ETCDCTL_ENDPOINTS; without it, starts a throwaway local etcd.
"""

import asyncio
import os

from etcd_leases import EtcdLeaseProvider
from etcd_leases.testing import EtcdCluster


async def quickstart(endpoints: str) -> None:
    async with EtcdLeaseProvider(endpoints) as leases:
        me = f"worker-{os.getpid()}"
        result = await leases.acquire_lease("thread:42", me, ttl_ms=15_000)
        if result.acquired:
            print(f"{me} owns thread:42 (fencing token {result.token}, ttl {result.ttl_ms} ms)")
            other = await leases.acquire_lease("thread:42", "worker-b", ttl_ms=15_000)
            print(f"worker-b is told to route to {other.owner}")
            await leases.release_lease("thread:42", me)
        print("owner after release:", await leases.get_lease_owner("thread:42"))


def main() -> None:
    if "ETCDCTL_ENDPOINTS" in os.environ:
        asyncio.run(quickstart(os.environ["ETCDCTL_ENDPOINTS"]))
        return
    with EtcdCluster(1) as etcd:
        print(f"started a throwaway etcd at {etcd.endpoint_string}")
        asyncio.run(quickstart(etcd.endpoint_string))


if __name__ == "__main__":
    main()
