"""A lock that shares etcd's own layout: Go's ``concurrency.Mutex``.

Holders and waiters of the lock ``name`` are keys ``<name>/<lease id hex>`` with an
empty value on each one's session lease; the holder is the key created first. So a
holder here, a Go service's ``concurrency.NewMutex(session, name)`` and an operator's
``etcdctl lock name`` exclude each other::

    async with NativeLock(provider, "migrations") as lock:
        await migrate(fence=lock.token)          # lock.lost is set if it is lost

The fencing token is the create revision of the holder's key (what Go's
``Mutex.IsOwner()`` compares): each holder's is higher than every earlier holder's.
``etcdctl lock`` gives its command ``ETCD_LOCK_REV``, the revision at which it got
the lock, which is at or above its key's create revision.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Self

from etcd_leases.errors import LeaseLost
from etcd_leases.etcd.native.keys import oldest_request, wait_turn
from etcd_leases.etcd.native.queue import Queued
from etcd_leases.etcd.native.session import NativeSession
from etcd_leases.etcd.provider import EtcdBackend
from etcd_leases.etcd.txn import Txn, create_revision_is, put
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

#: ``etcdctl lock``'s default ``--ttl``.
DEFAULT_TTL_S = 10


class NativeLock(Queued):
    """The etcd lock ``name`` (an etcd key prefix, used as is: not under the
    provider's prefix, since ``etcdctl`` knows nothing of that)."""

    _at_head = "holding"

    def __init__(self, provider: EtcdBackend, name: str, *, ttl_s: int = DEFAULT_TTL_S) -> None:
        super().__init__(provider, name, ttl_s)

    async def acquire(self, timeout: float | None = None) -> int:
        """Wait for the lock and take it: the fencing token (Go's ``Lock``).

        Raises ``TimeoutError`` after ``timeout`` seconds (we leave the queue),
        :class:`LeaseLost` if the session ends first. A no-op while held.
        """
        if self._holding():
            assert self.token is not None
            return self.token
        session, revision, free = await self._enqueue()
        try:
            if free:
                session.guard(self._key, revision + 1)
            else:
                async with asyncio.timeout(timeout):
                    await wait_turn(self.provider, session, self._prefix, self._key, revision)
        except BaseException:
            await self.release()
            raise
        self.token = revision
        return revision

    async def try_acquire(self) -> int | None:
        """Take the lock if it is free: the fencing token, else ``None`` (Go's ``TryLock``)."""
        if self._holding():
            return self.token
        session, revision, free = await self._enqueue()
        if not free:
            await self.release()
            return None
        session.guard(self._key, revision + 1)
        self.token = revision
        return revision

    async def release(self) -> None:
        """Give the lock up (or leave the queue): the next waiter takes it."""
        await self._leave()

    async def _enqueue(self) -> tuple[NativeSession, int, bool]:
        """Put our key and read the holder in one transaction, as Go's ``tryAcquire``:
        the session, our key's create revision, and whether our key holds the lock."""
        session = await self._join()
        key = self._key
        holder = pb.RequestOp(request_range=oldest_request(self._prefix))
        # A new lease, so a new key: Go's "reuse the key" branch never runs.
        txn = Txn.when(create_revision_is(key, 0)).then(put(key, b"", session.lease_id), holder)
        try:
            response = await self.provider.client.txn(txn.request)
        except BaseException:
            await self.release()  # the put may have landed: revoking deletes it
            raise
        if not response.succeeded:
            await self.release()
            raise LeaseLost(f"{key.decode()} exists already")
        revision = response.header.revision
        holders = response.responses[1].response_range.kvs
        return session, revision, not holders or holders[0].create_revision == revision

    async def __aenter__(self) -> Self:
        await self.acquire()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()
