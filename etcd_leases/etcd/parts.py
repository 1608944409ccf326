"""The pieces one etcd backend shares: its client, streams, lease pool and sessions.

:class:`BackendParts` builds them and closes them; the modules beside it add what the
backend does with them (:mod:`.copies`, :mod:`.pooled`, :mod:`.kept`, :mod:`.fenced`,
and the contract's calls in :mod:`.provider`).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Sequence

from etcd_leases.errors import LeaseValueError
from etcd_leases.etcd.batch import TxnBatcher
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.keepalive import KeepAliveLoop
from etcd_leases.etcd.keeper import EtcdKeeper
from etcd_leases.etcd.key_locks import KeyLocks
from etcd_leases.etcd.late_releases import LateReleases
from etcd_leases.etcd.lease_ids import new_lease_id
from etcd_leases.etcd.pool import Grant, LeasePool
from etcd_leases.etcd.session import Sessions
from etcd_leases.etcd.tasks import BackgroundTasks
from etcd_leases.etcd.watch import WatchStream
from etcd_leases.etcd.watch.held_keys import HeldKeysWatch

DEFAULT_PREFIX = "/etcd-leases/"


def ttl_seconds(ttl_ms: int) -> int:
    """etcd counts whole seconds: round up, never down."""
    return -(-ttl_ms // 1000)


class BackendParts:
    """The client, streams, pool and sessions of one backend (see :class:`EtcdBackend`)."""

    def __init__(
        self,
        endpoints: str | Sequence[str] = "127.0.0.1:2379",
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = 5.0,
        username: str | None = None,
        password: str | None = None,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        member_sync_interval: float | None = 60.0,
    ) -> None:
        if not isinstance(prefix, str):
            raise LeaseValueError(f"prefix must be a str, not {type(prefix).__name__}")
        self.prefix = prefix
        self._prefix = prefix.encode("utf-8")
        self._client = EtcdClient(
            endpoints,
            timeout=timeout,
            username=username,
            password=password,
            ca_cert=ca_cert,
            cert=cert,
            key=key,
            member_sync_interval=member_sync_interval,
        )
        # The server's minimum TTL, learnt from grants: asking less than it would
        # make every renewal look like a change of TTL.
        self._min_ttl_s = 1
        # One keep-alive stream and one watch stream serve every held lease.
        self._keepalive = KeepAliveLoop(self._client)
        # One-shot renewals go on a stream of their own: etcd answers one stream's
        # requests in order, and a renewal of a lease that just expired waits for its
        # revoke (up to seconds), which must not hold up the held leases' renewals.
        self._renewals = KeepAliveLoop(self._client)
        self._watches = WatchStream(self._client)
        # Held keys share one watch over the prefix, not one watch each.
        self._held_keys = HeldKeysWatch(self._watches, self._client, self._prefix)
        # Leases granted ahead, so that taking a key is one transaction; and the
        # session leases that hold's keys share, so renewals cost O(1) per TTL.
        self._pool = LeasePool(self._client, self._keepalive, self._renewals, self._grant)
        # The live tenures on our session leases, so a settlement never deletes one.
        self._session_keepers: weakref.WeakValueDictionary[tuple[bytes, int], EtcdKeeper] = (
            weakref.WeakValueDictionary()
        )
        # A take of a key and a settlement that may delete it, one at a time per key.
        self._key_locks = KeyLocks()
        # Keys an interrupted hold may have left on a session lease: no settlement deletes
        # one before this time, when every tenure reported on it since has run its TTL.
        self._unsettled_until: dict[bytes, float] = {}
        self._sessions = Sessions(
            self._client, self._keepalive, lambda ttl_s: self._grant(ttl_s, session=True)
        )
        # Releases with no answer, whose copies may still end a tenure they compared.
        self._late_releases = LateReleases()
        # Transactions that arrive together share one consensus round.
        self._batcher = TxnBatcher(self._client)
        self._background = BackgroundTasks()
        # Set as the provider closes: work waiting for a later time stops waiting.
        self._closing = asyncio.Event()

    async def close(self) -> None:
        """Close the connections; idempotent. Any call after it raises ProviderClosed.

        Held leases are lost (their keepers stop); waiters and watchers raise
        ProviderClosed.
        """
        self._closing.set()
        await self._background.wait(self._client.timeout)
        if not self._client.closed:
            await asyncio.gather(self._sessions.close(), self._pool.close())
        await self._keepalive.close()
        await self._renewals.close()
        await self._watches.close()
        await self._client.close()

    def etcd_key(self, key: str) -> bytes:
        """The etcd key that holds ``key``'s owner."""
        return self._prefix + key.encode("utf-8")

    def _ttl_s(self, ttl_ms: int) -> int:
        """The TTL to ask etcd for: whole seconds, rounded up, at least its minimum."""
        return max(ttl_seconds(ttl_ms), self._min_ttl_s)

    async def _grant(self, ttl_s: int, *, session: bool = False) -> Grant:
        lease_id = new_lease_id(session=session)
        sent_at = time.monotonic()
        try:
            granted = await self._client.grant(ttl_s, lease_id)
        except BaseException:
            # The grant may have landed: revoke it (invariant 4), whatever happens here.
            self._background.start(self._client.revoke_quietly(lease_id))
            raise
        if granted > ttl_s:
            self._min_ttl_s = max(self._min_ttl_s, granted)
        return Grant(lease_id, granted, sent_at + granted)
