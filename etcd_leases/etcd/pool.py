"""Leases granted ahead of need, so that taking a key is one transaction.

A grant is a raft write of its own. :class:`LeasePool` keeps a few leases per TTL
granted and alive while no key uses them, and hands one to each attempt to put a key
under a lease of its own:

- **One tenure per lease.** A lease is with at most one attempt or tenure at a time.
  It comes back free only when this process saw that no key is on it any more: an
  attempt that lost, or a key this process deleted or moved away whose previous value
  named the lease (:meth:`give_back`). Only the pool revokes a free lease, so no
  decision made from an old read can touch a later tenure.
- **Never a promise longer than etcd's.** A free lease is alive until its last
  answered renewal plus its TTL, which may be less than a full TTL from now; whoever
  takes one renews it once more before promising its TTL to a holder. Free leases
  are renewed by a sweep once they have aged a third of their TTL (a lease given back
  is usually taken again long before).
- **No leak.** Leases handed out belong to their tenures (they expire with them when
  nobody renews them); free leases are revoked when the pool is closed, and the free
  list is trimmed back to what recent use needed.
- **Kept only for a process that comes back.** Until this process takes a lease after
  giving one up, it may be a one-shot (take a key, free it, exit): a lease that comes
  back would only be revoked at close, a write of its own. So until then
  (:attr:`recycling`), a release revokes its tenure's lease (:meth:`carrier`,
  :meth:`retire`), which deletes the key with it: grant, put, revoke, and nothing left.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from etcd_leases.errors import LeaseError
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.keepalive import KeepAliveLoop
from etcd_leases.etcd.tasks import BackgroundTasks, log_if_failed

# A free lease with less than this share of its TTL known left is not handed out:
# its renewal is overdue, something is wrong with it or with the stream.
_FRESH_SHARE = 0.5
# Free leases are renewed once less than this share of their TTL is known left.
_RENEW_SHARE = 2 / 3
# Every this many seconds, free leases beyond the most taken at once since are revoked.
_TRIM_EVERY_S = 30.0
# Free leases kept per TTL whatever the recent use.
_KEEP_FREE = 2


@dataclass(frozen=True)
class Grant:
    """A lease for a tenure to come: its ID, the TTL etcd granted (s), and until when
    it is known to be alive (``time.monotonic()``: the send time of its grant or last
    answered renewal plus that TTL)."""

    lease_id: int
    ttl_s: int
    valid_until: float


@dataclass
class _Free:
    """The free leases of one TTL (oldest first), and the most taken at once lately."""

    leases: dict[int, Grant] = field(default_factory=dict)
    taken: int = 0
    peak: int = 0

    def returned(self) -> None:
        """One lease taken from here is back, or gone."""
        self.taken = max(0, self.taken - 1)


class LeasePool:
    """Free leases per TTL, renewed on ``renewals``' stream; ``grant`` makes new ones.

    A lease that comes back is reused at once, usually: free leases are not kept by
    the keep-alive loop but renewed by a sweep, only once they have aged.
    """

    def __init__(
        self,
        client: EtcdClient,
        keepalive: KeepAliveLoop,
        renewals: KeepAliveLoop,
        grant: Callable[[int], Awaitable[Grant]],
    ) -> None:
        self._client = client
        self._keepalive = keepalive  # what keeps held leases: a lease it keeps is not free
        self._renewals = renewals  # where free leases are renewed
        self._grant = grant
        self._free: dict[int, _Free] = {}
        # Leases of this pool now with an attempt or a tenure, as last known.
        self._out: dict[int, Grant] = {}
        # Out with an attempt that does not know yet where its put went.
        self._unsettled: set[int] = set()
        # Out with a tenure whose put had an answer lost: never reused (a copy of it
        # might yet land), revoked once its key is gone.
        self._tainted: set[int] = set()
        # Unsettled, and this process has ended the tenure their put began meanwhile.
        self._ended_unsettled: set[int] = set()
        # The key and value each lease out carries, noted when a put on it landed.
        self._carrying: dict[int, tuple[bytes, bytes]] = {}
        self._carrier_of: dict[bytes, int] = {}
        self._given_up = False  # a lease of this pool came back, or was retired
        self._recycling = False  # ...and a lease was taken after that
        self._trimmed_at = time.monotonic()
        self._refilling: set[int] = set()  # the TTLs a grant is under way for
        self._closed = False
        self._sweeper: asyncio.Task[None] | None = None
        self._background = BackgroundTasks()

    def free_lease_ids(self) -> set[int]:
        """The leases free in the pool now (granted, renewed, carrying no key)."""
        return {lease_id for free in self._free.values() for lease_id in free.leases}

    @property
    def recycling(self) -> bool:
        """Whether this process took a lease after giving one up: then leases that come
        back are kept for its next takes (and revoked at close)."""
        return self._recycling

    async def take(self, ttl_s: int) -> Grant:
        """A lease of ``ttl_s`` seconds (as etcd grants it) for one attempt."""
        self._recycling = self._recycling or self._given_up
        self._trim()
        free = self._free.setdefault(ttl_s, _Free())
        free.taken += 1
        free.peak = max(free.peak, free.taken)
        try:
            while free.leases:
                _, grant = free.leases.popitem()  # the most recently used
                if grant.valid_until - time.monotonic() > _FRESH_SHARE * grant.ttl_s:
                    if not free.leases:  # the next taker should not wait for a grant
                        self._refill(ttl_s)
                    break
                self._background.start(self._client.revoke_quietly(grant.lease_id))
            else:
                grant = await self._grant(ttl_s)
        except BaseException:
            free.taken -= 1
            raise
        self._out[grant.lease_id] = grant
        self._unsettled.add(grant.lease_id)
        return grant

    def settled(self, lease_id: int, *, answers_lost: bool) -> bool:
        """The attempt that took ``lease_id`` knows where its put went; whether this
        process ended the tenure it began meanwhile (:meth:`ended_unsettled`)."""
        self._unsettled.discard(lease_id)
        if answers_lost:
            self._tainted.add(lease_id)
        ended = lease_id in self._ended_unsettled
        self._ended_unsettled.discard(lease_id)
        return ended

    def ended_unsettled(self, lease_id: int) -> bool:
        """Whether ``lease_id`` is with an attempt that has not settled yet; if so, noted
        that this process ended (deleted or moved away) the tenure its put began: the
        attempt, which may still send a copy of its put, decides what becomes of it."""
        if lease_id not in self._unsettled:
            return False
        self._ended_unsettled.add(lease_id)
        return True

    def reusable(self, lease_id: int) -> bool:
        """Whether ``lease_id``, once its key is gone, may carry another tenure."""
        return (
            lease_id in self._out
            and lease_id not in self._unsettled
            and lease_id not in self._tainted
        )

    def carries(self, lease_id: int, key: bytes, value: bytes) -> None:
        """A put of ``value`` on ``key`` under ``lease_id`` (out of this pool) landed."""
        if lease_id in self._out:
            self._uncarry(lease_id)
            self._carrying[lease_id] = (key, value)
            self._carrier_of[key] = lease_id

    def carrier(self, key: bytes, value: bytes) -> int | None:
        """The lease of this pool that carries ``key`` with ``value``, as last known."""
        lease_id = self._carrier_of.get(key)
        if lease_id is None or self._carrying.get(lease_id) != (key, value):
            return None
        return lease_id

    def retire(self, lease_id: int) -> None:
        """The caller revokes ``lease_id``, which carried a tenure now ending: not ours."""
        self.forget(lease_id)
        self._given_up = True

    def _uncarry(self, lease_id: int) -> None:
        carried = self._carrying.pop(lease_id, None)
        if carried is not None and self._carrier_of.get(carried[0]) == lease_id:
            del self._carrier_of[carried[0]]

    def put_back(self, grant: Grant) -> None:
        """An attempt took ``grant`` and sent nothing under it: free again."""
        self.settled(grant.lease_id, answers_lost=False)
        self.give_back(grant.lease_id)

    def renewed(self, lease_id: int, valid_until: float) -> None:
        """A renewal of ``lease_id`` was answered: it is alive until ``valid_until``."""
        for leases in (self._out, *(free.leases for free in self._free.values())):
            grant = leases.get(lease_id)
            if grant is not None and valid_until > grant.valid_until:
                leases[lease_id] = Grant(lease_id, grant.ttl_s, valid_until)

    def give_back(self, lease_id: int) -> None:
        """No key is on ``lease_id`` any more (its attempt lost, or this process deleted
        or moved away its key): free again, if it is :meth:`reusable`.

        A lease some keeper of this process still renews (its holder has not noticed
        yet) is left to it, and expires with it.
        """
        if not self.reusable(lease_id):
            return
        self._uncarry(lease_id)
        self._given_up = True
        grant = self._out.pop(lease_id)
        # Filed by the TTL etcd granted, which is what later takers ask for.
        free = self._free.setdefault(grant.ttl_s, _Free())
        free.returned()
        if self._closed or self._keepalive.is_kept(lease_id):
            return
        if grant.valid_until <= time.monotonic():  # it may be gone already
            return
        free.leases[lease_id] = grant
        self._start_sweeping()
        self._trim()

    def forget(self, lease_id: int) -> None:
        """``lease_id`` is gone (etcd said so), revoked, or left to run out: not ours
        any more."""
        grant = self._out.pop(lease_id, None)
        self._uncarry(lease_id)
        self._unsettled.discard(lease_id)
        self._tainted.discard(lease_id)
        self._ended_unsettled.discard(lease_id)
        if grant is not None and grant.ttl_s in self._free:
            self._free[grant.ttl_s].returned()

    async def close(self) -> None:
        """Revoke the free leases (best effort); the pool hands out nothing more."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        leases = self.free_lease_ids()
        self._free.clear()
        await asyncio.gather(*(self._client.revoke_quietly(lease_id) for lease_id in leases))
        await self._background.wait(self._client.timeout)

    def _refill(self, ttl_s: int) -> None:
        """Grant one more free lease of ``ttl_s`` in the background."""
        if ttl_s not in self._refilling:
            self._refilling.add(ttl_s)
            self._background.start(self._grant_ahead(ttl_s))

    async def _grant_ahead(self, ttl_s: int) -> None:
        try:
            grant = await self._grant(ttl_s)
        except LeaseError:
            return  # the next taker grants on its own
        finally:
            self._refilling.discard(ttl_s)
        if self._closed:
            await self._client.revoke_quietly(grant.lease_id)
            return
        free = self._free.setdefault(grant.ttl_s, _Free())
        # The least recently used end: the leases just given back go first.
        free.leases = {grant.lease_id: grant, **free.leases}
        self._start_sweeping()

    def _start_sweeping(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep(), name="etcd-leases lease pool sweeper"
            )
            self._sweeper.add_done_callback(log_if_failed)

    async def _sweep(self) -> None:
        """Renew the free leases that aged, until none is left."""
        while not self._closed and any(free.leases for free in self._free.values()):
            shortest = min(ttl_s for ttl_s, free in self._free.items() if free.leases)
            await asyncio.sleep(min(2.0, max(0.1, shortest / 6)))
            now = time.monotonic()
            aged = [
                grant
                for free in self._free.values()
                for grant in free.leases.values()
                if grant.valid_until - now < _RENEW_SHARE * grant.ttl_s
            ]
            await asyncio.gather(*(self._renew(grant) for grant in aged))

    async def _renew(self, grant: Grant) -> None:
        try:
            sent_at, ttl_s = await self._renewals.renew_once(grant.lease_id, self._client.timeout)
        except LeaseError:
            return  # the next sweep tries again; take() skips it if it runs too late
        if ttl_s > 0:
            self.renewed(grant.lease_id, sent_at + ttl_s)
            return
        free = self._free.get(grant.ttl_s)
        if free is not None:
            free.leases.pop(grant.lease_id, None)  # gone

    def _trim(self) -> None:
        """Every so often, revoke the free leases recent use did not need, and forget
        the tenures' leases that expired (their keys went without this process)."""
        now = time.monotonic()
        if now - self._trimmed_at < _TRIM_EVERY_S:
            return
        self._trimmed_at = now
        expired = [
            lease_id
            for lease_id, grant in self._out.items()
            if grant.valid_until < now
            and lease_id not in self._unsettled
            and not self._keepalive.is_kept(lease_id)
        ]
        for lease_id in expired:
            self.forget(lease_id)
        for free in self._free.values():
            keep = max(_KEEP_FREE, free.peak - free.taken)
            free.peak = free.taken
            while len(free.leases) > keep:
                lease_id = next(iter(free.leases))  # the least recently used
                del free.leases[lease_id]
                self._background.start(self._client.revoke_quietly(lease_id))
