"""EtcdBackend: each contract call as one etcd transaction where it can be.

The invariants (see the README's "How it maps onto etcd"):

1. A lease carries at most one tenure at a time (pooled leases are reused only after
   this process saw their key go), or is a session lease shared by ``hold``'s keys;
   nothing revokes or deletes on the strength of a read without comparing it.
2. Every ownership change is one compare-and-swap transaction.
3. Reads that decide ownership are linearizable.
4. No lease leaks: a lease without a key goes back to its pool, or is revoked.
5. A write whose outcome is unknown is settled by sending the same transaction again,
   and, when that copy fails, from the key's history since the call began.
6. The fencing token is the key's ``mod_revision``.
7. The key's value is the owner, UTF-8, under ``prefix``.
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from etcd_leases.contract import (
    AcquireResult,
    OwnerState,
    check_key,
    check_lease_call,
    check_transfer_call,
)
from etcd_leases.errors import (
    BackendError,
    BackendUnavailable,
    LeaseError,
    LeaseLost,
    LeaseValueError,
    PermissionDenied,
)
from etcd_leases.etcd.batch import TxnBatcher
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.history import put_landed
from etcd_leases.etcd.keepalive import KeepAliveLoop, Renewal
from etcd_leases.etcd.keeper import EtcdKeeper, owner_of
from etcd_leases.etcd.kept_lease import KeptLease
from etcd_leases.etcd.lease_ids import is_session_lease, new_lease_id
from etcd_leases.etcd.pool import Grant, LeasePool
from etcd_leases.etcd.session import Session, Sessions
from etcd_leases.etcd.tasks import BackgroundTasks
from etcd_leases.etcd.txn import (
    Txn,
    create_revision_is,
    delete,
    first_kv,
    get,
    mod_revision_is,
    put,
    value_is,
)
from etcd_leases.etcd.watch import WatchStream
from etcd_leases.etcd.watch.held_keys import HeldKeysWatch
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

DEFAULT_PREFIX = "/etcd-leases/"
# How many copies of a transaction to send when etcd's answers are lost.
_CAS_ATTEMPTS = 3


@dataclass(frozen=True)
class Tenure:
    """A tenure as etcd holds it: the fencing token and the TTL granted, in ms."""

    token: int
    ttl_ms: int


@dataclass(frozen=True)
class Attached:
    """What a put under a lease of our own did: whether it landed, the key after it
    (``kv``), and the tenure it began (``None`` when it did not land, or its lease died)."""

    landed: bool
    kv: pb.KeyValue | None
    tenure: Tenure | None


def ttl_seconds(ttl_ms: int) -> int:
    """etcd counts whole seconds: round up, never down."""
    return -(-ttl_ms // 1000)


def state_of(kv: pb.KeyValue | None) -> OwnerState:
    return OwnerState(None, None) if kv is None else OwnerState(owner_of(kv), kv.mod_revision)


class EtcdBackend:
    """The lease contract on etcd, strongly consistent, with fencing tokens.

    ``endpoints`` is ``"host:port"`` / ``"http(s)://host:port"``, a comma-separated
    list of them, or a sequence. Connects on first use; ``async with`` closes it.
    Every ``member_sync_interval`` seconds (and soon after a member fails) the
    provider reads etcd's member list and adds members that no endpoint names, so a
    member replaced on a new address is followed; ``None`` turns that off.
    """

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
        self._sessions = Sessions(
            self._client, self._keepalive, lambda ttl_s: self._grant(ttl_s, session=True)
        )
        # Transactions that arrive together share one consensus round.
        self._batcher = TxnBatcher(self._client)
        self._background = BackgroundTasks()
        # The highest store revision etcd's answers have shown: a write sent later lands
        # after it, and a lease given back was freed by a write at or before it.
        self._revision_seen = 0

    @classmethod
    def from_env(cls, **overrides: object) -> Self:
        """Configure from etcdctl's variables plus ``ETCD_LEASES_PREFIX``.

        ``ETCDCTL_ENDPOINTS``, ``ETCDCTL_CACERT``, ``ETCDCTL_CERT``, ``ETCDCTL_KEY``,
        ``ETCDCTL_USER`` (``name:password``); keyword arguments win over them.
        """
        env = os.environ
        options: dict[str, object] = {}
        if "ETCDCTL_ENDPOINTS" in env:
            options["endpoints"] = env["ETCDCTL_ENDPOINTS"]
        for name, variable in (("ca_cert", "CACERT"), ("cert", "CERT"), ("key", "KEY")):
            if f"ETCDCTL_{variable}" in env:
                options[name] = env[f"ETCDCTL_{variable}"]
        if "ETCDCTL_USER" in env:
            username, sep, password = env["ETCDCTL_USER"].partition(":")
            if not sep:
                raise LeaseValueError("ETCDCTL_USER must be name:password")
            options["username"], options["password"] = username, password
        if "ETCD_LEASES_PREFIX" in env:
            options["prefix"] = env["ETCD_LEASES_PREFIX"]
        options.update(overrides)
        return cls(**options)  # type: ignore[arg-type]

    @property
    def client(self) -> EtcdClient:
        """The underlying etcd client (for recipes and tests)."""
        return self._client

    async def __aenter__(self) -> Self:
        self._client.check_open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connections; idempotent. Any call after it raises ProviderClosed.

        Held leases are lost (their keepers stop); waiters and watchers raise
        ProviderClosed.
        """
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

    # The contract.

    async def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> AcquireResult:
        check_lease_call(key, owner, ttl_ms)
        self._client.check_open()
        etcd_key, value = self.etcd_key(key), owner.encode("utf-8")
        if not self._revision_seen:
            # A lost answer is settled from the history after a revision seen before
            # sending: learn one, rather than read from the start (maybe compacted).
            revision = (await self._client.range_at(etcd_key))[1]
            self._revision_seen = max(self._revision_seen, revision)
        started = time.monotonic()
        while True:
            grant = await self._pool.take(self._ttl_s(ttl_ms))
            created = await self._attach(
                Txn.when(create_revision_is(etcd_key, 0))
                .then(put(etcd_key, value, grant.lease_id), get(etcd_key))
                .otherwise(get(etcd_key)),
                grant,
                started,
            )
            if created is None:
                continue  # the lease was gone before the put: nothing happened
            if created.tenure is not None:
                return AcquireResult(True, owner, created.tenure.token, created.tenure.ttl_ms)
            kv = created.kv
            if kv is None or kv.lease == grant.lease_id:
                continue  # our lease died under the key (cleared up): again
            if kv.value != value:
                return AcquireResult(False, owner_of(kv))
            refreshed = await self._refresh(etcd_key, value, ttl_ms, kv, started)
            if refreshed is not None:
                return AcquireResult(True, owner, refreshed.token, refreshed.ttl_ms)

    async def get_lease_owner(self, key: str) -> str | None:
        check_key(key)
        self._client.check_open()
        kv = await self._client.range(self.etcd_key(key))
        return None if kv is None else owner_of(kv)

    async def release_lease(self, key: str, owner: str) -> None:
        check_lease_call(key, owner)
        self._client.check_open()
        etcd_key = self.etcd_key(key)
        # Copies of it land at most once: after a delete the key has no value to match.
        response, _ = await self._send_copies(
            Txn.when(value_is(etcd_key, owner.encode("utf-8"))).then(delete(etcd_key, prev_kv=True))
        )
        if response.succeeded:
            for previous in response.responses[0].response_delete_range.prev_kvs:
                self.lease_freed(previous.lease)

    async def renew_lease(self, key: str, owner: str, ttl_ms: int) -> bool:
        check_lease_call(key, owner, ttl_ms)
        self._client.check_open()
        etcd_key, value = self.etcd_key(key), owner.encode("utf-8")
        started = time.monotonic()
        async for kv in self._tenures_of(etcd_key, value):
            if await self._refresh(etcd_key, value, ttl_ms, kv, started) is not None:
                return True
        return False

    async def transfer_lease(self, key: str, from_owner: str, to_owner: str, ttl_ms: int) -> bool:
        check_transfer_call(key, from_owner, to_owner, ttl_ms)
        self._client.check_open()
        etcd_key = self.etcd_key(key)
        started = time.monotonic()
        async for kv in self._tenures_of(etcd_key, from_owner.encode("utf-8")):
            # etcd deletes an expired lease's key up to 500 ms after its expiry (seconds
            # under mass expiry): meanwhile the key still reads as held. A keep-alive
            # answers 0 for an expired lease (after waiting for its revoke) and else
            # makes it last a full TTL more, so it cannot expire before the move.
            # A lease gone may also mean the owner moved its tenure since the read (a
            # re-acquire with another TTL, in any process, revokes the lease it left):
            # the next read tells, as a failed move does.
            if kv.lease and not await self._renew(kv.lease):
                continue
            if await self._move(etcd_key, kv, to_owner.encode("utf-8"), ttl_ms, started):
                return True
        return False

    async def _tenures_of(self, etcd_key: bytes, value: bytes) -> AsyncIterator[pb.KeyValue]:
        """The key while ``value`` holds it: as read now, then, each time the caller's
        step on a tenure failed, the newer tenure of the same owner, if there is one (a
        call of its own may have moved it, say to another TTL)."""
        tried = 0
        while True:
            kv = await self._client.range(etcd_key)
            if kv is None or kv.value != value or kv.mod_revision == tried:
                return
            yield kv
            tried = kv.mod_revision

    # The recipes' capabilities (see HoldingProvider).

    async def watch_owner(self, key: str) -> AsyncGenerator[OwnerState, None]:
        check_key(key)
        self._client.check_open()
        etcd_key = self.etcd_key(key)
        kv, revision = await self._client.range_at(etcd_key)
        state = state_of(kv)
        yield state
        watcher = self._watches.watch(etcd_key, revision + 1)
        try:
            async for events in watcher:
                if not events:
                    # History compacted away: the key as it is now. The watch then
                    # replays from the compaction on; events up to this read are old.
                    kv, revision = await self._client.range_at(etcd_key)
                    changes = [state_of(kv)]
                else:
                    changes = [
                        state_of(event.kv if event.type == pb.Event.PUT else None)
                        for event in events
                        if event.kv.mod_revision > revision
                    ]
                for change in changes:
                    if change != state:
                        state = change
                        yield state
        finally:
            watcher.cancel()

    async def acquire_kept(
        self, key: str, owner: str, ttl_ms: int
    ) -> tuple[AcquireResult, EtcdKeeper | None]:
        """Acquire ``key`` on this process's session lease for the TTL, kept from then on.

        For ``hold``: renewal costs the same for one held key and for 10,000 (see
        :mod:`etcd_leases.etcd.session`). The keeper is ``None`` when not acquired.
        """
        check_lease_call(key, owner, ttl_ms)
        self._client.check_open()
        etcd_key, value = self.etcd_key(key), owner.encode("utf-8")
        kv: pb.KeyValue | None = None
        deadline = time.monotonic() + self._client.timeout
        while True:
            if time.monotonic() > deadline:
                raise BackendUnavailable(
                    "etcd: no session lease stayed alive long enough to put the key on it"
                )
            session = await self._sessions.get(self._ttl_s(ttl_ms))
            if kv is None:  # free when last read: create it
                compare = create_revision_is(etcd_key, 0)
            elif kv.value != value:
                return AcquireResult(False, owner_of(kv)), None
            elif kv.lease == session.lease_id:  # ours already: the same tenure
                return self._session_tenure(owner, etcd_key, kv, session)
            else:  # this owner's on another lease: move it onto the session
                compare = mod_revision_is(etcd_key, kv.mod_revision)
            txn = (
                Txn.when(compare)
                .then(put(etcd_key, value, session.lease_id), get(etcd_key))
                .otherwise(get(etcd_key))
            )
            renewal = self._sessions.renewal(session)  # answered alongside the put
            try:
                now = await self._cas(txn)
            except BackendError as exc:
                if not self._client.is_lease_not_found(exc):
                    raise
                self._sessions.lose(session, "etcd no longer has the session lease")
                continue
            except BaseException:
                # The put may have landed, and nobody would hold the key: undo it.
                self._background.start(self._settle_session_put(txn, etcd_key, value, session))
                raise
            # The session lease is shared, by other keys and by other owners of this
            # process: the put landed if the key shows our value on it.
            if now is not None and now.lease == session.lease_id and now.value == value:
                if kv is not None:
                    self.lease_freed(kv.lease)
                try:
                    confirmed = await self._sessions.confirm(session, renewal, self._client.timeout)
                except BaseException:
                    # The put landed, and nobody would hold the key: undo it.
                    self._background.start(self._settle_session_put(txn, etcd_key, value, session))
                    raise
                if confirmed:
                    return self._session_tenure(owner, etcd_key, now, session)
                # The session's deadline passed before the put was answered (etcd
                # stalled): that tenure never started. Move the key onto a live session.
            kv = now

    def _session_tenure(
        self, owner: str, etcd_key: bytes, kv: pb.KeyValue, session: Session
    ) -> tuple[AcquireResult, EtcdKeeper]:
        keeper = self._keeper(etcd_key, session.kept, kv.mod_revision + 1, shared=True)
        self._session_keepers[(etcd_key, kv.mod_revision)] = keeper
        return AcquireResult(True, owner, kv.mod_revision, session.ttl_s * 1000), keeper

    async def _settle_session_put(
        self, txn: Txn, etcd_key: bytes, value: bytes, session: Session
    ) -> None:
        """Delete the key an interrupted session put left behind, if it did and no hold
        of this process has that tenure (the same owner may hold it twice here)."""
        while not session.kept.lost.is_set():
            try:
                kv = await self._cas(txn)
                if kv is not None and kv.lease == session.lease_id and kv.value == value:
                    keeper = self._session_keepers.get((etcd_key, kv.mod_revision))
                    if keeper is None or keeper.lost.is_set():
                        await self._delete_tenure(etcd_key, kv.mod_revision)
                return
            except BackendUnavailable:
                await asyncio.sleep(1.0)  # the session lives on: so would the key
            except LeaseError:
                return

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
        return self._keeper(etcd_key, kept, revision + 1, shared=shared)

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
        self._background.start(self._delete_tenure(etcd_key, token))

    async def _delete_tenure(self, etcd_key: bytes, token: int) -> None:
        """Delete ``etcd_key`` if tenure ``token`` still has it; retried while unreachable."""
        while not self._client.closed:
            try:
                await self._cas(Txn.when(mod_revision_is(etcd_key, token)).then(delete(etcd_key)))
                return
            except BackendUnavailable:
                await asyncio.sleep(1.0)
            except LeaseError:
                return

    async def put_fenced(
        self, key: str, owner: str, token: int, data_key: str, value: bytes
    ) -> bool:
        check_key(data_key, "data_key")
        data = data_key.encode("utf-8")
        return await self._fenced(
            key,
            owner,
            token,
            data,
            put(data, value),
            lambda kv: kv is not None and kv.value == value,
        )

    async def delete_fenced(self, key: str, owner: str, token: int, data_key: str) -> bool:
        check_key(data_key, "data_key")
        data = data_key.encode("utf-8")
        return await self._fenced(key, owner, token, data, delete(data), lambda kv: kv is None)

    async def get_value(self, data_key: str) -> bytes | None:
        """The value of the etcd key ``data_key`` (as written by a fenced put)."""
        check_key(data_key, "data_key")
        self._client.check_open()
        kv = await self._client.range(data_key.encode("utf-8"))
        return None if kv is None else kv.value

    async def _fenced(
        self,
        key: str,
        owner: str,
        token: int,
        data_key: bytes,
        op: pb.RequestOp,
        shows_op: Callable[[pb.KeyValue | None], bool],
    ) -> bool:
        """Apply ``op`` to ``data_key`` only if the tenure ``token`` still holds ``key``.

        Each attempt also compares ``data_key``'s mod_revision as read just before, so
        when etcd's answer is lost the same transaction can be sent again and lands at
        most once. A copy that then fails shows why: ``data_key`` unchanged means the
        fence refused it; changed into what ``op`` makes of it (``shows_op``), a copy
        of ours landed (or a write with the same effect, which is as good). Changed
        otherwise, another writer came first: try again, unless a copy of ours may
        have landed under that write (then BackendUnavailable: the outcome is unknown).
        """
        check_lease_call(key, owner)
        self._client.check_open()
        lease_key = self.etcd_key(key)
        fence = (mod_revision_is(lease_key, token), value_is(lease_key, owner.encode("utf-8")))
        while True:
            before = await self._client.range(data_key)
            read = 0 if before is None else before.mod_revision
            txn = (
                Txn.when(*fence, mod_revision_is(data_key, read)).then(op).otherwise(get(data_key))
            )
            response, answers_lost = await self._send_copies(txn)
            if response.succeeded:
                return True
            now = first_kv(response)
            if (0 if now is None else now.mod_revision) == read:
                return False  # the fence refused it
            if answers_lost:
                if shows_op(now):
                    return True
                raise BackendUnavailable(
                    f"etcd: the answer to a fenced write of {data_key!r} was lost and "
                    "another write to it followed: whether ours applied is unknown"
                )

    async def _send_copies(self, txn: Txn) -> tuple[pb.TxnResponse, bool]:
        """Send ``txn`` until a copy is answered; the answer, and whether any was lost.

        Only for transactions whose copies land at most once between them. A copy
        refused (say, etcd too busy) after an earlier copy's answer was lost says
        nothing of that earlier copy: the outcome is unknown (BackendUnavailable).
        """
        for attempt in range(_CAS_ATTEMPTS):
            try:
                response = await self._batcher.txn(txn.request)
                self._revision_seen = max(self._revision_seen, response.header.revision)
                return response, attempt > 0
            except BackendUnavailable:
                if attempt == _CAS_ATTEMPTS - 1:
                    raise
            except (BackendError, PermissionDenied) as exc:
                # A lease gone is news enough: whatever landed under it is gone too.
                if attempt == 0 or (
                    isinstance(exc, BackendError) and self._client.is_lease_not_found(exc)
                ):
                    raise
                raise BackendUnavailable(
                    f"etcd refused a copy of a transaction whose earlier answer was lost: {exc}"
                ) from exc
        raise AssertionError("unreachable")

    # How each step becomes etcd calls.

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
        if self._pool.reusable(lease_id):
            self._pool.give_back(lease_id)
        else:  # not ours, or ours but not safe to reuse (see LeasePool.settled)
            self._pool.forget(lease_id)
            self._background.start(self._client.revoke_quietly(lease_id))

    async def _renew(self, lease_id: int, requested: asyncio.Future[Renewal] | None = None) -> int:
        """Renew ``lease_id`` once on the one-shot renewal stream (or wait for the
        renewal ``requested`` already); its TTL (s), 0 if it is gone."""
        if requested is None:
            requested = self._renewals.request_renewal(lease_id)
        sent_at, ttl_s = await self._renewals.answer(requested, lease_id, self._client.timeout)
        if ttl_s > 0:
            self._pool.renewed(lease_id, sent_at + ttl_s)
        return ttl_s

    async def _attach(
        self, txn: Txn, grant: Grant, started: float, *, replaces: pb.KeyValue | None = None
    ) -> Attached | None:
        """Run ``txn``, which puts a key under ``grant``'s lease if its compares hold;
        ``None`` if etcd no longer had that lease: nothing happened, take another.

        A pooled lease may have less than its TTL left: it is renewed alongside the
        transaction (a keep-alive, not a write), so the TTL promised from ``started``
        never outlasts etcd's. A lease of ours that did not end up on the key goes
        back to the pool; one that died under the key is cleared up (its tenure never
        began). ``replaces`` is the key as a move read it (``None`` for a create): an
        interrupted create is undone, an interrupted move is settled in the background
        and keeps whichever tenure it left, so the key is never free. When a copy sent
        after a lost answer fails, the key's history tells whether an earlier one landed.
        """
        # Only a change after this revision can be ours: a move compares the revision
        # it read, and a create lands after every answer seen before it is sent.
        after = self._revision_seen if replaces is None else replaces.mod_revision
        renewal = None
        if grant.valid_until < started + grant.ttl_s:
            renewal = self._renewals.request_renewal(grant.lease_id)
        try:
            response, answers_lost = await self._send_copies(txn)
            kv = first_kv(response)
            alive = renewal is None or await self._renew(grant.lease_id, renewal) > 0
        except BaseException as exc:
            if renewal is not None:
                renewal.cancel()
            if isinstance(exc, BackendError) and self._client.is_lease_not_found(exc):
                self._pool.forget(grant.lease_id)
                return None
            if isinstance(exc, BackendError | PermissionDenied):
                self._pool.put_back(grant)  # refused: nothing landed
                raise
            if replaces is not None:
                self._background.start(self._settle_move(txn, grant, replaces.lease))
                raise
            # The put may have landed under it: revoking the lease, which carries at
            # most this attempt, ends that tenure before anyone relies on it.
            self._pool.forget(grant.lease_id)
            self._background.start(self._client.revoke_quietly(grant.lease_id))
            raise
        self._pool.settled(grant.lease_id, answers_lost=answers_lost)
        if kv is None or kv.lease != grant.lease_id:
            landed = None
            try:
                if answers_lost:  # the last copy failed: did an earlier one land?
                    put = txn.request.success[0].request_put
                    landed = await put_landed(
                        self._watches,
                        put.key,
                        put.value,
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
                return Attached(False, kv, None)
            return Attached(True, kv, Tenure(landed, grant.ttl_s * 1000))
        if not alive:
            self._pool.forget(grant.lease_id)
            await self._cas(Txn.when(mod_revision_is(kv.key, kv.mod_revision)).then(delete(kv.key)))
            return Attached(True, kv, None)
        return Attached(True, kv, Tenure(kv.mod_revision, grant.ttl_s * 1000))

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

    async def _cas(self, txn: Txn) -> pb.KeyValue | None:
        """Run a compare-and-swap whose branches read the key; the key as it stands after.

        When etcd's answer is lost, the same transaction is sent again rather than
        the key re-read (invariant 5): a read may overtake a transaction still in
        flight, while the copies, which put the same value under the same lease and
        compare the same thing, land at most once between them. Our lease on the key
        after the last copy says one did; a failed last copy says nothing of the
        earlier ones (another client may have changed the key since one landed).
        """
        response, _ = await self._send_copies(txn)
        return first_kv(response)

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
        granted = await self._renew(kv.lease)
        if granted <= 0:  # the lease is gone: so is the tenure
            return None
        if granted != self._ttl_s(ttl_ms):
            # Another TTL needs another lease, unless etcd rounds both alike (its
            # minimum TTL, which this process may not have learnt yet).
            grant = await self._pool.take(self._ttl_s(ttl_ms))
            if grant.ttl_s != granted:
                return await self._move(etcd_key, kv, value, ttl_ms, started, grant)
            self._pool.put_back(grant)
        return Tenure(kv.mod_revision, granted * 1000)

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
            grant = grant or await self._pool.take(self._ttl_s(ttl_ms))
            moved = await self._attach(
                Txn.when(mod_revision_is(etcd_key, kv.mod_revision))
                .then(put(etcd_key, value, grant.lease_id), get(etcd_key))
                .otherwise(get(etcd_key)),
                grant,
                started,
                replaces=kv,
            )
            if moved is not None:
                if moved.landed:
                    self.lease_freed(kv.lease)  # the old tenure's, now without its key
                return moved.tenure
            # etcd dropped the lease early (a stalled leader, a frozen process): the
            # key is unchanged, and a failed move would read as a lost tenure.
            grant = None
