"""One watch of every thread's abort key, shared by the runs of a provider.

A run waits for an abort of its own tenure (:meth:`AbortWatch.aborted`). A watch per
run would cost a watch create and cancel on the provider's stream for every run, and
creates are sent one at a time; one watch of the ``abort/`` prefix, created when the
first run waits and kept while the provider lives, serves them all:

- it starts at the first waiting run's token + 1: every abort of a later tenure is
  written after that revision, so the watch sees it. A run whose token is older than
  that start reads its abort key once as well;
- an abort that arrives before its run waits for it (written in the milliseconds
  between the run taking the thread and starting to wait) is remembered, for a while;
- after a compaction took history the watch needed, every abort key is read again.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from etcd_leases.errors import LeaseError
from etcd_leases.etcd.inbox_keys import InboxKeys
from etcd_leases.etcd.provider import EtcdBackend
from etcd_leases.etcd.txn import prefix_end
from etcd_leases.etcd.watch import Watcher
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

# Aborts seen with no run waiting for them yet, remembered at most (oldest forgotten).
_REMEMBERED = 4096


class AbortWatch:
    def __init__(self, backend: EtcdBackend, keys: InboxKeys) -> None:
        self._backend = backend
        self._keys = keys
        self._watcher: Watcher | None = None
        self._start = 0  # the revision the watch started at
        self._waiting: dict[tuple[str, int], asyncio.Future[None]] = {}
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._rereads: set[asyncio.Task[None]] = set()

    async def aborted(self, thread: str, token: int) -> None:
        """Return once an abort of ``thread``'s tenure ``token`` is recorded."""
        run = thread, token
        if self._watcher is None or self._watcher.ended:
            prefix = self._keys.all_aborts()
            self._start = token + 1
            self._watcher = self._backend._watches.watch(
                prefix,
                self._start,
                range_end=prefix_end(prefix),
                on_events=self._on_events,
                on_error=self._on_error,
            )
        if run in self._seen:
            del self._seen[run]
            return
        future = self._waiting[run] = asyncio.get_running_loop().create_future()
        try:
            if token + 1 < self._start:  # an abort before the watch's start: read it
                kv = await self._backend.client.range(self._keys.abort(thread))
                if kv is not None and kv.value == b"%d" % token:
                    return
            await future
        finally:
            del self._waiting[run]

    def _on_events(self, events: list[pb.Event]) -> None:
        if not events:  # history compacted: read every abort key again
            task = asyncio.get_running_loop().create_task(self._reread())
            self._rereads.add(task)
            task.add_done_callback(self._rereads.discard)
        for event in events:
            if event.type == pb.Event.PUT:
                self._record(event.kv)

    async def _reread(self) -> None:
        try:
            for kv in await self._backend.client.range_prefix(self._keys.all_aborts()):
                self._record(kv)
        except LeaseError as exc:
            self._on_error(exc)

    def _record(self, kv: pb.KeyValue) -> None:
        thread = self._keys.thread_of_abort(kv.key)
        if thread is None or not kv.value.isdigit():
            return
        run = thread, int(kv.value)
        future = self._waiting.get(run)
        if future is not None:
            if not future.done():
                future.set_result(None)
            return
        self._seen[run] = None
        while len(self._seen) > _REMEMBERED:
            self._seen.popitem(last=False)

    def _on_error(self, error: LeaseError) -> None:
        """The watch ended: its runs cannot be aborted; the next run watches anew."""
        self._watcher = None
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(error)
