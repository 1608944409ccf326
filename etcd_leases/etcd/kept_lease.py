"""A lease a keep-alive loop renews, and what is known about it.

``valid_until`` is on our own clock (``time.monotonic()``): the send time of the last
keep-alive etcd answered plus the TTL it answered, so never later than etcd's own
deadline. ``lost`` is set once and for all; a lease whose deadline passed stays lost
even if an answer turns up later, since its holder may already have acted on the loss.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

__all__ = ["DEADLINE_PASSED", "LEASE_NOT_FOUND", "PROVIDER_CLOSED", "KeptLease"]

_log = logging.getLogger("etcd_leases.etcd.keepalive")

#: ``lost_reason`` when etcd answered that the lease does not exist (revoked, expired).
LEASE_NOT_FOUND = "lease not found"
#: ``lost_reason`` when ``valid_until`` passed before any renewal was answered.
DEADLINE_PASSED = "deadline passed without a renewal"
#: ``lost_reason`` of the leases still kept when the loop (or its client) is closed.
PROVIDER_CLOSED = "provider closed"

# Renew at a third of the TTL (as the Go client does), but never more often than
# this: a 1 s lease is renewed about three times a second, not in a tight loop.
MIN_INTERVAL_S = 0.3


def _run_callback(fn: Callable[[KeptLease], None], kept: KeptLease) -> None:
    # Callbacks run inside the loop's own bookkeeping (the watchdog timer, the
    # reader): one that raises must not stop the others or the loop.
    try:
        fn(kept)
    except Exception:
        _log.exception("loss callback %r of lease %x failed", fn, kept.lease_id)


class KeptLease:
    """A lease a :class:`KeepAliveLoop` renews, and what is known about it.

    ``valid_until`` (``time.monotonic()``) is the instant until which the lease is
    known to be alive: the send time of the last keep-alive etcd answered plus the
    TTL it answered. ``lost`` is set once and for all when the lease is gone or can
    no longer be vouched for; ``lost_reason`` then says why.
    """

    __slots__ = (
        "_callbacks",
        "_interval",
        "_renew_at",
        "_request",
        "_tracked",
        "lease_id",
        "lost",
        "lost_reason",
        "ttl_s",
        "valid_until",
    )

    def __init__(self, lease_id: int, ttl_s: int, valid_until: float) -> None:
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self.valid_until = valid_until
        self.lost = asyncio.Event()
        self.lost_reason: str | None = None
        # A dict, so a holder that is done can take its callback back in O(1).
        self._callbacks: dict[Callable[[KeptLease], None], None] = {}
        # True while its loop renews it: neither released nor lost.
        self._tracked = True
        self._interval = max(ttl_s / 3, MIN_INTERVAL_S)
        # When its loop renews it next (kept by its RenewalSchedule).
        self._renew_at = 0.0
        # Built once: a lease is renewed thousands of times.
        self._request = pb.LeaseKeepAliveRequest(ID=lease_id)

    def remaining(self) -> float:
        """Seconds the lease is still known to be alive; 0 once lost."""
        if self.lost.is_set():
            return 0.0
        return max(0.0, self.valid_until - time.monotonic())

    def add_loss_callback(self, fn: Callable[[KeptLease], None]) -> None:
        """Call ``fn(self)`` once, when ``lost`` is set (right away if it already is).

        ``fn`` runs inside the event loop's bookkeeping: it must be quick and must not
        block. An exception it raises is logged, not propagated.
        """
        if self.lost.is_set():
            _run_callback(fn, self)
        else:
            self._callbacks[fn] = None

    def remove_loss_callback(self, fn: Callable[[KeptLease], None]) -> None:
        """Forget ``fn`` (added by :meth:`add_loss_callback`), if it has not run."""
        self._callbacks.pop(fn, None)

    def _set_lost(self, reason: str) -> None:
        if self.lost.is_set():
            return
        self._tracked = False
        # The reason first: whoever wakes up on ``lost`` reads it.
        self.lost_reason = reason
        self.lost.set()
        callbacks, self._callbacks = self._callbacks, {}
        for fn in callbacks:
            _run_callback(fn, self)

    def __repr__(self) -> str:
        state = f"lost: {self.lost_reason}" if self.lost.is_set() else f"{self.remaining():.3f} s"
        return f"<KeptLease {self.lease_id:x} ttl={self.ttl_s}s {state}>"
