"""Every lease key under a prefix, for operators: listed with TTLs, and watched.

The provider answers for one key at a time; ``etcd-leases list`` and ``watch`` look
at many. A watch here survives a broken stream or a compacted history by reading
the prefix again and reporting what changed meanwhile, so no change of owner is
missed (a change that came and went while disconnected may be).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

import grpc.aio

from etcd_leases.errors import BackendUnavailable, LeaseError, PermissionDenied, ProviderClosed
from etcd_leases.etcd.client import EtcdClient, prefix_end
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

_RETRY_S = 1.0


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
    """The owners under ``prefix`` (keys starting with ``start``), then each change."""
    known, revision = await read_prefix(client, prefix, start)
    for key in sorted(known):
        yield known[key]
    while True:
        try:
            async with aclosing(_events(client, _range(prefix, start), revision + 1)) as events:
                async for event in events:
                    change = _owner(prefix, event.kv)
                    if event.type == pb.Event.DELETE:
                        change = KeyOwner(change.key, None, None)
                        known.pop(change.key, None)
                    else:
                        known[change.key] = change
                    revision = event.kv.mod_revision
                    yield change
        except (PermissionDenied, ProviderClosed):
            raise
        except LeaseError:
            # client.error() has moved on from a member that failed.
            await asyncio.sleep(_RETRY_S)
        # Broken or compacted: catch up from a fresh read, reporting the differences.
        now, revision = await read_prefix(client, prefix, start)
        for key in sorted(known.keys() | now.keys()):
            before, after = known.get(key), now.get(key)
            if before != after:
                yield after or KeyOwner(key, None, None)
        known = now


async def _events(
    client: EtcdClient, keys: pb.RangeRequest, start_revision: int
) -> AsyncGenerator[pb.Event, None]:
    """Events of one watch stream; returns when history was compacted, raises if it breaks."""
    call = client.watch_stream(await client.metadata())
    create = pb.WatchCreateRequest(
        key=keys.key, range_end=keys.range_end, start_revision=start_revision
    )
    try:
        await call.write(pb.WatchRequest(create_request=create))
        async for response in call:
            if response.compact_revision or response.canceled:
                if "permission denied" in response.cancel_reason:
                    raise PermissionDenied(f"etcd: {response.cancel_reason}")
                return
            for event in response.events:
                yield event
    except asyncio.CancelledError as exc:
        # gRPC cancels the call when the client closes; the task itself was not.
        if (closed := client.closed_under(exc)) is not None:
            raise closed from None
        raise
    except grpc.aio.AioRpcError as exc:
        raise client.error(exc) from exc
    finally:
        call.cancel()
    raise BackendUnavailable("etcd ended the watch stream")
