"""Leader election that shares etcd's own layout: Go's ``concurrency.Election``.

Candidates of the election ``name`` are keys ``<name>/<lease id hex>`` on each
candidate's session lease, valued with its proposal; the leader is the key created
first. So a candidate here, a Go service's ``concurrency.NewElection(session, name)``
and an operator's ``etcdctl elect name proposal`` are candidates of one election,
one leader at a time::

    election = NativeElection(provider, "reports", ttl_s=10)
    token = await election.campaign("worker-a")   # returns once leading
    ...                                           # election.lost is set on loss
    await election.resign()                       # the next candidate leads

The fencing token is the create revision of the leader's key (Go's ``Election.Rev()``):
etcd revisions only grow, and a candidate leads only once every key created before
its own is gone, so each leader's token is higher than every earlier leader's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from etcd_leases.contract import check_owner
from etcd_leases.errors import LeaseLost
from etcd_leases.etcd.native.keys import oldest_request, wait_turn
from etcd_leases.etcd.native.queue import Queued
from etcd_leases.etcd.provider import EtcdBackend
from etcd_leases.etcd.txn import Txn, create_revision_is, prefix_end, put
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

#: Go's ``concurrency`` session default (``etcdctl elect`` uses it).
DEFAULT_TTL_S = 60


@dataclass(frozen=True)
class Leader:
    """The current leader: its proposal, its key, and its fencing token."""

    value: str
    key: str
    token: int


class NativeElection(Queued):
    """One candidate in the etcd election ``name`` (an etcd key prefix, used as is:
    not under the provider's prefix, since ``etcdctl`` knows nothing of that)."""

    _at_head = "the leader of"

    def __init__(self, provider: EtcdBackend, name: str, *, ttl_s: int = DEFAULT_TTL_S) -> None:
        super().__init__(provider, name, ttl_s)

    async def campaign(self, value: str, timeout: float | None = None) -> int:
        """Enter the election with ``value`` and return once leading: the fencing token.

        ``value`` is a non-empty str (as an owner is). Raises ``TimeoutError`` after
        ``timeout`` seconds (the candidacy is withdrawn), :class:`LeaseLost` if the
        session ends first. Campaigning again while leading proclaims ``value`` instead.
        """
        check_owner(value, "value")
        if self._holding():
            await self.proclaim(value)
            assert self.token is not None
            return self.token
        session = await self._join()
        key = self._key
        try:
            async with asyncio.timeout(timeout):
                # A new lease, so a new key: Go's "reuse the key" branch never runs.
                txn = Txn.when(create_revision_is(key, 0)).then(
                    put(key, value.encode("utf-8"), session.lease_id)
                )
                response = await self.provider.client.txn(txn.request)
                if not response.succeeded:
                    raise LeaseLost(f"{key.decode()} exists already")
                revision = response.header.revision
                await wait_turn(self.provider, session, self._prefix, key, revision)
        except BaseException:
            await self.resign()
            raise
        self.token = revision
        return revision

    async def proclaim(self, value: str) -> None:
        """Change the leader's value without an election (Go's ``Proclaim``)."""
        check_owner(value, "value")
        self.check()
        assert self._session is not None and self.token is not None
        txn = Txn.when(create_revision_is(self._key, self.token)).then(
            put(self._key, value.encode("utf-8"), self._session.lease_id)
        )
        if not (await self.provider.client.txn(txn.request)).succeeded:
            raise LeaseLost(f"{self._key.decode()} is no longer ours")

    async def resign(self) -> None:
        """Give up leadership or candidacy: the next candidate leads. A no-op if neither."""
        await self._leave()

    async def leader(self) -> Leader | None:
        """The current leader, whoever's candidate it is; ``None`` if there is none."""
        return (await self._read_leader())[0]

    async def observe(self) -> AsyncGenerator[Leader | None, None]:
        """The leader now, then each change of leader or of its value (Go's ``Observe``,
        ``etcdctl elect --listen``); ``None`` while there is none."""
        last, revision = await self._read_leader()
        yield last
        watcher = self.provider._watches.watch(
            self._prefix, revision + 1, range_end=prefix_end(self._prefix)
        )
        try:
            async for _ in watcher:  # any change under the prefix: read the head again
                now, _ = await self._read_leader()
                if now != last:
                    last = now
                    yield now
        finally:
            watcher.cancel()

    async def _read_leader(self) -> tuple[Leader | None, int]:
        """The leader, and the store revision it was read at."""
        response = await self.provider.client.call(
            "/etcdserverpb.KV/Range", oldest_request(self._prefix), pb.RangeResponse
        )
        if not response.kvs:
            return None, response.header.revision
        kv = response.kvs[0]
        leader = Leader(kv.value.decode("utf-8", "replace"), kv.key.decode(), kv.create_revision)
        return leader, response.header.revision
