"""Listing and watching every lease key under a prefix (``etcd-leases list`` / ``watch``)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from etcd_leases import EtcdLeaseProvider
from etcd_leases.etcd.prefix import KeyOwner, list_owners, watch_owners
from etcd_leases.testing import EtcdCluster
from tests.conftest import unique_prefix


async def test_list_owners_reads_keys_under_the_prefix_with_their_ttl(etcd: EtcdCluster) -> None:
    prefix = unique_prefix()
    async with EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as provider:
        held = await provider.acquire_lease("job:1", "alice", 30_000)
        await provider.acquire_lease("other", "bob", 30_000)
        etcd.etcdctl("put", prefix + "job:plain", "carol")  # no lease: no TTL
        owners = await list_owners(provider.client, provider.etcd_key(""), b"job:")
        assert [(o.key, o.owner, o.token) for o in owners] == [
            ("job:1", "alice", held.token),
            ("job:plain", "carol", owners[1].token),
        ]
        assert owners[0].ttl_s is not None and 25 <= owners[0].ttl_s <= 30
        assert owners[1].ttl_s is None


async def test_a_watch_survives_the_loss_of_its_member(etcd_cluster: EtcdCluster) -> None:
    prefix = unique_prefix()
    endpoints = etcd_cluster.endpoints
    async with (
        EtcdLeaseProvider(endpoints, prefix=prefix, timeout=2) as watching,
        EtcdLeaseProvider(endpoints[1:], prefix=prefix) as writer,
    ):
        await writer.acquire_lease("before", "alice", 30_000)
        changes = watch_owners(watching.client, watching.etcd_key(""))
        async with aclosing(changes):
            first = await asyncio.wait_for(anext(changes), 10)
            assert (first.key, first.owner) == ("before", "alice")
            # The watch's stream is on the first endpoint: take that member away.
            etcd_cluster.members[0].kill()
            await writer.acquire_lease("after", "bob", 30_000)
            await writer.release_lease("before", "alice")
            seen: dict[str, KeyOwner] = {}
            while seen.get("after") is None or "before" not in seen:
                change = await asyncio.wait_for(anext(changes), 20)
                seen[change.key] = change
            assert seen["after"].owner == "bob"
            assert seen["before"].owner is None
