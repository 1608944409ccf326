"""One watch over the provider's key prefix, shared by every key the process holds.

A held key must see within milliseconds that anyone released, transferred or deleted
it. A watch per key cost etcd a watcher and the stream a create per key, sent one at
a time: 10,000 keys took seconds to be covered, and 100,000 far longer. Instead one
range watch over the prefix serves them all, and each event is routed to the
tenures of its key by a dict lookup. A watch per key kept these guarantees, and so
does this:

- **Every change from a tenure's start is seen.** A tenure registers with ``start``,
  the first revision it watches (its put's revision + 1): any event of its key at or
  after ``start`` ends it. The shared watch resumes where it was after a stream
  break (see :mod:`.watcher`), so no event is skipped.
- **A tenure that registers late looks back.** The shared watch may have gone past
  ``start`` already: the latest change of every key it saw over the last
  ``_GENERATION_S`` seconds (at least) is remembered and looked up. A tenure older
  than that, or than the watch itself, re-reads its key.
- **History lost is re-read.** When etcd compacted revisions the shared watch still
  needed, it resumes at the compaction revision, and every key it covers is read
  again, in one paginated range read: a key gone, or changed at or after its
  tenure's ``start``, ends that tenure.

The price: the process receives the changes of every key under the prefix, other
processes' keys too (each a dict lookup, then dropped). The watch is cancelled when
the last tenure ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from etcd_leases.errors import LeaseError
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.tasks import BackgroundTasks
from etcd_leases.etcd.txn import prefix_end
from etcd_leases.etcd.watch.stream import WatchStream
from etcd_leases.etcd.watch.watcher import ErrorCallback, Watcher
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

__all__ = ["ChangeCallback", "HeldKey", "HeldKeysWatch"]

_log = logging.getLogger(__name__)

#: Called once, with why, when a held key changed after its tenure's start.
ChangeCallback = Callable[[str], None]
# A key's latest change seen: its revision, and its new value (None: deleted).
_Change = tuple[int, bytes | None]

_GENERATION_S = 10.0  # how long, at least, a key's latest change is remembered
_PAGE = 10_000  # keys per read when history was lost


def _describe(change: _Change) -> str:
    if change[1] is None:
        return "the key was released, deleted or expired"
    return f"the key was handed to {change[1].decode('utf-8', errors='replace')!r}"


class HeldKey:
    """One tenure's registration: reports the first change of its key, then ends."""

    __slots__ = ("_on_changed", "_on_error", "_watch", "ended", "key", "start")

    def __init__(
        self,
        watch: HeldKeysWatch,
        key: bytes,
        start: int,
        on_changed: ChangeCallback,
        on_error: ErrorCallback,
    ) -> None:
        self.key = key
        #: The first revision watched: a change of the key at or after it ends the tenure.
        self.start = start
        self.ended = False
        self._watch = watch
        self._on_changed = on_changed
        self._on_error = on_error

    def __repr__(self) -> str:
        return f"<HeldKey {self.key!r} from {self.start}{' ended' if self.ended else ''}>"

    def cancel(self) -> None:
        """Stop watching (idempotent): no more callbacks."""
        if not self.ended:
            self.ended = True
            self._watch._forget(self)

    def _changed(self, reason: str) -> None:
        if self.ended:
            return
        self.cancel()
        try:
            self._on_changed(reason)
        except Exception:
            _log.exception("on_changed callback of %r raised", self)

    def _failed(self, error: LeaseError) -> None:
        if self.ended:
            return
        self.cancel()
        try:
            self._on_error(error)
        except Exception:
            _log.exception("on_error callback of %r raised", self)


class HeldKeysWatch:
    """The one watch over ``prefix`` that reports changes of held keys; see the module doc."""

    def __init__(self, watches: WatchStream, client: EtcdClient, prefix: bytes) -> None:
        self._watches = watches
        self._client = client
        # An empty prefix covers every key: [b"\0", b"\0") is etcd's "from \0 on".
        self._range = (prefix, prefix_end(prefix)) if prefix else (b"\0", b"\0")
        # The tenures of each key: one (so no container per key, as a rule) or a list.
        self._held: dict[bytes, HeldKey | list[HeldKey]] = {}
        self._watcher: Watcher | None = None
        # The latest change of each key seen, in two generations: ``_recent`` holds
        # every event from ``_recent_from`` on, the two together from ``_known_from``.
        self._recent: dict[bytes, _Change] = {}
        self._older: dict[bytes, _Change] = {}
        self._recent_from = 0
        self._known_from = 0
        self._rotate_at = 0.0
        self._rereads = BackgroundTasks()

    def __len__(self) -> int:
        """How many keys are watched."""
        return len(self._held)

    def watch(
        self, key: bytes, start: int, on_changed: ChangeCallback, on_error: ErrorCallback
    ) -> HeldKey:
        """Report the first change of ``key`` at or after revision ``start``.

        ``on_changed(reason)`` is called once, from the event loop, if the key changes
        (never from within this call); ``on_error`` if that can no longer be known
        (the stream closed, the watch refused, a re-read failed). Raises
        ``ProviderClosed`` if the watch stream is closed.
        """
        held = HeldKey(self, key, start, on_changed, on_error)
        watcher = self._watcher
        if watcher is None or watcher.ended:
            # Raises if the stream is closed, before anything is registered.
            self._watcher = self._watches.watch(
                self._range[0],
                start,
                on_events=self._on_events,
                on_error=self._on_error,
                range_end=self._range[1],
            )
            self._forget_changes(start)
        tenures = self._held.get(key)
        if tenures is None:
            self._held[key] = held
        elif isinstance(tenures, list):
            tenures.append(held)
        else:
            self._held[key] = [tenures, held]
        if watcher is None or watcher.ended or start >= watcher.next_revision:
            return held  # every event from ``start`` on is still to come
        if start >= self._known_from:
            change = self._recent.get(key) or self._older.get(key)
            if change is not None and change[0] >= start:
                asyncio.get_running_loop().call_soon(held._changed, _describe(change))
            return held
        self._rereads.start(self._reread_key(held))
        return held

    def _forget(self, held: HeldKey) -> None:
        tenures = self._held.get(held.key)
        if tenures is held:
            del self._held[held.key]
        elif isinstance(tenures, list) and held in tenures:
            tenures.remove(held)
            if len(tenures) == 1:
                self._held[held.key] = tenures[0]
        if not self._held and self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def _every_tenure(self) -> list[HeldKey]:
        every: list[HeldKey] = []
        for tenures in self._held.values():
            if isinstance(tenures, list):
                every.extend(tenures)
            else:
                every.append(tenures)
        return every

    def _forget_changes(self, known_from: int) -> None:
        """Events from ``known_from`` on are still to come: nothing before is known."""
        self._recent, self._older = {}, {}
        self._recent_from = self._known_from = known_from
        self._rotate_at = asyncio.get_running_loop().time() + _GENERATION_S

    def _on_events(self, events: list[pb.Event]) -> None:
        if not events:
            self._history_lost()
            return
        now = asyncio.get_running_loop().time()
        if now >= self._rotate_at:
            # The older generation goes; what is known now starts where recent did.
            self._older, self._recent = self._recent, {}
            self._known_from, self._recent_from = self._recent_from, events[0].kv.mod_revision
            self._rotate_at = now + _GENERATION_S
        recent, held = self._recent, self._held
        for event in events:
            kv = event.kv
            change = (kv.mod_revision, None if event.type == pb.Event.DELETE else kv.value)
            recent[kv.key] = change
            tenures = held.get(kv.key)
            if tenures is None:
                continue
            for tenure in list(tenures) if isinstance(tenures, list) else (tenures,):
                if kv.mod_revision >= tenure.start:
                    tenure._changed(_describe(change))

    def _on_error(self, error: LeaseError) -> None:
        """The shared watch ended (closed, refused): no held key can be vouched for."""
        self._watcher = None
        tenures = self._every_tenure()
        self._held.clear()
        for tenure in tenures:
            tenure._failed(error)

    def _history_lost(self) -> None:
        """etcd compacted what the watch still needed: re-read every key it covers."""
        assert self._watcher is not None
        # The watch resumes at etcd's compaction revision: changes before are unknown.
        self._forget_changes(self._watcher.next_revision)
        tenures = self._every_tenure()
        self._rereads.start(self._reread_all(tenures))

    async def _reread_key(self, held: HeldKey) -> None:
        """A tenure registered after history the watch no longer remembers: read its key."""
        try:
            kv = await self._client.range(held.key)
        except LeaseError as exc:
            held._failed(exc)
            return
        if kv is None or kv.mod_revision >= held.start:
            held._changed("the key changed before its watch covered it")

    async def _reread_all(self, tenures: list[HeldKey]) -> None:
        try:
            current = await self._read_range()
        except LeaseError as exc:
            for tenure in tenures:
                tenure._failed(exc)
            return
        for tenure in tenures:
            revision = current.get(tenure.key)
            if revision is None or revision >= tenure.start:
                tenure._changed("the key changed while its watch history was compacted")

    async def _read_range(self) -> dict[bytes, int]:
        """The mod_revision of every key the watch covers, read at one revision."""
        revisions: dict[bytes, int] = {}
        key, range_end = self._range
        at = 0  # the first page sets the revision every later page reads at
        while True:
            request = pb.RangeRequest(
                key=key, range_end=range_end, limit=_PAGE, keys_only=True, revision=at
            )
            response = await self._client.call("/etcdserverpb.KV/Range", request, pb.RangeResponse)
            at = at or response.header.revision
            for kv in response.kvs:
                revisions[kv.key] = kv.mod_revision
            if not response.more or not response.kvs:
                return revisions
            key = response.kvs[-1].key + b"\0"
