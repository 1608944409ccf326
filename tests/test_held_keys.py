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
from etcd_leases.errors import LeaseError, ProviderClosed
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.txn import Txn, delete, put
from etcd_leases.etcd.watch import WatchStream
from etcd_leases.etcd.watch import held_keys as held_keys_module
from etcd_leases.etcd.watch import stream as watch_stream
from etcd_leases.etcd.watch.held_keys import ChangeCallback, HeldKey, HeldKeysWatch
from etcd_leases.etcd.watch.watcher import ErrorCallback
from etcd_leases.testing import EtcdCluster
from tests.conftest import eventually, unique_prefix

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
    # The re-read after the compaction reads the keys a few at a time: many pages.
    monkeypatch.setattr(held_keys_module, "_PAGE", 7)
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
            assert changed.lost_reason == "the key changed while its watch history was compacted"
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


def ignored(_: object) -> None:
    """A callback whose calls a test does not look at."""


class SharedWatch:
    """A shared watch of its own over ``prefix``, and a client to write its keys."""

    def __init__(self, etcd: EtcdCluster, prefix: bytes) -> None:
        self.prefix = prefix
        self.client = EtcdClient(etcd.endpoints, timeout=5)
        self.watches = WatchStream(self.client)
        self.held_keys = HeldKeysWatch(self.watches, self.client, prefix)

    def watch(
        self,
        name: bytes,
        start: int,
        on_changed: ChangeCallback,
        on_error: ErrorCallback = ignored,
    ) -> HeldKey:
        return self.held_keys.watch(self.prefix + name, start, on_changed, on_error)

    async def write(self, name: bytes, value: bytes | None) -> int:
        """Put ``value`` under ``name`` (``None``: delete it); the revision of the write."""
        key = self.prefix + name
        op = delete(key) if value is None else put(key, value)
        return (await self.client.txn(Txn.when().then(op).request)).header.revision

    async def close(self) -> None:
        await self.watches.close()  # ends the tenures left with ProviderClosed
        await self.client.close()


@pytest.fixture
async def shared(etcd: EtcdCluster) -> AsyncIterator[SharedWatch]:
    watch = SharedWatch(etcd, unique_prefix().encode())
    yield watch
    await watch.close()


async def test_a_tenure_registered_after_the_watch_passed_its_start_looks_back(
    shared: SharedWatch,
) -> None:
    changes: dict[bytes, asyncio.Future[str]] = {}

    def watch(name: bytes, start: int) -> None:
        changes[name] = asyncio.get_running_loop().create_future()
        shared.watch(name, start, changes[name].set_result, changes[name].set_exception)

    write = shared.write
    older = await write(b"older", b"me")  # before the shared watch began
    await write(b"moved", b"me")
    moved = await write(b"moved", b"you")  # at the very revision its tenure starts
    watch(b"first", await write(b"first", b"me") + 1)  # the shared watch starts here
    taken = await write(b"late", b"me")
    await write(b"late", b"you")  # changed before its tenure registers
    unchanged = await write(b"quiet", b"me")
    watch(b"odd", await write(b"odd", b"me") + 1)
    await write(b"odd", b"\xffme")  # not UTF-8: a foreign writer's value
    watch(b"gone", await write(b"gone", b"me") + 1)
    await write(b"gone", None)
    watch(b"sentinel", await write(b"sentinel", b"me") + 1)
    await write(b"sentinel", b"you")
    # Events come in order: the watch has gone past every write above.
    assert "handed to 'you'" in await asyncio.wait_for(changes[b"sentinel"], 10)
    assert changes[b"odd"].result() == "the key was handed to '\ufffdme'"
    assert changes[b"gone"].result() == "the key was released, deleted or expired"
    watch(b"late", taken + 1)
    watch(b"quiet", unchanged + 1)
    watch(b"ancient", 1)  # before the watch began: its key is read again
    assert "handed to 'you'" in await asyncio.wait_for(changes[b"late"], 10)
    reread = "the key changed before its watch covered it"
    assert await asyncio.wait_for(changes[b"ancient"], 10) == reread
    watch(b"moved", moved)
    assert await asyncio.wait_for(changes[b"moved"], 10) == reread
    watch(b"older", older + 1)  # its key is read again too, and found unchanged
    await shared.held_keys._rereads.wait(10)
    assert not changes[b"older"].done()
    await write(b"first", b"you")
    await asyncio.wait_for(changes[b"first"], 10)
    assert not changes[b"quiet"].done()
    await shared.close()
    assert isinstance(changes[b"quiet"].exception(), ProviderClosed)


async def test_a_cancelled_tenure_hears_nothing_more_and_the_last_one_ends_the_watch(
    shared: SharedWatch,
) -> None:
    heard: list[str] = []
    write, held_keys = shared.write, shared.held_keys
    keep = shared.watch(b"keep", await write(b"keep", b"me") + 1, ignored)
    taken = await write(b"key", b"me")
    await write(b"key", b"you")
    sentinel: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    shared.watch(b"s", await write(b"s", b"me") + 1, sentinel.set_result)
    await write(b"s", b"you")
    await asyncio.wait_for(sentinel, 10)  # the watch is past every write above
    # The change is remembered: reported to this tenure from the event loop...
    late = shared.watch(b"key", taken + 1, heard.append)
    late.cancel()  # ...unless it is cancelled first
    await asyncio.sleep(0.1)
    assert heard == []
    assert len(held_keys) == 1
    # Of two tenures of one key, the one left after the other's cancel is told.
    start = await write(b"pair", b"me") + 1
    left = shared.watch(b"pair", start, heard.append)
    assert repr(left) == f"<HeldKey {shared.prefix + b'pair'!r} from {start}>"
    shared.watch(b"pair", start, heard.append).cancel()
    await write(b"pair", b"you")
    await eventually(lambda: heard == ["the key was handed to 'you'"], "the one left told")
    assert left.ended and repr(left) == f"<HeldKey {shared.prefix + b'pair'!r} from {start} ended>"
    keep.cancel()
    assert len(held_keys) == 0 and held_keys._watcher is None
    # Two tenures of one key (one ending, the next beginning): both are told when the
    # watch ends.
    failed: list[LeaseError] = []
    start = await write(b"both", b"me") + 1
    shared.watch(b"both", start, heard.append, failed.append)
    shared.watch(b"both", start, heard.append, failed.append)
    await shared.close()
    assert [type(error) for error in failed] == [ProviderClosed, ProviderClosed]


async def test_a_change_in_the_older_generation_is_looked_up_and_told_to_each_tenure(
    shared: SharedWatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every batch of events starts a generation: the latest change of a key is kept
    # through the next batch, in the older generation.
    monkeypatch.setattr(held_keys_module, "_GENERATION_S", 0.0)
    told: dict[str, list[str]] = {"key": [], "late": [], "s": []}
    write = shared.write
    keep = shared.watch(b"keep", await write(b"keep", b"me") + 1, ignored)
    start = await write(b"key", b"me") + 1
    for _ in range(3):  # tenures of one key (an old one ending, ...): each is told
        shared.watch(b"key", start, told["key"].append)
    shared.watch(b"s", await write(b"s", b"me") + 1, told["s"].append)
    changed = await write(b"key", b"you")
    await eventually(lambda: len(told["key"]) == 3, "every tenure told")
    await write(b"s", b"you")  # the next batch: the change above is the older one
    await eventually(lambda: bool(told["s"]), "the next batch seen")
    shared.watch(b"key", changed, told["late"].append)
    await eventually(lambda: bool(told["late"]), "the late tenure told")
    assert told["key"] == ["the key was handed to 'you'"] * 3
    assert told["late"] == ["the key was handed to 'you'"]
    keep.cancel()  # the last tenure: no key is left watched, nor the watch
    assert len(shared.held_keys) == 0 and shared.held_keys._watcher is None


async def test_an_empty_prefix_watches_every_key(etcd: EtcdCluster) -> None:
    everything = SharedWatch(etcd, b"")
    heard: dict[bytes, asyncio.Future[str]] = {}
    try:
        # Keys at both ends of the keyspace (etcd's range from b"\0" on).
        for key in (b"A" + unique_prefix().encode(), b"z" + unique_prefix().encode()):
            heard[key] = asyncio.get_running_loop().create_future()
            start = await everything.write(key, b"me") + 1
            everything.watch(key, start, heard[key].set_result, heard[key].set_exception)
            await everything.write(key, None)
        for future in heard.values():
            assert "deleted" in await asyncio.wait_for(future, 10)
    finally:
        await everything.close()
