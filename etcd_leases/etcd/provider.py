"""EtcdBackend: each contract call as its etcd transaction(s).

The invariants (see the README's "How it maps onto etcd"):

1. One etcd lease per tenure: revoking or keep-aliving it touches only that tenure.
2. Every ownership change is one compare-and-swap transaction.
3. Reads that decide ownership are linearizable.
4. Leases granted for attempts that lost, and of tenures that ended, are revoked.
5. A write whose outcome is unknown is settled by re-reading the key.
6. The fencing token is the key's ``mod_revision``.
7. The key's value is the owner, UTF-8, under ``prefix``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

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
    ProviderClosed,
)
from etcd_leases.etcd.client import EtcdClient, new_lease_id
from etcd_leases.etcd.keepalive import KeepAliveLoop, KeptLease
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
from etcd_leases.etcd.watch import Watcher, WatchStream
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

DEFAULT_PREFIX = "/etcd-leases/"
# How many copies of a transaction to send when etcd's answers are lost.
_CAS_ATTEMPTS = 3


@dataclass(frozen=True)
class Grant:
    """A lease granted for a tenure to come: its ID and the TTL etcd granted, in s."""

    lease_id: int
    ttl_s: int


@dataclass(frozen=True)
class Tenure:
    """A tenure as etcd holds it: the fencing token and the TTL granted, in ms."""

    token: int
    ttl_ms: int


def ttl_seconds(ttl_ms: int) -> int:
    """etcd counts whole seconds: round up, never down."""
    return -(-ttl_ms // 1000)


def owner_of(kv: pb.KeyValue) -> str:
    return kv.value.decode("utf-8", errors="replace")


def state_of(kv: pb.KeyValue | None) -> OwnerState:
    return OwnerState(None, None) if kv is None else OwnerState(owner_of(kv), kv.mod_revision)


class EtcdBackend:
    """The lease contract on etcd, strongly consistent, with fencing tokens.

    ``endpoints`` is ``"host:port"`` / ``"http(s)://host:port"``, a comma-separated
    list of them, or a sequence. Connects on first use; ``async with`` closes it.
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
        )
        # The server's minimum TTL, learnt from grants: asking less than it would
        # make every renewal look like a change of TTL.
        self._min_ttl_s = 1
        # One keep-alive stream and one watch stream serve every held lease.
        self._keepalive = KeepAliveLoop(self._client)
        self._watches = WatchStream(self._client)
        self._background: set[asyncio.Task[None]] = set()

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
        if self._background:
            await asyncio.wait(self._background, timeout=self._client.timeout)
        await self._keepalive.close()
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
        kv = await self._client.range(etcd_key)
        grant: Grant | None = None  # made on the first attempt to create the key
        try:
            while True:
                if kv is None:
                    grant = grant or await self._grant(ttl_ms)
                    try:
                        kv = await self._cas(
                            Txn.when(create_revision_is(etcd_key, 0))
                            .then(put(etcd_key, value, grant.lease_id), get(etcd_key))
                            .otherwise(get(etcd_key))
                        )
                    except BackendError as exc:
                        if not self._client.is_lease_not_found(exc):
                            raise
                        # This process stalled past the grant's TTL before the create
                        # reached etcd: nothing was written under it. Grant again.
                        grant = None
                        continue
                    if kv is not None and kv.lease == grant.lease_id:
                        return AcquireResult(True, owner, kv.mod_revision, grant.ttl_s * 1000)
                elif kv.value != value:
                    await self._discard(grant)
                    return AcquireResult(False, owner_of(kv))
                else:
                    await self._discard(grant)
                    grant = None
                    refreshed = await self._refresh(etcd_key, value, ttl_ms, kv)
                    if refreshed is not None:
                        return AcquireResult(True, owner, refreshed.token, refreshed.ttl_ms)
                    kv = await self._client.range(etcd_key)
        except BaseException:
            if grant is not None:  # interrupted: the create may or may not have landed
                self._in_background(self._revoke_quietly(grant.lease_id))
            raise

    async def get_lease_owner(self, key: str) -> str | None:
        check_key(key)
        self._client.check_open()
        kv = await self._client.range(self.etcd_key(key))
        return None if kv is None else owner_of(kv)

    async def release_lease(self, key: str, owner: str) -> None:
        check_lease_call(key, owner)
        self._client.check_open()
        etcd_key, value = self.etcd_key(key), owner.encode("utf-8")
        kv = await self._client.range(etcd_key)
        while kv is not None and kv.value == value:
            # Delete only the tenure read: revoking the lease read would miss the key
            # if a renewal with another TTL (or a self-transfer) just moved it.
            now = await self._cas(
                Txn.when(mod_revision_is(etcd_key, kv.mod_revision))
                .then(delete(etcd_key))
                .otherwise(get(etcd_key))
            )
            if kv.lease and (now is None or now.lease != kv.lease):
                await self._revoke_quietly(kv.lease)  # that tenure's (invariant 1), now over
            if now is None or now.create_revision != kv.create_revision:
                return  # deleted, by us or since: this key's tenures are over
            kv = now  # moved to another lease of the same key: release that

    async def renew_lease(self, key: str, owner: str, ttl_ms: int) -> bool:
        check_lease_call(key, owner, ttl_ms)
        self._client.check_open()
        etcd_key, value = self.etcd_key(key), owner.encode("utf-8")
        kv = await self._client.range(etcd_key)
        if kv is None or kv.value != value:
            return False
        return await self._refresh(etcd_key, value, ttl_ms, kv) is not None

    async def transfer_lease(self, key: str, from_owner: str, to_owner: str, ttl_ms: int) -> bool:
        check_transfer_call(key, from_owner, to_owner, ttl_ms)
        self._client.check_open()
        etcd_key = self.etcd_key(key)
        kv = await self._client.range(etcd_key)
        if kv is None or kv.value != from_owner.encode("utf-8"):
            return False
        # etcd deletes an expired lease's key up to 500 ms after its expiry (seconds
        # under mass expiry): meanwhile the key still reads as held. A keep-alive
        # answers 0 for an expired lease (after waiting for its revoke) and else
        # makes it last a full TTL more, so it cannot expire before the move.
        if kv.lease and await self._client.keep_alive_once(kv.lease) <= 0:
            return False
        grant = await self._grant(ttl_ms)
        return await self._move(etcd_key, kv, to_owner.encode("utf-8"), grant) is not None

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

    async def keep_lease(
        self, key: str, owner: str, token: int, ttl_ms: int, valid_until: float
    ) -> EtcdKeeper:
        check_lease_call(key, owner, ttl_ms)
        self._client.check_open()
        etcd_key = self.etcd_key(key)
        kv, revision = await self._client.range_at(etcd_key)
        if kv is None or state_of(kv) != OwnerState(owner, token) or not kv.lease:
            raise LeaseLost(f"{owner!r} no longer holds {key!r} with token {token}")
        kept = self._keepalive.keep(kv.lease, ttl_seconds(ttl_ms), valid_until)
        return EtcdKeeper(self, etcd_key, kept, revision + 1)

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

        Only for transactions whose copies land at most once between them.
        """
        for attempt in range(_CAS_ATTEMPTS):
            try:
                return await self._client.txn(txn.request), attempt > 0
            except BackendUnavailable:
                if attempt == _CAS_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    # How each step becomes etcd calls.

    async def _grant(self, ttl_ms: int) -> Grant:
        wanted = max(ttl_seconds(ttl_ms), self._min_ttl_s)
        lease_id = new_lease_id()
        try:
            granted = await self._client.grant(wanted, lease_id)
        except BaseException:
            # The grant may have landed: revoke it (invariant 4), whatever happens here.
            self._in_background(self._revoke_quietly(lease_id))
            raise
        if granted > wanted:
            self._min_ttl_s = granted
        return Grant(lease_id, granted)

    async def _discard(self, grant: Grant | None) -> None:
        if grant is not None:
            await self._revoke_quietly(grant.lease_id)

    async def _revoke_quietly(self, lease_id: int) -> None:
        """Best-effort cleanup: an unreachable cluster lets the lease expire instead."""
        with contextlib.suppress(BackendUnavailable, ProviderClosed):
            await self._client.revoke(lease_id)

    async def _cas(self, txn: Txn) -> pb.KeyValue | None:
        """Run a compare-and-swap whose branches read the key; the key as it stands after.

        When etcd's answer is lost, the same transaction is sent again rather than
        the key re-read (invariant 5): a read may overtake a transaction still in
        flight, while the copies, which put the same value under the same lease and
        compare the same thing, land at most once between them; the answer to the
        last copy tells whether one did (our lease is on the key) or not.
        """
        response, _ = await self._send_copies(txn)
        return first_kv(response)

    async def _refresh(
        self, etcd_key: bytes, value: bytes, ttl_ms: int, kv: pb.KeyValue
    ) -> Tenure | None:
        """Reset the TTL of the tenure ``kv`` shows; ``None`` if that tenure is over."""
        if not kv.lease:  # written by hand without a lease: give it one
            return await self._move(etcd_key, kv, value, await self._grant(ttl_ms))
        # A keep-alive resets the lease to its granted TTL and answers with it.
        granted = await self._client.keep_alive_once(kv.lease)
        if granted <= 0:  # the lease is gone: so is the tenure
            return None
        if granted != max(ttl_seconds(ttl_ms), self._min_ttl_s):
            # Another TTL needs another lease, unless etcd rounds both alike (its
            # minimum TTL, which this process may not have learnt yet).
            grant = await self._grant(ttl_ms)
            if grant.ttl_s != granted:
                return await self._move(etcd_key, kv, value, grant)
            await self._discard(grant)
        # Same TTL: the tenure and its token stay, if the key is still on its lease.
        now = await self._client.range(etcd_key)
        if now is None or now.lease != kv.lease or now.value != value:
            return None
        return Tenure(now.mod_revision, granted * 1000)

    async def _move(
        self, etcd_key: bytes, kv: pb.KeyValue, value: bytes, grant: Grant
    ) -> Tenure | None:
        """Put ``value`` on the key under ``grant`` if ``kv`` still holds it, atomically."""
        txn = (
            Txn.when(mod_revision_is(etcd_key, kv.mod_revision))
            .then(put(etcd_key, value, grant.lease_id), get(etcd_key))
            .otherwise(get(etcd_key))
        )
        try:
            now = await self._cas(txn)
        except BaseException:
            # Interrupted: the move may have landed, and then the new lease is someone's
            # tenure. Settle it in the background, by sending the same transaction.
            self._in_background(self._settle_move(txn, grant.lease_id, kv.lease))
            raise
        if not await self._conclude_move(now, grant.lease_id, kv.lease):
            return None
        assert now is not None  # the move landed: our lease is on the key
        return Tenure(now.mod_revision, grant.ttl_s * 1000)

    async def _conclude_move(self, now: pb.KeyValue | None, lease_id: int, old_lease: int) -> bool:
        """Revoke whichever lease lost: the old tenure's if the move landed, else ours."""
        if now is None or now.lease != lease_id:
            await self._revoke_quietly(lease_id)
            return False
        if old_lease:
            await self._revoke_quietly(old_lease)
        return True

    async def _settle_move(self, txn: Txn, lease_id: int, old_lease: int) -> None:
        with contextlib.suppress(LeaseError):
            await self._conclude_move(await self._cas(txn), lease_id, old_lease)

    def _in_background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)  # a reference, so the task is not collected
        task.add_done_callback(self._background.discard)


class EtcdKeeper:
    """A tenure kept alive on the provider's keep-alive stream, its key watched.

    Any event on the key ends the tenure: renewals do not write, so an event is a
    transfer, a release, an expiry or a delete by anyone.
    """

    def __init__(
        self, backend: EtcdBackend, etcd_key: bytes, kept: KeptLease, watch_from: int
    ) -> None:
        self._backend = backend
        self._etcd_key = etcd_key
        self._kept = kept
        self._recheck: asyncio.Task[None] | None = None  # referenced, so not collected
        self._watcher: Watcher = backend._watches.watch(
            etcd_key,
            watch_from,
            on_events=self._on_events,
            # Without its watch a tenure cannot be vouched for within milliseconds.
            on_error=lambda exc: self.lose(f"the key's watch failed: {exc}"),
        )
        kept.add_loss_callback(lambda _: self._watcher.cancel())

    @property
    def lost(self) -> asyncio.Event:
        return self._kept.lost

    @property
    def lost_reason(self) -> str | None:
        return self._kept.lost_reason

    def remaining(self) -> float:
        return self._kept.remaining()

    def lose(self, reason: str) -> None:
        self._backend._keepalive.mark_lost(self._kept, reason)
        self._watcher.cancel()

    def _on_events(self, events: list[pb.Event]) -> None:
        if not events:  # history compacted away: re-read to know
            self._recheck = asyncio.get_running_loop().create_task(self._reread())
            return
        last = events[-1]
        if last.type == pb.Event.DELETE:
            self.lose("the key was released, deleted or expired")
        else:
            self.lose(f"the key was handed to {owner_of(last.kv)!r}")

    async def _reread(self) -> None:
        try:
            kv = await self._backend.client.range(self._etcd_key)
        except LeaseError as exc:
            self.lose(f"could not re-read the key: {exc}")
            return
        if kv is None or kv.lease != self._kept.lease_id:
            self.lose("the key changed while its watch history was compacted")
