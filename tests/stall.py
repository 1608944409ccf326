"""What fault tests need to judge a loss: what the library sent, and who deleted a key.

etcd bug 15247 (see the README's Guarantees) lets a leader that stalled and resumed
revoke leases it judged expired, deleting held keys early. Such a loss is etcd's, and
only then may a test excuse it: the stalled member counted the expiry itself, and the
library never sent a revoke of the key's lease or a delete of the key.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest
from google.protobuf.message import Message

from etcd_leases import HeldLease
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.version import has_bug_15247
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

Call = Callable[..., Awaitable[Any]]
_REVOKE = "/etcdserverpb.Lease/LeaseRevoke"
_TXN = "/etcdserverpb.KV/Txn"
_DELETE = "/etcdserverpb.KV/DeleteRange"


def _deleted_keys(request: pb.TxnRequest) -> Iterable[bytes]:
    for op in [*request.success, *request.failure]:
        if op.HasField("request_delete_range"):
            yield op.request_delete_range.key
        elif op.HasField("request_txn"):
            yield from _deleted_keys(op.request_txn)


@dataclass
class SentWrites:
    """Every lease revoke and key delete a client sent, with when it was sent.

    A revoke sent once every tenure on its lease was known lost (``known_lost``) is
    the library clearing up after a loss it heard of (a lost session lease is
    revoked), never a cause of that loss: not in ``revoked`` (the listener hears of
    it as such). Told apart as the revoke is sent, since a test sampling ``lost``
    hears of the loss a little after the library does.
    """

    revoked: dict[int, float] = field(default_factory=dict)
    deleted: dict[bytes, float] = field(default_factory=dict)
    listener: Callable[[str, int | bytes, float], None] = lambda what, which, at: None
    known_lost: Callable[[int], bool] = lambda lease_id: False

    def record(self, client: EtcdClient, monkeypatch: pytest.MonkeyPatch) -> None:
        """Record what ``client`` sends from now on (it still sends it)."""
        monkeypatch.setattr(client, "call", self.wrap(client.call))

    def wrap(self, call: Call) -> Call:
        """``call``, recording the revokes and deletes it sends (``listener`` hears of
        each: ``"revoke"`` or ``"revoke after loss"`` and the lease ID, or ``"delete"``
        and the key)."""

        async def recording(path: str, request: Message, *args: Any, **kwargs: Any) -> Any:
            now = time.monotonic()
            if path == _REVOKE and isinstance(request, pb.LeaseRevokeRequest):
                after_loss = self.known_lost(request.ID)
                if not after_loss:
                    self.revoked.setdefault(request.ID, now)
                self.listener("revoke after loss" if after_loss else "revoke", request.ID, now)
            elif path == _TXN and isinstance(request, pb.TxnRequest):
                for key in _deleted_keys(request):
                    self.deleted.setdefault(key, now)
                    self.listener("delete", key, now)
            elif path == _DELETE and isinstance(request, pb.DeleteRangeRequest):
                self.deleted.setdefault(request.key, now)
                self.listener("delete", request.key, now)
            return await call(path, request, *args, **kwargs)

        return recording


def every_tenure_lost(held: Iterable[tuple[HeldLease, int]], lease_id: int) -> bool:
    """Whether ``lease_id`` carries tenures among ``held`` (each with the etcd lease
    its key was put on) and every one of them is lost already."""
    on_it = [lease for lease, carrier in held if carrier == lease_id]
    return bool(on_it) and all(lease.lost.is_set() for lease in on_it)


@dataclass
class Loss:
    """A held key lost during a fault, and whether etcd bug 15247 explains it."""

    key: str
    reason: str
    time_left: float  # the holder's own time left when it heard of the loss
    etcd_bug: bool
    sent_before: bool  # the library had sent a revoke of its lease or a delete of it

    def __str__(self) -> str:
        cause = "etcd bug 15247" if self.etcd_bug else "ours"
        sent = ", after the library sent a revoke or delete" if self.sent_before else ""
        return f"{self.key}: {self.reason} with {self.time_left:.2f} s left{sent} ({cause})"


def judge_loss(
    lease: HeldLease,
    time_left: float,
    lost_at: float,
    lease_id: int,
    etcd_key: bytes,
    sent: SentWrites,
    *,
    etcd_version: str,
    stalled_member_expired: int,
) -> Loss:
    """Whether the loss of ``lease`` is etcd's doing, by the rule of this module."""
    reason = lease.lost_reason or ""
    # What the library sends once it heard of the loss (revoking the lost session) is
    # not a cause of it.
    sent_before = (
        sent.revoked.get(lease_id, math.inf) < lost_at
        or sent.deleted.get(etcd_key, math.inf) < lost_at
    )
    etcd_bug = (
        has_bug_15247(etcd_version)
        and stalled_member_expired > 0
        and "released, deleted or expired" in reason
        and time_left > 0
        and not sent_before
    )
    return Loss(lease.key, reason, time_left, etcd_bug, sent_before)


async def time_left_at_loss(lease: HeldLease, lowest: list[float]) -> tuple[float, float]:
    """The holder's own time left when its lease was lost (sampled every 10 ms), and
    when it heard of it; appends to ``lowest`` the least time left it saw before."""
    left, at = lease.remaining(), time.monotonic()
    least = left
    try:
        while not lease.lost.is_set():
            left, at = lease.remaining(), time.monotonic()
            least = min(least, left)
            await asyncio.sleep(0.01)
    finally:
        lowest.append(least)
    lost_at = time.monotonic()
    return left - (lost_at - at), lost_at


async def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait until ``condition()`` holds; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        await asyncio.sleep(0.001)
