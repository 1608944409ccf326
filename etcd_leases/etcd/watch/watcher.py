"""A watcher: the changes of one key (or range) from a revision on, nothing lost or twice.

Watchers are plain objects, all served by one
:class:`~etcd_leases.etcd.watch.stream.WatchStream` per provider: no task per watcher.
Events are handed to a watcher's ``on_events`` callback, synchronously, or queued for
``async for``.

- **Nothing lost, nothing twice.** Each watcher keeps its resume point,
  ``next_revision`` (the revision after the last event it was given). When the
  stream breaks, it is reopened and every live watcher is created again from its
  resume point. Events below the resume point are dropped, so an event is never
  delivered twice.
- **History lost is said, not hidden.** When etcd has compacted the revisions a
  watcher still needs, the watcher receives an **empty batch** (``[]``): "history was
  lost, re-read the key". It then resumes from etcd's compaction revision, the oldest
  one still kept, so later events still arrive, each once. After a re-read at some
  revision R, events with ``kv.mod_revision <= R`` may still follow: compare revisions.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

from etcd_leases.errors import LeaseError, LeaseTypeError, LeaseValueError
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

if TYPE_CHECKING:
    from etcd_leases.etcd.watch.stream import WatchStream

__all__ = ["ErrorCallback", "EventsCallback", "Watcher", "check_watch_arguments"]

_log = logging.getLogger(__name__)

#: Called synchronously with each batch of a watcher's events (``[]``: re-read the key).
EventsCallback: TypeAlias = Callable[[list[pb.Event]], None]
#: Called once when a watcher ends with an error (closed stream, watch refused).
ErrorCallback: TypeAlias = Callable[[LeaseError], None]


class Watcher:
    """Changes of one exact key (or range), from a start revision on, in revision order.

    ``async for batch in watcher`` yields lists of ``pb.Event``; an empty list means
    etcd compacted history this watcher still needed: re-read the key. Iteration ends
    after :meth:`cancel`, and raises ``ProviderClosed`` after :meth:`WatchStream.close`
    (batches received before it are still yielded first).

    A watcher made with ``on_events`` hands every batch to that callback instead and
    queues nothing; iterating it only waits for its end.
    """

    def __init__(
        self,
        stream: WatchStream,
        key: bytes,
        start_revision: int,
        on_events: EventsCallback | None,
        on_error: ErrorCallback | None,
        range_end: bytes,
    ) -> None:
        self.key = key
        #: Watches every key in ``[key, range_end)`` when set, else ``key`` alone.
        self.range_end = range_end
        #: The first revision not yet delivered: where a re-created watch starts.
        #: 0 (only before etcd first registers a "from now" watch) means "current".
        self.next_revision = start_revision
        #: The id etcd gave this watch on the current stream, once registered.
        self.watch_id: int | None = None
        self._stream = stream
        self._on_events = on_events
        self._on_error = on_error
        self._queue: deque[list[pb.Event]] = deque()
        self._ready = asyncio.Event()
        self._ended = False
        self._error: LeaseError | None = None

    def __repr__(self) -> str:
        state = "ended" if self._ended else f"next_revision={self.next_revision}"
        return f"<Watcher {self.key!r} {state}>"

    @property
    def registered(self) -> bool:
        """True while etcd has confirmed this watch on the current stream."""
        return self.watch_id is not None

    @property
    def ended(self) -> bool:
        """True once the watcher was cancelled, closed or refused: no more events."""
        return self._ended

    @property
    def error(self) -> LeaseError | None:
        """Why the watcher ended, if not by :meth:`cancel`."""
        return self._error

    def cancel(self) -> None:
        """Stop watching (idempotent): no more callbacks; iteration ends at once."""
        if self._ended:
            return
        self._ended = True
        self._queue.clear()
        self._stream._forget(self)
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[list[pb.Event]]:
        return self

    async def __anext__(self) -> list[pb.Event]:
        while True:
            if self._queue:
                return self._queue.popleft()
            if self._ended:
                if self._error is not None:
                    # The same instance for every caller; drop the previous traceback.
                    raise self._error.with_traceback(None)
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()

    # Called by the stream.

    def _deliver(self, events: Sequence[pb.Event]) -> None:
        """Hand over the events at or after the resume point, and move it past them."""
        batch = [event for event in events if event.kv.mod_revision >= self.next_revision]
        if not batch:
            return
        self.next_revision = batch[-1].kv.mod_revision + 1
        self._emit(batch)

    def _compacted(self, compact_revision: int) -> None:
        """History before ``compact_revision`` is gone: tell the consumer to re-read."""
        self.next_revision = max(self.next_revision, compact_revision)
        self._emit([])

    def _progress(self, revision: int) -> None:
        """etcd says every event up to ``revision`` was sent.

        Keeps a quiet watcher's resume point from falling behind compaction. Moves it
        to ``revision`` itself, not past it, and never back: etcd's progress reports
        have had ordering bugs (etcd-io/etcd#15220, #20221), so trust them little.
        """
        self.next_revision = max(self.next_revision, revision)

    def _emit(self, batch: list[pb.Event]) -> None:
        if self._ended:
            return
        if self._on_events is None:
            self._queue.append(batch)
            self._ready.set()
            return
        try:
            self._on_events(batch)
        except Exception:
            # One consumer's bug must not break the stream the others share.
            _log.exception("on_events callback of %r raised", self)

    def _finish(self, error: LeaseError) -> None:
        """End the watcher with ``error``; queued batches are still yielded first."""
        if self._ended:
            return
        self._ended = True
        self._error = error
        self.watch_id = None
        self._ready.set()
        if self._on_error is not None:
            try:
                self._on_error(error)
            except Exception:
                _log.exception("on_error callback of %r raised", self)


def check_watch_arguments(key: bytes, start_revision: int) -> None:
    """Raise unless ``key`` is non-empty bytes and ``start_revision`` an int >= 0."""
    if not isinstance(key, bytes):
        raise LeaseTypeError(f"key must be bytes, not {type(key).__name__}")
    if not key:
        raise LeaseValueError("key must not be empty")
    if not isinstance(start_revision, int) or isinstance(start_revision, bool):
        raise LeaseTypeError(f"start_revision must be an int, not {type(start_revision).__name__}")
    if start_revision < 0:
        raise LeaseValueError(f"start_revision must be >= 0, got {start_revision}")
