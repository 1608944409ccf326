"""Following the members: etcd's member list says where they are now.

As the Go client's auto-sync: every ``interval`` seconds, and soon after a member
fails a call or stream (at most every few seconds: a failure within that time is read
for at its end, never dropped, since the call that failed moved on to a member that
answers, and may never fail again to ask), the member list is read and the
voting members that no endpoint names yet are added. So a member replaced by one on a
new address is found, even once no endpoint we were given names a live member.
Endpoints are added only, never dropped: one given may be a proxy or a DNS name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable

from etcd_leases.errors import LeaseError
from etcd_leases.etcd.members import Members
from etcd_leases.etcd.tasks import BackgroundTasks
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

__all__ = ["MemberSync"]

# A member failure makes the client read the member list again, at most this often.
_AFTER_FAILURE_EVERY_S = 5.0

_log = logging.getLogger("etcd_leases.etcd.client")

ListMembers = Callable[[], Awaitable[pb.MemberListResponse]]


class MemberSync:
    """Reads the member list through ``list_members`` and adds new members to ``members``;
    ``interval`` ``None`` turns it off."""

    def __init__(self, members: Members, list_members: ListMembers, interval: float | None) -> None:
        self._members = members
        self._list_members = list_members
        self._interval = interval
        self._after_failure_at = -math.inf
        self._deferred: asyncio.TimerHandle | None = None  # the read a failure asked for
        self._syncs = BackgroundTasks()
        self._periodic: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the periodic sync (idempotent; from the event loop, on first use)."""
        if self._periodic is None and self._interval is not None:
            self._periodic = asyncio.get_running_loop().create_task(
                self._every(self._interval), name="etcd-leases member sync"
            )

    async def sync(self) -> list[str]:
        """Add the members etcd lists that no endpoint names yet; their endpoints."""
        response = await self._list_members()
        # Learners serve no linearizable request: not an endpoint for us.
        voters = [member for member in response.members if not member.isLearner]
        learned = self._members.learn(url for member in voters for url in member.clientURLs)
        if learned:
            _log.info("etcd's member list names new members: %s", ", ".join(learned))
        return learned

    def member_failed(self) -> None:
        """A member failed a call or stream: it may have been replaced. Look soon."""
        if self._interval is None or self._members.closed or self._deferred is not None:
            return
        wait = self._after_failure_at + _AFTER_FAILURE_EVERY_S - time.monotonic()
        if wait <= 0:
            self._sync_after_failure()
        else:
            self._deferred = asyncio.get_running_loop().call_later(wait, self._sync_after_failure)

    def _sync_after_failure(self) -> None:
        self._deferred = None
        if not self._members.closed:
            self._after_failure_at = time.monotonic()
            self._syncs.start(self._quietly())

    async def close(self, timeout: float) -> None:
        if self._deferred is not None:
            self._deferred.cancel()
            self._deferred = None
        if self._periodic is not None:
            self._periodic.cancel()
            await asyncio.wait([self._periodic])
        await self._syncs.wait(timeout)

    async def _quietly(self) -> None:
        with contextlib.suppress(LeaseError):  # the next sync tries again
            await self.sync()

    async def _every(self, interval: float) -> None:
        while not self._members.closed:
            await asyncio.sleep(interval)
            await self._quietly()
