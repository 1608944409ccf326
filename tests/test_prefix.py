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


async def test_a_watch_moves_off_a_frozen_member_within_seconds(
    etcd_cluster: EtcdCluster,
) -> None:
    prefix = unique_prefix()
    leader = await asyncio.to_thread(etcd_cluster.leader)
    frozen = next(member for member in etcd_cluster.members if member is not leader)
    others = [member.endpoint for member in etcd_cluster.members if member is not frozen]
    async with (
        # The watch's stream starts on the first endpoint: a follower, so that
        # freezing it needs no election before the writes go through.
        EtcdLeaseProvider([frozen.endpoint, *others], prefix=prefix, timeout=2) as watching,
        EtcdLeaseProvider(leader.endpoint, prefix=prefix) as writer,
    ):
        await writer.acquire_lease("before", "alice", 30_000)
        changes = watch_owners(watching.client, watching.etcd_key(""))
        async with aclosing(changes):
            first = await asyncio.wait_for(anext(changes), 10)
            assert (first.key, first.owner) == ("before", "alice")
            # Frozen, the member keeps the connection open and answers nothing; gRPC
            # keepalive alone would take 5-15 s to notice, the stream's probe takes 3.
            frozen.pause()
            seen: dict[str, KeyOwner] = {}
            async with asyncio.timeout(5):
                await writer.acquire_lease("after", "bob", 30_000)
                await writer.release_lease("before", "alice")
                while seen.get("after") is None or "before" not in seen:
                    change = await anext(changes)
                    seen[change.key] = change
            assert seen["after"].owner == "bob"
            assert seen["before"].owner is None


async def test_a_watch_reports_what_changed_in_history_lost_to_compaction(
    etcd: EtcdCluster,
) -> None:
    prefix = unique_prefix()
    async with EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as provider:
        await provider.acquire_lease("gone", "bob", 30_000)
        await provider.acquire_lease("kept", "alice", 30_000)
        changes = watch_owners(provider.client, provider.etcd_key(""))
        async with aclosing(changes):
            initial = [await asyncio.wait_for(anext(changes), 10) for _ in range(2)]
            assert [(o.key, o.owner) for o in initial] == [("gone", "bob"), ("kept", "alice")]
            # The watch starts only when the next change is asked for: the history
            # it needs is compacted before it does.
            await provider.release_lease("gone", "bob")
            added = await provider.acquire_lease("added", "carol", 30_000)
            await asyncio.to_thread(etcd.etcdctl, "compact", str(added.token))
            caught_up = [await asyncio.wait_for(anext(changes), 10) for _ in range(2)]
            assert [(o.key, o.owner, o.token) for o in caught_up] == [
                ("added", "carol", added.token),
                ("gone", None, None),
            ]
            # Live again, and what the re-read covered does not come twice.
            later = await provider.acquire_lease("later", "dave", 30_000)
            change = await asyncio.wait_for(anext(changes), 10)
            assert (change.key, change.owner, change.token) == ("later", "dave", later.token)
