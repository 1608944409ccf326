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

from etcd_leases.contract import check_key
from etcd_leases.errors import LeaseLost
from etcd_leases.etcd.native.keys import oldest_request, queue_prefix, wait_turn
from etcd_leases.etcd.native.session import NativeSession
from etcd_leases.etcd.provider import EtcdBackend
from etcd_leases.etcd.txn import Txn, create_revision_is, get, put
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

#: ``etcdctl lock``'s default ``--ttl``.
DEFAULT_TTL_S = 10


class NativeLock:
    """The etcd lock ``name`` (an etcd key prefix, used as is: not under the
    provider's prefix, since ``etcdctl`` knows nothing of that)."""

    def __init__(self, provider: EtcdBackend, name: str, *, ttl_s: int = DEFAULT_TTL_S) -> None:
        check_key(name, "name")
        self.provider = provider
        self.name = name
        self.ttl_s = ttl_s
        self._prefix = queue_prefix(name)
        self._session: NativeSession | None = None  # the last attempt's
        self._key = b""
        self._not_held = asyncio.Event()
        self._not_held.set()
        #: The fencing token while held: the create revision of our key.
        self.token: int | None = None

    @property
    def key(self) -> str | None:
        """Our key while waiting or holding."""
        if self._session is None or self._session.lost.is_set():
            return None
        return self._key.decode()

    @property
    def lost(self) -> asyncio.Event:
        """Set when the lock is no longer held (lease lost, key deleted, released);
        set also before any acquire."""
        return self._not_held if self._session is None else self._session.lost

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless the lock is still held."""
        if self._session is None or self.token is None:
            raise LeaseLost(f"{self.name!r} is not held")
        self._session.check()

    async def acquire(self, timeout: float | None = None) -> int:
        """Wait for the lock and take it: the fencing token (Go's ``Lock``).

        Raises ``TimeoutError`` after ``timeout`` seconds (we leave the queue),
        :class:`LeaseLost` if the session ends first. A no-op while held.
        """
        if self.token is not None and not self.lost.is_set():
            return self.token
        revision, holder = await self._enqueue()
        try:
            if holder is not None and holder.create_revision != revision:
                async with asyncio.timeout(timeout):
                    await wait_turn(self.provider, self._live(), self._prefix, self._key, revision)
            else:
                self._live().guard(self._key, revision + 1)
        except BaseException:
            await self.release()
            raise
        self.token = revision
        return revision

    async def try_acquire(self) -> int | None:
        """Take the lock if it is free: the fencing token, else ``None`` (Go's ``TryLock``)."""
        if self.token is not None and not self.lost.is_set():
            return self.token
        revision, holder = await self._enqueue()
        if holder is not None and holder.create_revision != revision:
            await self.release()
            return None
        self._live().guard(self._key, revision + 1)
        self.token = revision
        return revision

    async def release(self) -> None:
        """Give the lock up (or leave the queue): the next waiter takes it."""
        self.token = None
        if self._session is not None:
            await self._session.close()

    async def _enqueue(self) -> tuple[int, pb.KeyValue | None]:
        """Put our key and read the holder in one transaction, as Go's ``tryAcquire``:
        our key's create revision, and the key created first (``None``: none)."""
        await self.release()
        session = self._session = await NativeSession.open(self.provider, self.ttl_s)
        self._key = key = session.key(self._prefix)
        holder = pb.RequestOp(request_range=oldest_request(self._prefix))
        txn = Txn.when(create_revision_is(key, 0)).then(put(key, b"", session.lease_id), holder)
        try:
            response = await self.provider.client.txn(txn.otherwise(get(key), holder).request)
        except BaseException:
            await self.release()  # the put may have landed: revoking deletes it
            raise
        if not response.succeeded:  # a new lease, so a new key: cannot happen
            await self.release()
            raise LeaseLost(f"{key.decode()} exists already")
        holders = response.responses[1].response_range.kvs
        return response.header.revision, holders[0] if holders else None

    def _live(self) -> NativeSession:
        assert self._session is not None
        return self._session

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
