"""A place in an etcd-native queue: what an election candidate and a lock waiter share.

Each attempt (a campaign, an acquire) opens a session of its own and puts its key
``<name>/<lease id hex>`` on it (see :mod:`~etcd_leases.etcd.native.keys` for the
rules); leaving the queue (resign, release) closes the session, which deletes the key.
"""

from __future__ import annotations

import asyncio

from etcd_leases.contract import MAX_TTL_MS, check_key
from etcd_leases.errors import LeaseLost, LeaseTypeError, LeaseValueError
from etcd_leases.etcd.native.keys import queue_prefix
from etcd_leases.etcd.native.session import NativeSession
from etcd_leases.etcd.provider import EtcdBackend


class Queued:
    """One place in the queue ``name`` (an etcd key prefix, used as is: not under the
    provider's prefix, since ``etcdctl`` knows nothing of that)."""

    #: What being at the head is called, for messages.
    _at_head = "at the head of"

    def __init__(self, provider: EtcdBackend, name: str, ttl_s: int) -> None:
        check_key(name, "name")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int):
            raise LeaseTypeError(f"ttl_s must be an int, not {type(ttl_s).__name__}")
        if not 1 <= ttl_s <= MAX_TTL_MS // 1000:
            raise LeaseValueError(f"ttl_s must be in 1 ..= {MAX_TTL_MS // 1000}, got {ttl_s}")
        self.provider = provider
        self.name = name
        self.ttl_s = ttl_s
        self._prefix = queue_prefix(name)
        self._session: NativeSession | None = None  # the last attempt's
        self._key = b""
        self._not_queued = asyncio.Event()
        self._not_queued.set()
        #: The fencing token while at the head: the create revision of our key.
        self.token: int | None = None

    @property
    def key(self) -> str | None:
        """Our key while queued or at the head."""
        if self._session is None or self._session.lost.is_set():
            return None
        return self._key.decode()

    @property
    def lost(self) -> asyncio.Event:
        """Set when our place is gone (lease lost, key deleted, left); set also before
        the first attempt."""
        return self._not_queued if self._session is None else self._session.lost

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless we are still at the head of the queue."""
        if self._session is None or self.token is None:
            raise LeaseLost(f"not {self._at_head} {self.name!r}")
        self._session.check()

    def _holding(self) -> bool:
        return self.token is not None and not self.lost.is_set()

    async def _join(self) -> NativeSession:
        """Leave any earlier place; open the session of a new one (its key not put yet)."""
        await self._leave()
        session = self._session = await NativeSession.open(self.provider, self.ttl_s)
        self._key = session.key(self._prefix)
        return session

    async def _leave(self) -> None:
        """Close the session: our key is deleted, the next in the queue moves up."""
        self.token = None
        if self._session is not None:
            await self._session.close()
