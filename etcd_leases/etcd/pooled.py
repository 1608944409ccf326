"""Tenures on a lease of their own, taken from the pool: creates, moves, refreshes.

Taking a free key is one transaction under a pooled lease (see :mod:`.pool`); a
lease that did not end up on a key goes back to the pool, one that carried a tenure
now ended is revoked (invariant 4). An interrupted put is settled from the copies'
answers and, when the last copy failed, from the key's history.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from dataclasses import dataclass, replace

from etcd_leases.errors import BackendError, BackendUnavailable, LeaseError, PermissionDenied
from etcd_leases.etcd.copies import TxnCopies
from etcd_leases.etcd.history import put_landed
from etcd_leases.etcd.keepalive import Renewal
from etcd_leases.etcd.lease_expiry import expired_on_the_leader
from etcd_leases.etcd.lease_ids import is_session_lease
from etcd_leases.etcd.pool import Grant
from etcd_leases.etcd.txn import Txn, delete, first_kv, get, lease_is, mod_revision_is, put
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb


@dataclass(frozen=True)
class Tenure:
    """A tenure as etcd holds it: the fencing token and the TTL granted, in ms."""

    token: int
    ttl_ms: int


@dataclass(frozen=True)
class Attached:
    """What a put under a lease of our own did: the key after it (``kv``), and the
    tenure it began (``None`` when it did not land)."""

    kv: pb.KeyValue | None
    tenure: Tenure | None


class PooledTenures(TxnCopies):
    """Puts of a key under a pooled lease, and what becomes of the lease after."""

    def lease_freed(self, lease_id: int) -> None:
        """This process deleted the key on ``lease_id`` or moved it to another lease.

        A lease of our pool goes back to it. A session lease (ours or another
        process's) carries other keys: left alone. Any other lease carried that one
        tenure, which has just ended: revoked (invariant 4), off the caller's path.
        Its process reuses it only after ending that tenure itself, which our change
        of the key has made impossible.
        """
        if not lease_id or is_session_lease(lease_id):
            return
        if self._pool.ended_unsettled(lease_id):
            # Its put is unsettled: a copy of it may land again on the free key, and a
            # revoke would then delete a tenure about to be answered (see _attach).
            return
        if self._pool.reusable(lease_id):
            self._pool.give_back(lease_id)
        else:  # not ours, or ours but not safe to reuse (see LeasePool.settled)
            self._pool.forget(lease_id)
            self._background.start(self._client.revoke_quietly(lease_id))

    async def _renew(
        self, lease_id: int, key: bytes, requested: asyncio.Future[Renewal] | None = None
    ) -> int:
        """Renew ``lease_id``, the lease of ``key``, once on the one-shot renewal stream
        (or wait for the renewal ``requested`` already); its TTL (s), 0 if it is gone,
        or if, its keep-alive unanswered, etcd's leader has it expired (the key on it
        then deleted)."""
        if requested is None:
            requested = self._renewals.request_renewal(lease_id)
        try:
            sent_at, ttl_s = await self._renewals.answer(requested, lease_id, self._client.timeout)
        except BackendUnavailable:
            if not await expired_on_the_leader(self._client, lease_id, key):
                raise
            # Over, but its key stays until etcd gets to the revoke: gone before this
            # answer, so no read after it finds the tenure still held.
            await self._cas(Txn.when(lease_is(key, lease_id)).then(delete(key)))
            return 0
        if ttl_s > 0:
            self._pool.renewed(lease_id, sent_at + ttl_s)
        return ttl_s

    async def _renewal_answered(
        self, lease_id: int, key: bytes, requested: asyncio.Future[Renewal]
    ) -> None:
        """Let a renewal requested beside an interrupted put run its course."""
        with suppress(LeaseError):  # unanswered: the lease runs out sooner
            await self._renew(lease_id, key, requested)

    async def _attach(
        self, txn: Txn, grant: Grant, started: float, *, replaces: pb.KeyValue | None = None
    ) -> Attached | None:
        """Run ``txn``, which puts a key under ``grant``'s lease if its compares hold;
        ``None`` if etcd no longer had that lease: nothing happened, take another.

        A pooled lease may have less than its TTL left: a create renews it alongside
        the transaction (a keep-alive, not a write), so the TTL promised from
        ``started`` never outlasts etcd's (a move has renewed it before, see
        :meth:`_alive_for_the_ttl`). A lease of ours that did not end up on the key goes
        back to the pool; one that ran out under the key before its renewal was
        answered is cleared up, and the outcome reported unknown. ``replaces`` is the
        key as a move read it (``None`` for a create): what an interrupted create may
        have begun lasts its TTL (others may have seen it), then ends by itself; an
        interrupted move is settled in the background and keeps whichever tenure it
        left, so the key is never free. When a copy sent after a lost answer
        fails, the key's history tells whether an earlier one landed. A tenure another
        task of this process ended before the put settled (a release) is answered as
        begun, its lease freed; a copy that landed again on the free key after it keeps
        the key.
        """
        # Only a change after this revision can be ours: a move compares the revision
        # it read, and a create lands after every answer seen before it is sent (the
        # grant of its lease's, at least).
        after = self._client.revision_seen if replaces is None else replaces.mod_revision
        sent = txn.request.success[0].request_put
        renewal = None
        if grant.valid_until < started + grant.ttl_s:
            renewal = self._renewals.request_renewal(grant.lease_id)
        try:
            response, answers_lost = await self._send_copies(txn)
            kv = first_kv(response)
            alive = renewal is None or await self._renew(grant.lease_id, sent.key, renewal) > 0
        except BaseException as exc:
            if renewal is not None and not renewal.done():
                # Sent, or about to be: its answer still tells the pool how long the
                # lease lives, and a put that may have landed needs it (see below).
                self._background.start(self._renewal_answered(grant.lease_id, sent.key, renewal))
            if isinstance(exc, BackendError) and self._client.is_lease_not_found(exc):
                self._pool.forget(grant.lease_id)
                return None
            if isinstance(exc, BackendError | PermissionDenied):
                self._pool.put_back(grant)  # refused: nothing landed
                raise
            if replaces is not None:
                self._background.start(self._settle_move(txn, grant, replaces.lease))
                raise
            # The put may have landed, and others may have seen its tenure begin and
            # acted on it: it lasts its TTL (the renewal sent with it goes on), then
            # ends by itself. The lease is neither reused nor revoked, nor renewed
            # again unless its owner asks again and learns the tenure is its own.
            self._pool.forget(grant.lease_id)
            raise
        ended = self._pool.settled(grant.lease_id, answers_lost=answers_lost)
        if kv is None or kv.lease != grant.lease_id:
            landed = None
            try:
                if answers_lost:  # the last copy failed: did an earlier one land?
                    landed = await put_landed(
                        self._watches,
                        sent.key,
                        sent.value,
                        grant.lease_id,
                        after=after,
                        # Up to the change the last copy found; none found (the key
                        # went), then its first change since the move's read.
                        until=after + 1 if kv is None else kv.mod_revision,
                        timeout=self._client.timeout,
                    )
            finally:
                self.lease_freed(grant.lease_id)  # the key is not on it (any more)
            if landed is None:
                return Attached(kv, None)
            return Attached(kv, Tenure(landed, grant.ttl_s * 1000))
        if not alive:
            # The put landed, and its tenure began (others may have seen it, and acted
            # on it), but the lease ran out before its renewal was answered: that tenure
            # ended sooner than its TTL. Neither "acquired" nor "no" is true: unknown.
            self._pool.forget(grant.lease_id)
            await self._cas(Txn.when(mod_revision_is(kv.key, kv.mod_revision)).then(delete(kv.key)))
            raise BackendUnavailable(
                "etcd: the lease under the put ran out before its renewal was answered "
                "(etcd stalled): the tenure it began has ended; outcome unknown"
            )
        if ended:
            # This process ended the tenure the put began (a release, say) before the
            # put settled; after a lost answer, a later copy may have landed again since.
            now = await self._client.range(kv.key) if answers_lost else None
            if now is None or now.lease != grant.lease_id:
                self.lease_freed(grant.lease_id)
                return Attached(kv, Tenure(kv.mod_revision, grant.ttl_s * 1000))
            kv = now
        self._pool.carries(grant.lease_id, kv.key, kv.value)
        return Attached(kv, Tenure(kv.mod_revision, grant.ttl_s * 1000))

    async def _alive_for_the_ttl(self, grant: Grant, started: float) -> Grant | None:
        """``grant``, known alive on etcd for its TTL from ``started`` (renewed once if it
        aged in the pool); ``None`` if etcd answered it gone.

        A move ends the tenure it replaces as it lands, so its lease is renewed before
        the move is sent, never beside it: a lease found gone after the put would end
        both tenures long before their TTLs.
        """
        if grant.valid_until >= started + grant.ttl_s:
            return grant
        try:
            sent_at, ttl_s = await self._renewals.renew_once(grant.lease_id, self._client.timeout)
        except BaseException:
            self._pool.put_back(grant)  # nothing was sent under it
            raise
        if ttl_s <= 0:
            self._pool.forget(grant.lease_id)
            return None
        self._pool.renewed(grant.lease_id, sent_at + ttl_s)
        return replace(grant, valid_until=sent_at + ttl_s)

    async def _settle_move(self, txn: Txn, grant: Grant, replaced: int) -> None:
        """Learn whether an interrupted move landed (a copy lands at most once)."""
        try:
            kv = await self._cas(txn)
        except LeaseError:
            self._pool.forget(grant.lease_id)  # unknown: left to expire
            return
        self._pool.settled(grant.lease_id, answers_lost=True)
        # If the key is not on it, no copy can put it there any more (the move
        # compares the mod_revision it replaced): our lease carries nothing.
        self.lease_freed(
            replaced if kv is not None and kv.lease == grant.lease_id else grant.lease_id
        )

    async def _refresh(
        self, etcd_key: bytes, value: bytes, ttl_ms: int, kv: pb.KeyValue, started: float
    ) -> Tenure | None:
        """Reset the TTL of the tenure ``kv`` shows; ``None`` if that tenure is over.

        With the same TTL the tenure and its token stay: a keep-alive, no write. The
        key may change between the read and the keep-alive; the renewal then takes
        effect as of the read, before that change (and lasts longer than promised).
        """
        if not kv.lease:  # written by hand without a lease: give it one
            return await self._move(etcd_key, kv, value, ttl_ms, started)
        granted = await self._renew(kv.lease, kv.key)
        if granted <= 0:  # the lease is gone: so is the tenure
            return None
        if granted != self._ttl_s(ttl_ms):
            # Another TTL needs another lease, unless etcd rounds both alike (its
            # minimum TTL, which this process may not have learnt yet).
            grant = await self._pool.take(self._ttl_s(ttl_ms))
            if grant.ttl_s != granted:
                return await self._move(etcd_key, kv, value, ttl_ms, started, grant)
            self._pool.put_back(grant)
        if etcd_key in self._unsettled_until:  # maybe this very tenure: not deleted early
            self._settle_not_before(etcd_key, time.monotonic() + granted)
        return Tenure(kv.mod_revision, granted * 1000)

    def _settle_not_before(self, etcd_key: bytes, until: float) -> None:
        """No settlement of an interrupted hold deletes ``etcd_key`` before ``until``."""
        self._unsettled_until[etcd_key] = max(self._unsettled_until.get(etcd_key, 0.0), until)

    async def _move(
        self,
        etcd_key: bytes,
        kv: pb.KeyValue,
        value: bytes,
        ttl_ms: int,
        started: float,
        grant: Grant | None = None,
    ) -> Tenure | None:
        """Put ``value`` on the key under a lease of its own (``grant``, taken from the
        pool if not given) if ``kv`` still holds it."""
        while True:
            grant = await self._alive_for_the_ttl(
                grant or await self._pool.take(self._ttl_s(ttl_ms)), started
            )
            if grant is None:
                continue  # etcd no longer has it: another
            moved = await self._attach(
                Txn.when(mod_revision_is(etcd_key, kv.mod_revision))
                .then(put(etcd_key, value, grant.lease_id), get(etcd_key))
                .otherwise(get(etcd_key)),
                grant,
                started,
                replaces=kv,
            )
            if moved is not None:
                if moved.tenure is not None:
                    self.lease_freed(kv.lease)  # the old tenure's, now without its key
                return moved.tenure
            # etcd dropped the lease early (a stalled leader, a frozen process): the
            # key is unchanged, and a failed move would read as a lost tenure.
            grant = None
