"""EtcdKeeper: one held tenure, its lease renewed and its key watched."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from etcd_leases.errors import LeaseError
from etcd_leases.etcd.keepalive import KeepAliveLoop
from etcd_leases.etcd.kept_lease import KeptLease
from etcd_leases.etcd.watch.held_keys import HeldKey, HeldKeysWatch
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb


def owner_of(kv: pb.KeyValue) -> str:
    return kv.value.decode("utf-8", errors="replace")


class EtcdKeeper:
    """A tenure kept alive on the provider's keep-alive stream, its key watched (by the
    provider's one watch over its prefix).

    Any event on the key ends the tenure: renewals do not write, so an event is a
    transfer, a release, an expiry or a delete by anyone. So does the loss of its
    lease, which may be ``shared`` with other keys (a session lease): then ending
    this tenure leaves the lease to them, and a tenure given up while its key may
    still stand (its watch failed) calls ``abandon``, which must delete the key if
    it is still this tenure's: the shared lease would keep it alive for nobody.
    """

    def __init__(
        self,
        etcd_key: bytes,
        kept: KeptLease,
        watch_from: int,
        held_keys: HeldKeysWatch,
        keepalive: KeepAliveLoop,
        *,
        shared: bool,
        abandon: Callable[[bytes, int], None] | None = None,
    ) -> None:
        self._etcd_key = etcd_key
        self._keepalive = keepalive
        self._kept = kept
        self._shared = shared
        self._abandon = abandon
        self._token = watch_from - 1
        self.lost = asyncio.Event()
        self.lost_reason: str | None = None
        self._on_lost: Callable[[], None] | None = None
        self._watch: HeldKey = held_keys.watch(
            etcd_key,
            watch_from,
            on_changed=self.lose,
            on_error=self._watch_failed,
        )
        kept.add_loss_callback(self._on_lease_lost)

    def remaining(self) -> float:
        return 0.0 if self.lost.is_set() else self._kept.remaining()

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (one, replacing any before) soon after the tenure ends.

        What a holder would otherwise wait on ``lost`` for in a task of its own: a
        task per held key is a third of what 100,000 held keys allocate.
        """
        self._on_lost = callback
        if self.lost.is_set():
            asyncio.get_running_loop().call_soon(callback)

    def lose(self, reason: str) -> None:
        if self.lost.is_set():
            return
        # The reason first: whoever wakes up on ``lost`` reads it.
        self.lost_reason = reason
        self.lost.set()
        if self._on_lost is not None:
            asyncio.get_running_loop().call_soon(self._on_lost)
            self._on_lost = None
        self._watch.cancel()
        self._kept.remove_loss_callback(self._on_lease_lost)
        if not self._shared:
            self._keepalive.release(self._kept)

    def _give_up(self, reason: str) -> None:
        """Lost without seeing the key change: it may still stand on the lease."""
        if not self.lost.is_set() and self._shared and self._abandon is not None:
            self._abandon(self._etcd_key, self._token)
        self.lose(reason)

    def _watch_failed(self, error: LeaseError) -> None:
        # Without its watch a tenure cannot be vouched for within milliseconds.
        self._give_up(f"the key's watch failed: {error}")

    def _on_lease_lost(self, kept: KeptLease) -> None:
        self.lose(kept.lost_reason or "its lease was lost")
