"""Thousands of keys held in one process share one watch: every change still seen.

A held key's tenure ends the moment anyone releases, transfers or deletes it. The
keys of a provider are watched by one watch over its prefix (``etcd/watch/
held_keys.py``); these tests hold many keys and check that a change of any one is
seen, of it alone, also across a member killed under the watch and a compaction of
the history the watch still needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Sequence

import pytest

from etcd_leases import EtcdLeaseProvider, HeldLease
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.txn import Txn, delete, put
from etcd_leases.etcd.watch import WatchStream
from etcd_leases.etcd.watch import stream as watch_stream
from etcd_leases.etcd.watch.held_keys import HeldKeysWatch
from etcd_leases.testing import EtcdCluster
from tests.conftest import unique_prefix

TTL_MS = 15_000


async def hold_many(
    provider: EtcdLeaseProvider, stack: contextlib.AsyncExitStack, count: int
) -> list[HeldLease]:
    """Hold ``k0`` .. ``k<count-1>`` (taken concurrently, 100 at a time)."""
    in_flight = asyncio.Semaphore(100)

    async def take(i: int) -> HeldLease:
        async with in_flight:
            return await stack.enter_async_context(provider.hold(f"k{i}", f"me-{i}", TTL_MS))

    return list(await asyncio.gather(*(take(i) for i in range(count))))


@contextlib.asynccontextmanager
async def holding_on_first_member(
    cluster: EtcdCluster, count: int
) -> AsyncIterator[tuple[list[HeldLease], EtcdLeaseProvider]]:
    """``count`` keys held by a provider whose streams are on ``members[0]``, and a
    provider of the same prefix that knows only the other members."""
    prefix = unique_prefix()
    async with (
        EtcdLeaseProvider(cluster.endpoints, prefix=prefix, timeout=5) as provider,
        EtcdLeaseProvider(cluster.endpoints[1:], prefix=prefix, timeout=5) as anyone,
        contextlib.AsyncExitStack() as stack,
    ):
        yield await hold_many(provider, stack, count), anyone


async def seen_lost(leases: Sequence[HeldLease], within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        await asyncio.gather(*(lease.lost.wait() for lease in leases))


def lost(leases: Sequence[HeldLease]) -> list[str]:
    return [lease.key for lease in leases if lease.lost.is_set()]


async def test_a_change_of_any_one_of_thousands_of_held_keys_is_seen_and_only_its(
    etcd: EtcdCluster,
) -> None:
    prefix = unique_prefix()
    async with (
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix, timeout=5) as provider,
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix, timeout=5) as anyone,
        contextlib.AsyncExitStack() as stack,
    ):
        held = await hold_many(provider, stack, 3000)
        assert len({lease.key for lease in held}) == 3000
        released, transferred, deleted = random.sample(held, 3)
        await anyone.release_lease(released.key, released.owner)
        assert await anyone.transfer_lease(transferred.key, transferred.owner, "you", TTL_MS)
        await anyone.client.txn(Txn.when().then(delete(anyone.etcd_key(deleted.key))).request)
        await seen_lost([released, transferred, deleted])
        assert "released" in (released.lost_reason or "")
        assert "handed to 'you'" in (transferred.lost_reason or "")
        assert "deleted" in (deleted.lost_reason or "")
        # A key of the same name under another prefix is another key: no loss.
        async with EtcdLeaseProvider(etcd.endpoints, prefix=prefix + "x/") as elsewhere:
            await elsewhere.release_lease(held[0].key, held[0].owner)
            assert (await elsewhere.acquire_lease(held[0].key, "other", TTL_MS)).acquired
            await elsewhere.release_lease(held[0].key, "other")
        # Seen in order: a change made after those is seen after them, so by now
        # every change made so far has been.
        await anyone.release_lease(held[1].key, held[1].owner)
        await seen_lost([held[1]])
        assert sorted(lost(held)) == sorted(
            lease.key for lease in (released, transferred, deleted, held[1])
        )


async def test_a_change_whose_history_was_compacted_under_the_watch_is_seen(
    etcd_cluster: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the member's death may break the holder's watch stream, not its silence.
    monkeypatch.setattr(watch_stream, "_PROBE_AFTER_S", 120.0)
    prefix = unique_prefix()
    async with (
        EtcdLeaseProvider(etcd_cluster.endpoints, prefix=prefix, timeout=5) as provider,
        contextlib.AsyncExitStack() as stack,
    ):
        held = await hold_many(provider, stack, 500)
        # The member the holder's watch is on (the first to answer it, not always the
        # first listed); the other client knows only the others.
        watched = provider.client.endpoints[provider._watches._endpoint]
        (member,) = [m for m in etcd_cluster.members if m.endpoint in watched]
        others = [m.endpoint for m in etcd_cluster.members if m is not member]
        async with EtcdLeaseProvider(others, prefix=prefix, timeout=5) as anyone:
            changed = held[7]
            member.pause()  # frozen, it delivers nothing
            await asyncio.to_thread(etcd_cluster.leader)
            assert await anyone.transfer_lease(changed.key, changed.owner, "you", TTL_MS)
            assert (await anyone.acquire_lease("unrelated", "them", TTL_MS)).acquired
            # The transfer's event is gone from etcd's history...
            await asyncio.to_thread(etcd_cluster.compact)
            assert not changed.lost.is_set()
            # ...when the watch resumes on another member, from before the compaction.
            member.kill()
            await seen_lost([changed], within=20)
            assert "compacted" in (changed.lost_reason or "")
            # The re-read ended that tenure alone, and the watch goes on from there.
            assert lost(held) == [changed.key]
            await anyone.release_lease(held[9].key, held[9].owner)
            await seen_lost([held[9]])
            assert "released" in (held[9].lost_reason or "")
            assert sorted(lost(held)) == sorted([changed.key, held[9].key])


async def test_changes_made_while_the_watch_moves_off_a_killed_member_are_seen(
    etcd_cluster: EtcdCluster,
) -> None:
    async with holding_on_first_member(etcd_cluster, 500) as (held, anyone):
        etcd_cluster.members[0].kill()  # the member the holder's streams are on
        await asyncio.to_thread(etcd_cluster.leader)
        await anyone.release_lease(held[3].key, held[3].owner)
        assert await anyone.transfer_lease(held[4].key, held[4].owner, "you", TTL_MS)
        await seen_lost([held[3], held[4]], within=20)
        assert "released" in (held[3].lost_reason or "")
        assert "handed to 'you'" in (held[4].lost_reason or "")
        # Moved for good: a change made now is seen too, and none other was reported.
        await anyone.release_lease(held[5].key, held[5].owner)
        await seen_lost([held[5]])
        assert sorted(lost(held)) == sorted(lease.key for lease in held[3:6])


async def test_a_tenure_registered_after_the_watch_passed_its_start_looks_back(
    etcd: EtcdCluster,
) -> None:
    prefix = unique_prefix().encode()
    client = EtcdClient(etcd.endpoints, timeout=5)
    watches = WatchStream(client)
    held_keys = HeldKeysWatch(watches, client, prefix)
    changes: dict[bytes, asyncio.Future[str]] = {}

    def watch(name: bytes, start: int) -> None:
        changes[name] = asyncio.get_running_loop().create_future()
        held_keys.watch(prefix + name, start, changes[name].set_result, changes[name].set_exception)

    async def write(name: bytes, value: bytes) -> int:
        response = await client.txn(Txn.when().then(put(prefix + name, value)).request)
        return response.header.revision

    try:
        watch(b"first", await write(b"first", b"me") + 1)  # the shared watch starts here
        taken = await write(b"late", b"me")
        await write(b"late", b"you")  # changed before its tenure registers
        unchanged = await write(b"quiet", b"me")
        watch(b"sentinel", await write(b"sentinel", b"me") + 1)
        await write(b"sentinel", b"you")
        # Events come in order: the watch has gone past every write above.
        assert "handed to 'you'" in await asyncio.wait_for(changes[b"sentinel"], 10)
        watch(b"late", taken + 1)
        watch(b"quiet", unchanged + 1)
        watch(b"ancient", 1)  # before the watch began: its key is read again
        assert "handed to 'you'" in await asyncio.wait_for(changes[b"late"], 10)
        assert "before its watch" in await asyncio.wait_for(changes[b"ancient"], 10)
        await write(b"first", b"you")
        await asyncio.wait_for(changes[b"first"], 10)
        assert not changes[b"quiet"].done()
    finally:
        await watches.close()  # ends the tenures left with ProviderClosed
        await client.close()
        for change in changes.values():
            if change.done():
                change.exception()  # retrieved
