"""Every lease key under a prefix, for operators: listed with TTLs, and watched.

The provider answers for one key at a time; ``etcd-leases list`` and ``watch`` look
at many. A watch resumes from where it was when its stream breaks, so no change is
missed; when history it still needed was compacted, it reads the prefix again and
reports what changed meanwhile (a change that came and went then may be missed).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.txn import prefix_end
from etcd_leases.etcd.watch import WatchStream
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb


@dataclass(frozen=True)
class KeyOwner:
    """A lease key (without the prefix): its owner and token, ``None`` once deleted.

    ``ttl_s`` is the lease's time left in seconds when listed (-1: the lease is
    gone and the key about to go; ``None``: not read, or the key has no lease).
    """

    key: str
    owner: str | None
    token: int | None
    ttl_s: int | None = None


def _owner(prefix: bytes, kv: pb.KeyValue) -> KeyOwner:
    key = kv.key[len(prefix) :].decode("utf-8", errors="replace")
    return KeyOwner(key, kv.value.decode("utf-8", errors="replace"), kv.mod_revision)


def _range(prefix: bytes, start: bytes) -> pb.RangeRequest:
    return pb.RangeRequest(key=prefix + start, range_end=prefix_end(prefix + start))


async def read_prefix(
    client: EtcdClient, prefix: bytes, start: bytes = b""
) -> tuple[dict[str, KeyOwner], int]:
    """Every key under ``prefix`` starting with ``start``, and the revision of the read."""
    request = _range(prefix, start)
    response = await client.call("/etcdserverpb.KV/Range", request, pb.RangeResponse)
    owners = {owner.key: owner for owner in (_owner(prefix, kv) for kv in response.kvs)}
    return owners, response.header.revision


async def list_owners(client: EtcdClient, prefix: bytes, start: bytes = b"") -> list[KeyOwner]:
    """Every key under ``prefix`` starting with ``start``, with its lease's time left."""
    request = _range(prefix, start)
    response = await client.call("/etcdserverpb.KV/Range", request, pb.RangeResponse)

    async def with_ttl(kv: pb.KeyValue) -> KeyOwner:
        owner = _owner(prefix, kv)
        if not kv.lease:
            return owner
        ttl = (await client.time_to_live(kv.lease)).TTL
        return KeyOwner(owner.key, owner.owner, owner.token, ttl)

    return sorted(await asyncio.gather(*map(with_ttl, response.kvs)), key=lambda o: o.key)


async def watch_owners(
    client: EtcdClient, prefix: bytes, start: bytes = b""
) -> AsyncGenerator[KeyOwner, None]:
    """The owners under ``prefix`` (keys starting with ``start``), then each change.

    Watches through a :class:`WatchStream` of its own, which moves to another member
    when the stream breaks or its member freezes, and backs off while it fails.
    Raises what ends the watch: ``ProviderClosed``, ``PermissionDenied``, or another
    ``LeaseError`` when etcd refuses the watch.
    """
    known, revision = await read_prefix(client, prefix, start)
    for key in sorted(known):
        yield known[key]
    keys = _range(prefix, start)
    watches = WatchStream(client)
    try:
        watcher = watches.watch(keys.key, revision + 1, range_end=keys.range_end)
        async for events in watcher:
            if not events:
                # History compacted: catch up from a fresh read, reporting the
                # differences; events it already covers may still follow.
                now, revision = await read_prefix(client, prefix, start)
                for key in sorted(known.keys() | now.keys()):
                    before, after = known.get(key), now.get(key)
                    if before != after:
                        yield after or KeyOwner(key, None, None)
                known = now
                continue
            for event in events:
                if event.kv.mod_revision <= revision:
                    continue
                change = _owner(prefix, event.kv)
                if event.type == pb.Event.DELETE:
                    change = KeyOwner(change.key, None, None)
                    known.pop(change.key, None)
                else:
                    known[change.key] = change
                yield change
    finally:
        await watches.close()
