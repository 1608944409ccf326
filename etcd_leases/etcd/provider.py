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

import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from types import TracebackType
from typing import Self

from etcd_leases.contract import (
    AcquireResult,
    OwnerState,
    check_key,
    check_lease_call,
    check_transfer_call,
)
from etcd_leases.errors import BackendUnavailable, LeaseValueError
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.fenced import FencedWrites
from etcd_leases.etcd.keeper import owner_of
from etcd_leases.etcd.kept import KeptTenures, state_of
from etcd_leases.etcd.parts import DEFAULT_PREFIX
from etcd_leases.etcd.txn import (
    Txn,
    create_revision_is,
    delete,
    first_kv,
    get,
    mod_revision_at_most,
    put,
    value_is,
)
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

__all__ = ["DEFAULT_PREFIX", "EtcdBackend"]


class EtcdBackend(KeptTenures, FencedWrites):
    """The lease contract on etcd, strongly consistent, with fencing tokens.

    ``endpoints`` is ``"host:port"`` / ``"http(s)://host:port"``, a comma-separated
    list of them, or a sequence. Connects on first use; ``async with`` closes it.
    Every ``member_sync_interval`` seconds (and soon after a member fails) the
    provider reads etcd's member list and adds members that no endpoint names, so a
    member replaced on a new address is followed; ``None`` turns that off.
    """

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

    # The contract.

    async def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> AcquireResult:
        check_lease_call(key, owner, ttl_ms)
        self._client.check_open()
        etcd_key, value = self.etcd_key(key), owner.encode("utf-8")
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
            if kv is None:
                continue  # the key went between the copies sent: again
            if kv.value != value:
                return AcquireResult(False, owner_of(kv))
            if self._late_releases.may_end(kv):
                # A release of ours may still end this tenure: begin another.
                refreshed = await self._move(etcd_key, kv, value, ttl_ms, started)
            else:
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
        etcd_key, value = self.etcd_key(key), owner.encode("utf-8")
        # Only tenures begun before this call (see late_releases): a copy that lands
        # late never ends a later one.
        up_to = self._client.revision_seen
        lease_id = self._pool.carrier(etcd_key, value)
        if lease_id is not None and not self._pool.recycling:
            # So far a one-shot (see LeasePool.recycling): revoking the tenure's lease
            # deletes the key with it, and leaves no free lease to revoke at close.
            self._pool.retire(lease_id)
            try:
                revoked = await self._client.revoke(lease_id)
            except BackendUnavailable:
                self._late_releases.unknown(etcd_key, up_to)
                raise
            kv = await self._client.range(etcd_key) if revoked else None
            if not revoked or (kv is not None and kv.value == value):
                # The lease was gone, or the key was not on it any more: someone moved
                # the owner's tenure to another lease. Released as any key is.
                await self._delete_owned(etcd_key, value, up_to)
        else:
            await self._delete_owned(etcd_key, value, up_to)
        self._late_releases.answered(etcd_key)

    async def _delete_owned(self, etcd_key: bytes, value: bytes, up_to: int) -> None:
        """Delete the key if ``value``'s tenure, begun at ``up_to`` or before, has it."""
        while True:
            # Copies land at most once: after a delete the key has no value to match.
            try:
                response, _ = await self._send_copies(
                    Txn.when(value_is(etcd_key, value), mod_revision_at_most(etcd_key, up_to))
                    .then(delete(etcd_key, prev_kv=True))
                    .otherwise(get(etcd_key))
                )
            except BackendUnavailable:
                self._late_releases.unknown(etcd_key, up_to)
                raise
            if response.succeeded:
                for previous in response.responses[0].response_delete_range.prev_kvs:
                    self.lease_freed(previous.lease)
                return
            kv = first_kv(response)
            if kv is None or kv.value != value:
                return
            # The owner's tenure began after the revisions this client had seen (in
            # another process, say); it began before this answer.
            up_to = response.header.revision

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
            if kv.lease and not await self._renew(kv.lease, etcd_key):
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
