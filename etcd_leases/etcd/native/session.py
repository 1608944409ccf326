"""A session as etcd's Go ``concurrency.Session`` has it: one lease, kept alive.

An election candidate or a lock waiter puts one key, ``<prefix>/<lease id hex>``,
on a session lease of its own, as ``etcdctl elect`` and ``etcdctl lock`` do (one
session per command). The lease is granted and kept by the provider's machinery:
its client grants it, its one keep-alive stream renews it, its watch stream watches
the key, so a session costs a keep-alive message per TTL/3 and nothing more.

``lost`` is set once the lease is lost (expired on our clock, revoked) or the key
the session :meth:`guards <NativeSession.guard>` is deleted (by anyone), whichever
comes first. Closing revokes the lease, which deletes the key with it in one write:
what Go's ``Resign`` / ``Unlock`` followed by ``Session.Close`` does in two.
"""

from __future__ import annotations

import asyncio
import logging

from etcd_leases.errors import LeaseError, LeaseLost
from etcd_leases.etcd.kept_lease import KeptLease
from etcd_leases.etcd.provider import EtcdBackend
from etcd_leases.etcd.watch import Watcher
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

_log = logging.getLogger(__name__)


class NativeSession:
    """One lease of ``backend``, renewed until it is lost or :meth:`close` revokes it."""

    def __init__(self, backend: EtcdBackend, kept: KeptLease) -> None:
        self._backend = backend
        self._kept = kept
        self._watcher: Watcher | None = None
        self._closed = False
        self._reread_task: asyncio.Task[None] | None = None  # referenced, so not collected
        self.lost = asyncio.Event()
        self.lost_reason: str | None = None
        kept.add_loss_callback(lambda _: self._lose(kept.lost_reason or "its lease was lost"))

    @classmethod
    async def open(cls, backend: EtcdBackend, ttl_s: int) -> NativeSession:
        """Grant a lease of ``ttl_s`` seconds (or etcd's minimum) and keep it alive."""
        grant = await backend._grant(ttl_s)
        try:
            kept = backend._keepalive.keep(grant.lease_id, grant.ttl_s, grant.valid_until)
        except BaseException:
            await backend.client.revoke_quietly(grant.lease_id)
            raise
        return cls(backend, kept)

    @property
    def lease_id(self) -> int:
        return self._kept.lease_id

    @property
    def ttl_s(self) -> int:
        """The TTL etcd granted, in seconds."""
        return self._kept.ttl_s

    def key(self, prefix: bytes) -> bytes:
        """This session's key under ``prefix``: the lease ID in lower-case hex, as Go's
        ``fmt.Sprintf("%s%x", prefix, lease)`` writes it."""
        return prefix + f"{self.lease_id:x}".encode()

    def remaining(self) -> float:
        """Seconds the lease is known to be alive on our clock; 0 once lost."""
        return 0.0 if self.lost.is_set() else self._kept.remaining()

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless the session (and its key) still stand."""
        if self.remaining() <= 0:
            raise LeaseLost(f"session {self.lease_id:x} is over: {self.lost_reason or 'expired'}")

    def guard(self, key: bytes, from_revision: int) -> None:
        """Count the session lost when ``key`` is deleted at or after ``from_revision``.

        A put (a proclaim, anyone's) changes only the value: the key, its create
        revision and so the place in the queue stay.
        """

        def on_events(events: list[pb.Event]) -> None:
            if any(event.type == pb.Event.DELETE for event in events):
                self._lose(f"its key {key.decode(errors='replace')} was deleted")
            elif not events:  # history compacted away: a delete may be in it
                self._reread_task = asyncio.get_running_loop().create_task(self._reread(key))

        def on_error(exc: LeaseError) -> None:
            self._lose(f"its key's watch failed: {exc}")

        self._watcher = self._backend._watches.watch(
            key, from_revision, on_events=on_events, on_error=on_error
        )

    async def _reread(self, key: bytes) -> None:
        try:
            kv = await self._backend.client.range(key)
        except LeaseError as exc:
            self._lose(f"could not re-read its key: {exc}")
            return
        if kv is None or kv.lease != self.lease_id:
            self._lose("its key was deleted while the watch history was compacted")

    def _lose(self, reason: str) -> None:
        if self.lost.is_set():
            return
        self.lost_reason = reason  # first: whoever wakes up on ``lost`` reads it
        self.lost.set()
        if self._watcher is not None:
            self._watcher.cancel()
        # Renewing a lease that leads nothing would keep a dead candidacy's lease for
        # ever if its owner never closes the session: it expires instead.
        self._backend._keepalive.release(self._kept)

    async def close(self) -> None:
        """Revoke the lease (its key goes with it); best effort, never raises for an
        unreachable etcd: the lease then expires within its TTL."""
        self._lose("the session was closed")
        if self._closed:
            return
        self._closed = True
        await self._backend.client.revoke_quietly(self.lease_id)
