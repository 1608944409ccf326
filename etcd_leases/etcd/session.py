"""Session leases: the keys a process holds with ``hold`` share one lease per TTL.

Every lease costs a keep-alive message each way per renewal, and in Python that cost
is the work per message: a process holding 10,000 keys on 10,000 leases spends a good
part of a core renewing them, and falls behind on a loaded host. Like etcd's
``concurrency.Session``, :class:`Sessions` puts every held key of one TTL on one lease,
renewed by the provider's keep-alive loop: holding 10,000 keys costs what one does.

What this means for a held key (see the README's "Guarantees"):

- Its tenure ends when the key changes (its watch: released, transferred, deleted
  by anyone) or when the session lease is lost, which ends every key on it at once,
  as all leases of a process that stops answering would end anyway.
- Its holder's deadline is the session's: the send time of the session's last
  answered renewal plus its TTL, never later than etcd's. A tenure starts only once
  its put was answered while the session lived, renewed for the TTL from the take's
  start: renewed since it began, or by a renewal requested with the put and answered
  in time (:meth:`Sessions.confirm`). A session never renewed yet is renewed by its
  first take. A session granted or renewed while etcd stalled may be past its
  deadline by the time the put is answered.
- A release deletes the key and leaves the lease to the others. Nothing revokes a
  session lease but its provider: when it is lost (so its keys are lost already),
  and when the provider closes.

Only ``hold`` (and so ``Election`` and agent threads) use sessions: a key taken with
``acquire_lease`` keeps a lease of its own, since the contract gives each key its TTL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from etcd_leases.errors import BackendUnavailable
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.keepalive import KeepAliveLoop, Renewal
from etcd_leases.etcd.kept_lease import KeptLease
from etcd_leases.etcd.pool import Grant
from etcd_leases.etcd.tasks import BackgroundTasks


@dataclass(frozen=True)
class Session:
    """One session lease: its ID, the TTL etcd granted (s), its renewal state, and how
    long its grant vouched for it (``time.monotonic()``)."""

    lease_id: int
    ttl_s: int
    kept: KeptLease
    granted_until: float


class Sessions:
    """One session lease per TTL, granted on first use, renewed until lost or closed."""

    def __init__(
        self,
        client: EtcdClient,
        keepalive: KeepAliveLoop,
        grant: Callable[[int], Awaitable[Grant]],
    ) -> None:
        self._client = client
        self._keepalive = keepalive
        self._grant = grant
        self._sessions: dict[int, Session] = {}
        self._ids: set[int] = set()  # every session lease not revoked yet
        self._granting: dict[int, asyncio.Lock] = {}
        # Per session lease, the one-shot renewal on its way that acquires share.
        self._renewing: dict[int, asyncio.Future[Renewal]] = {}
        self._background = BackgroundTasks()

    def is_session(self, lease_id: int) -> bool:
        """Whether ``lease_id`` is a session lease of this provider."""
        return lease_id in self._ids

    async def get(self, ttl_s: int) -> Session:
        """The live session for ``ttl_s`` seconds (as asked of etcd), granted if none is."""
        session = self._sessions.get(ttl_s)
        if session is not None and session.kept.remaining() > 0:
            # Not through the lock: its acquire costs O(waiters), and a burst of
            # thousands of takes would queue there for a session that is live.
            return session
        async with self._granting.setdefault(ttl_s, asyncio.Lock()):
            session = self._sessions.get(ttl_s)
            if session is not None and session.kept.remaining() > 0:
                return session
            grant = await self._grant(ttl_s)
            self._ids.add(grant.lease_id)
            kept = self._keepalive.keep(grant.lease_id, grant.ttl_s, grant.valid_until)
            session = Session(grant.lease_id, grant.ttl_s, kept, grant.valid_until)
            kept.add_loss_callback(lambda _: self._ended(ttl_s, session))
            self._sessions[ttl_s] = session
            return session

    def renewal(self, session: Session) -> asyncio.Future[Renewal]:
        """A renewal of ``session``'s lease requested now, or one on its way already.

        Concurrent acquires share one: a keep-alive message, not one per key.
        """
        answer = self._renewing.get(session.lease_id)
        if answer is None or answer.done():
            answer = self._keepalive.request_renewal(session.lease_id)
            self._renewing[session.lease_id] = answer
            answer.add_done_callback(lambda done: self._forget_renewal(session.lease_id, done))
        return answer

    async def confirm(
        self, session: Session, renewal: asyncio.Future[Renewal] | None, timeout: float
    ) -> bool:
        """Whether ``session`` is live once ``renewal`` (if any) was answered: a tenure
        put on it then counts from a renewal answered for it, never from an older one."""
        if renewal is None:  # renewed since the take began: none needed
            return session.kept.remaining() > 0
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(renewal)  # shared: one waiter's timeout ends no other's
        except TimeoutError:
            raise BackendUnavailable(
                f"etcd: a keep-alive of session lease {session.lease_id:x} was not answered "
                f"in {timeout:.1f} s"
            ) from None
        # The keep-alive loop applied the answer: valid_until moved, or the lease is lost.
        return session.kept.remaining() > 0

    def _forget_renewal(self, lease_id: int, answer: asyncio.Future[Renewal]) -> None:
        if self._renewing.get(lease_id) is answer:
            del self._renewing[lease_id]
        if not answer.cancelled():
            answer.exception()  # retrieved: a closed provider fails every waiter anyway

    def lose(self, session: Session, reason: str) -> None:
        """etcd no longer has ``session``'s lease (say, it refused a put under it)."""
        self._keepalive.mark_lost(session.kept, reason)

    async def close(self) -> None:
        """Revoke every session lease (best effort): their keys are deleted with them."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            self._keepalive.release(session.kept)
        await asyncio.gather(*(self._revoke(session.lease_id) for session in sessions))
        await self._background.wait(self._client.timeout)

    def _ended(self, ttl_s: int, session: Session) -> None:
        """A session lost: its keys are lost with it; revoke what etcd may still keep."""
        if self._sessions.get(ttl_s) is session:
            del self._sessions[ttl_s]
        if not self._keepalive.closed:
            self._background.start(self._revoke(session.lease_id))

    async def _revoke(self, lease_id: int) -> None:
        await self._client.revoke_quietly(lease_id)
        self._ids.discard(lease_id)
