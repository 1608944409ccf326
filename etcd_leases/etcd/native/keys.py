"""The key layout and the queue rules of etcd's Go ``concurrency`` package (key.go).

Both recipes keep a queue of keys under ``<name>/``, one per session, and serve it in
create-revision order: the key created first leads (or holds the lock), and each
waiter waits for the deletion of the key created just before its own, as Go's
``waitDeletes`` does. ``etcdctl elect`` and ``etcdctl lock`` use exactly this, so
they and our recipes share one queue.
"""

from __future__ import annotations

import asyncio

from etcd_leases.errors import LeaseError, LeaseLost
from etcd_leases.etcd.native.session import NativeSession
from etcd_leases.etcd.provider import EtcdBackend
from etcd_leases.etcd.txn import prefix_end
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb


def queue_prefix(name: str) -> bytes:
    """The keys' prefix: ``name`` and a ``/``, as Go's ``NewElection`` / ``NewMutex``
    append it (so election ``a`` and election ``ab`` never see each other's keys)."""
    return (name + "/").encode("utf-8")


def oldest_request(prefix: bytes, *, created_before: int = 0) -> pb.RangeRequest:
    """A read of the key created first under ``prefix`` (Go's ``WithFirstCreate``)."""
    return _top(prefix, pb.RangeRequest.ASCEND, created_before)


def _top(
    prefix: bytes, order: pb.RangeRequest.SortOrder.ValueType, max_create: int
) -> pb.RangeRequest:
    return pb.RangeRequest(
        key=prefix,
        range_end=prefix_end(prefix),
        sort_target=pb.RangeRequest.CREATE,
        sort_order=order,
        limit=1,
        max_create_revision=max_create,
    )


async def wait_deletes(
    backend: EtcdBackend, session: NativeSession, prefix: bytes, revision: int
) -> None:
    """Return once no key under ``prefix`` was created before ``revision`` (our key's).

    Go's ``waitDeletes(prefix, revision - 1)``: read the youngest key created before
    ours, wait for its deletion, and again, until none is left. Raises
    :class:`LeaseLost` if the session is lost meanwhile.
    """
    while True:
        session.check()
        response = await backend.client.call(
            "/etcdserverpb.KV/Range",
            _top(prefix, pb.RangeRequest.DESCEND, revision - 1),
            pb.RangeResponse,
        )
        if not response.kvs:
            return
        # From the revision after the read, which showed the key: Go watches from the
        # read's own revision, which etcd serves from its "unsynced" watchers, caught
        # up every 100 ms, so each hand-off waited about that long.
        await _wait_delete(backend, session, response.kvs[0].key, response.header.revision + 1)


async def _wait_delete(
    backend: EtcdBackend, session: NativeSession, key: bytes, revision: int
) -> None:
    """Wait until ``key`` is deleted at or after ``revision``, the history compacted
    (the caller reads again), or the session lost."""
    changed = asyncio.Event()
    failures: list[LeaseError] = []

    def on_events(events: list[pb.Event]) -> None:
        if not events or any(event.type == pb.Event.DELETE for event in events):
            changed.set()

    def on_error(exc: LeaseError) -> None:
        failures.append(exc)
        changed.set()

    watcher = backend._watches.watch(key, revision, on_events=on_events, on_error=on_error)
    waits = [asyncio.ensure_future(changed.wait()), asyncio.ensure_future(session.lost.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        for wait in waits:
            wait.cancel()
    if failures:
        raise failures[0]
    session.check()


async def wait_turn(
    backend: EtcdBackend, session: NativeSession, prefix: bytes, key: bytes, revision: int
) -> None:
    """Wait until ``key`` (created at ``revision``) heads the queue, then guard it.

    After the wait, the key is read again, as Go's ``Mutex.Lock`` does: a session that
    expired while waiting must not lead. From that read on, the key's deletion ends
    the session (see :meth:`NativeSession.guard`).
    """
    await wait_deletes(backend, session, prefix, revision)
    kv, read_at = await backend.client.range_at(key)
    if kv is None or kv.create_revision != revision:
        raise LeaseLost(f"{key.decode(errors='replace')} was deleted while it waited")
    session.guard(key, read_at + 1)
    session.check()
