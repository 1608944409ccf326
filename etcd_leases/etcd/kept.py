"""Tenures kept from the start: ``hold``'s keys on the session lease, and adopted ones.

A key put on this process's session lease shares that lease's renewals with every
other held key (see :mod:`.session`); an interrupted put is undone once its TTL has
passed (and that of every tenure of the key reported since), unless a hold of this
process has the tenure it began.
"""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import suppress

from etcd_leases.contract import AcquireResult, OwnerState, check_lease_call
from etcd_leases.errors import BackendError, BackendUnavailable, LeaseError, LeaseLost
from etcd_leases.etcd.keeper import EtcdKeeper, owner_of
from etcd_leases.etcd.kept_lease import KeptLease
from etcd_leases.etcd.parts import ttl_seconds
from etcd_leases.etcd.pooled import PooledTenures
from etcd_leases.etcd.session import Session
from etcd_leases.etcd.txn import Txn, create_revision_is, delete, get, mod_revision_is, put
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

# When an interrupted session put is looked for again (seconds after the previous
# look): a copy still on its way to a responsive member lands within these.
_READ_AGAIN_AFTER_S = (0.5, 2.0)


def state_of(kv: pb.KeyValue | None) -> OwnerState:
    return OwnerState(None, None) if kv is None else OwnerState(owner_of(kv), kv.mod_revision)


class KeptTenures(PooledTenures):
    """Acquiring on the session lease, and keeping a tenure acquired before."""

    async def acquire_kept(
        self, key: str, owner: str, ttl_ms: int
    ) -> tuple[AcquireResult, EtcdKeeper | None]:
        """Acquire ``key`` on this process's session lease for the TTL, kept from then on.

        For ``hold``: renewal costs the same for one held key and for 10,000 (see
        :mod:`etcd_leases.etcd.session`). The keeper is ``None`` when not acquired.
        """
        check_lease_call(key, owner, ttl_ms)
        self._client.check_open()
        etcd_key = self.etcd_key(key)
        # A settlement reading the key mid-take would find our put unregistered.
        async with self._key_locks.lock(etcd_key):
            return await self._take_on_session(etcd_key, owner, ttl_ms)

    async def _take_on_session(
        self, etcd_key: bytes, owner: str, ttl_ms: int
    ) -> tuple[AcquireResult, EtcdKeeper | None]:
        value = owner.encode("utf-8")
        kv: pb.KeyValue | None = None
        # Whether a put of this call landed on a session whose renewal then came too
        # late: that tenure began (others may have seen it), and may have ended.
        landed_unconfirmed = False
        started = time.monotonic()
        deadline = started + self._client.timeout
        while True:
            if time.monotonic() > deadline:
                raise BackendUnavailable(
                    "etcd: no session lease stayed alive long enough to put the key on it"
                )
            session = await self._sessions.get(self._ttl_s(ttl_ms))
            if landed_unconfirmed and (kv is None or kv.value != value):
                # The tenure our put began ended with its session lease: neither a
                # "no" nor a second tenure from this one call would be true.
                raise BackendUnavailable(
                    "etcd: the session lease under the put ran out before its renewal was "
                    "answered (etcd stalled): the tenure it began has ended; outcome unknown"
                )
            if kv is None:  # free when last read: create it
                compare = create_revision_is(etcd_key, 0)
            elif kv.value != value:
                return AcquireResult(False, owner_of(kv)), None
            else:
                # This owner's on another lease (moved onto the session), or one a
                # release of ours may still end, or one put by this call on a session
                # whose renewal came too late: written again, another tenure.
                compare = mod_revision_is(etcd_key, kv.mod_revision)
            txn = (
                Txn.when(compare)
                .then(put(etcd_key, value, session.lease_id), get(etcd_key))
                .otherwise(get(etcd_key))
            )
            renewal = None
            if (
                session.kept.valid_until < started + session.ttl_s
                or session.kept.valid_until <= session.granted_until
            ):
                # Renewed before this call began: the TTL promised from then needs a
                # renewal, answered alongside the put. Or never renewed: the first
                # tenure on it then starts with its keep-alive stream seen answered.
                renewal = self._sessions.renewal(session)
            sent_at = time.monotonic()
            try:
                now = await self._cas(txn)
            except BackendError as exc:
                if not self._client.is_lease_not_found(exc):
                    raise
                self._sessions.lose(session, "etcd no longer has the session lease")
                continue
            except BaseException:
                # The put may have landed, and nobody would hold the key: undo it.
                self._settle_session_put(etcd_key, value, session, sent_at)
                raise
            # The session lease is shared, by other keys and by other owners of this
            # process: the put landed if the key shows our value on it.
            # (Not one a release of ours may still end: that one is written again.)
            if (
                now is not None
                and now.lease == session.lease_id
                and now.value == value
                and not self._late_releases.may_end(now)
            ):
                if kv is not None:
                    self.lease_freed(kv.lease)
                try:
                    confirmed = await self._sessions.confirm(session, renewal, self._client.timeout)
                except BaseException:
                    # The put landed, and nobody would hold the key: undo it.
                    self._settle_session_put(etcd_key, value, session, sent_at)
                    raise
                if confirmed:
                    return self._session_tenure(owner, etcd_key, now, session)
                # The session's deadline passed before the put was answered (etcd
                # stalled): keep the tenure by moving the key onto a live session, if
                # it is still ours.
                landed_unconfirmed = True
            kv = now

    def _session_tenure(
        self, owner: str, etcd_key: bytes, kv: pb.KeyValue, session: Session
    ) -> tuple[AcquireResult, EtcdKeeper]:
        keeper = self._keeper(etcd_key, session.kept, kv.mod_revision + 1, shared=True)
        self._session_keepers[(etcd_key, kv.mod_revision)] = keeper
        return AcquireResult(True, owner, kv.mod_revision, session.ttl_s * 1000), keeper

    def _settle_session_put(
        self, etcd_key: bytes, value: bytes, session: Session, sent_at: float
    ) -> None:
        self._settle_not_before(etcd_key, sent_at + session.ttl_s)
        self._background.start(self._delete_session_put(etcd_key, value, session))

    async def _delete_session_put(self, etcd_key: bytes, value: bytes, session: Session) -> None:
        """Delete the key an interrupted session put left behind, if it did and no hold
        of this process has that tenure (the same owner may hold it twice here), once
        the session's TTL has passed since the put was sent, and since every tenure
        of the key this process reported after it (``_unsettled_until``).

        Not sooner: others may have seen that tenure begin and acted on it, and the
        tenure of an interrupted put on a lease of its own runs its TTL too (see
        :meth:`_attach`). Closing the provider ends the wait: it revokes the session
        lease, ending that tenure with every other it holds. Read, never sent again: a
        copy sent now would create the key if it is free by now (after its owner's next
        release, say), a tenure nobody asked for. Read again a moment later: a
        cancelled copy may still be on its way.
        """
        try:
            delays = [0.0, *_READ_AGAIN_AFTER_S]
            while delays and not session.kept.lost.is_set():  # a lost session took the key
                await asyncio.sleep(delays[0])
                if not await self._unsettled_time_passed(etcd_key):
                    return  # closing revokes the session lease, and the key with it
                try:
                    async with self._key_locks.lock(etcd_key):
                        kv = await self._client.range(etcd_key)
                        if kv is not None and kv.lease == session.lease_id and kv.value == value:
                            await self._delete_unheld(etcd_key, kv.mod_revision)
                            return
                except BackendUnavailable:
                    delays[0] = 1.0  # the session lives on, so would the key: read again
                    continue
                except LeaseError:
                    return
                delays.pop(0)
        finally:
            if self._unsettled_until.get(etcd_key, math.inf) <= time.monotonic():
                del self._unsettled_until[etcd_key]

    async def _unsettled_time_passed(self, etcd_key: bytes) -> bool:
        """Wait until ``_unsettled_until`` of ``etcd_key`` has passed (it may move
        later meanwhile); ``False`` if the provider closes first."""
        while (until := self._unsettled_until.get(etcd_key, 0.0)) > time.monotonic():
            with suppress(TimeoutError):
                async with asyncio.timeout(until - time.monotonic()):
                    await self._closing.wait()
                return False
        return True

    async def keep_lease(
        self, key: str, owner: str, token: int, ttl_ms: int, valid_until: float
    ) -> EtcdKeeper:
        check_lease_call(key, owner, ttl_ms)
        self._client.check_open()
        etcd_key = self.etcd_key(key)
        kv, revision = await self._client.range_at(etcd_key)
        if kv is None or state_of(kv) != OwnerState(owner, token) or not kv.lease:
            raise LeaseLost(f"{owner!r} no longer holds {key!r} with token {token}")
        shared = self._sessions.is_session(kv.lease)
        kept = self._keepalive.keep(kv.lease, ttl_seconds(ttl_ms), valid_until)
        keeper = self._keeper(etcd_key, kept, revision + 1, shared=shared)
        if shared:  # a tenure on our session a hold of this process now has
            self._session_keepers[(etcd_key, token)] = keeper
        return keeper

    def _keeper(
        self, etcd_key: bytes, kept: KeptLease, watch_from: int, *, shared: bool
    ) -> EtcdKeeper:
        return EtcdKeeper(
            etcd_key,
            kept,
            watch_from,
            self._held_keys,
            self._keepalive,
            shared=shared,
            abandon=self._delete_abandoned if shared else None,
        )

    def _delete_abandoned(self, etcd_key: bytes, token: int) -> None:
        self._background.start(self._delete_abandoned_tenure(etcd_key, token))

    async def _delete_abandoned_tenure(self, etcd_key: bytes, token: int) -> None:
        """Delete ``etcd_key`` if tenure ``token`` still has it and no hold of this
        process does; retried while etcd is unreachable."""
        while not self._client.closed:
            try:
                async with self._key_locks.lock(etcd_key):
                    await self._delete_unheld(etcd_key, token)
                return
            except BackendUnavailable:
                await asyncio.sleep(1.0)
            except LeaseError:
                return

    async def _delete_unheld(self, etcd_key: bytes, token: int) -> None:
        """Delete ``etcd_key`` if tenure ``token`` still has it and no hold of this
        process has that tenure (called with the key's lock held: no take in flight)."""
        keeper = self._session_keepers.get((etcd_key, token))
        if keeper is None or keeper.lost.is_set():
            await self._cas(Txn.when(mod_revision_is(etcd_key, token)).then(delete(etcd_key)))
