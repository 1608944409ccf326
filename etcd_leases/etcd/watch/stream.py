"""One etcd ``Watch`` stream per provider, shared by every watcher (of a key or a range).

Held keys need to see within milliseconds that they were transferred or deleted
(all of a provider's through one watch over its prefix, :mod:`.held_keys`); waiters
and leader-election observers iterate over the changes of a key. Both go through
:class:`WatchStream`:

- **One bidirectional stream, one background task.** Watchers are plain objects:
  no task per watcher. Events are handed to a watcher's ``on_events`` callback,
  synchronously, or queued for ``async for``.
- **Creates are serialized.** etcd answers the creates of one stream in order but
  only says which watch id it assigned, so, like the Go client, we send one create
  at a time and map the id of each ``created`` answer to the watcher that asked.
- **Nothing lost, nothing twice; history lost is said** (see :mod:`.watcher`): a
  stream that breaks (a gRPC error, the server ending it, a member that loses its
  leader, is killed, or freezes, which gRPC keepalive notices; a create left
  unanswered) is reopened on the next endpoint with exponential backoff (50 ms .. 1 s)
  and every live watcher is created again from its resume point.

The task starts with the first watcher and stops after ``idle_timeout`` seconds
without any. No gRPC error escapes: a watcher only ever ends by
:meth:`Watcher.cancel`, with ``ProviderClosed`` (:meth:`WatchStream.close`, or the
client closed under it), or with another :class:`LeaseError` when etcd refuses to
watch its key (``PermissionDenied``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import TypeAlias

import grpc
import grpc.aio

from etcd_leases.errors import (
    BackendError,
    LeaseError,
    PermissionDenied,
    ProviderClosed,
)
from etcd_leases.etcd.backoff import Backoff
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.rpc_errors import to_lease_error
from etcd_leases.etcd.watch.refusals import Refusals, is_auth_refusal
from etcd_leases.etcd.watch.watcher import (
    ErrorCallback,
    EventsCallback,
    Watcher,
    check_watch_arguments,
)
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

__all__ = ["WatchStream"]

_log = logging.getLogger(__name__)

_WatchCall: TypeAlias = grpc.aio.StreamStreamCall[pb.WatchRequest, pb.WatchResponse]

_HEALTHY_S = 2.0  # a stream that lived this long restarts the backoff when it breaks
# A frozen member keeps the TCP connection open and answers nothing, and a holder's
# key may then change unseen: while watchers are active, ask for progress when the
# stream has been quiet this long, and give the stream up if nothing answers in time.
_PROBE_AFTER_S = 1.0
_PROBE_PATIENCE_S = 2.0  # counted from the request


class _StreamBroken(Exception):
    """The stream can no longer be trusted; reopen it elsewhere and re-create watchers."""


class WatchStream:
    """One ``Watch`` stream multiplexing every watcher of a provider; see the module doc."""

    def __init__(self, client: EtcdClient, *, idle_timeout: float = 10.0) -> None:
        self._client = client
        self._idle_timeout = idle_timeout
        # Waiting for a create on the current stream, in the order they will be sent.
        self._pending: dict[Watcher, None] = {}
        # The one create sent whose ``created`` answer has not come yet.
        self._creating: Watcher | None = None
        self._active: dict[int, Watcher] = {}
        self._cancels: deque[int] = deque()
        self._work = asyncio.Event()  # the sender has something to send
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._create_deadline = 0.0  # when the create in flight counts as unanswered
        self._heard_at = 0.0  # loop time of the last answer on the current stream
        self._probed_at = 0.0  # loop time of the last progress request sent
        self._endpoint = 0  # the client's endpoint the current stream is on
        self._refusals = Refusals(client)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def running(self) -> bool:
        """True while the background task (and so, mostly, a stream) is up."""
        return self._task is not None

    def watch(
        self,
        key: bytes,
        start_revision: int,
        *,
        on_events: EventsCallback | None = None,
        on_error: ErrorCallback | None = None,
        range_end: bytes = b"",
    ) -> Watcher:
        """Watch ``key`` from ``start_revision`` on (e.g. a read's revision + 1).

        Registration happens in the background, but events are addressed by revision,
        so none from ``start_revision`` on is missed however late it completes.
        ``start_revision=0`` means "from whenever etcd registers the watch", which can
        miss a change made before that: prefer a revision. ``on_events`` is called
        synchronously with each batch (then nothing is queued for iteration);
        ``on_error`` once if the watcher ends with an error. ``range_end`` watches
        every key in ``[key, range_end)`` (events still come in revision order). Must be
        called from the event loop the stream runs on.
        """
        if self._closed:
            raise ProviderClosed("the watch stream is closed")
        self._client.check_open()
        check_watch_arguments(key, start_revision)
        loop = asyncio.get_running_loop()  # before any bookkeeping: raises outside a loop
        watcher = Watcher(self, key, start_revision, on_events, on_error, range_end)
        self._pending[watcher] = None
        self._work.set()
        if self._task is None:
            self._task = loop.create_task(self._run(), name="etcd-leases watch stream")
            self._task.add_done_callback(_log_unexpected_end)
        return watcher

    async def close(self) -> None:
        """End every watcher with ``ProviderClosed`` and stop the stream; idempotent."""
        self._closed = True
        # Watchers first, synchronously: they end even if this call is cancelled.
        self._end_all(ProviderClosed("the watch stream is closed"))
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait((task,))

    # Bookkeeping shared by the API and the stream task.

    def _live(self) -> bool:
        # Never asked while a create is in flight: the sender waits for its answer
        # first, and a session's end moves it back to the pending ones.
        return bool(self._pending or self._active)

    def _forget(self, watcher: Watcher) -> None:
        """``watcher`` was cancelled: drop it, and cancel its watch on etcd's side."""
        self._pending.pop(watcher, None)
        watch_id, watcher.watch_id = watcher.watch_id, None
        if watch_id is not None and self._active.get(watch_id) is watcher:
            del self._active[watch_id]
            self._cancels.append(watch_id)
        # A watcher whose create is in flight is cancelled when its id comes back.
        self._work.set()

    def _requeue(self) -> None:
        """The stream is gone: every live watcher needs a create on the next one."""
        watchers: list[Watcher] = []
        if self._creating is not None and not self._creating.ended:
            watchers.append(self._creating)
        watchers.extend(self._active.values())
        watchers.extend(self._pending)
        for watcher in watchers:
            watcher.watch_id = None
        self._pending = dict.fromkeys(watchers)
        self._creating = None
        self._active.clear()
        self._cancels.clear()

    def _end_all(self, error: LeaseError) -> None:
        self._requeue()
        watchers, self._pending = list(self._pending), {}
        for watcher in watchers:
            watcher._finish(error)

    # The stream task.

    async def _run(self) -> None:
        """Keep a stream open while watchers live; reopen it elsewhere when it breaks."""
        backoff = Backoff()  # 50 ms .. 1 s
        try:
            while not self._closed:
                if self._refusals:
                    for refused in await self._refusals.check():
                        self._pending.pop(refused, None)
                    if not self._live():
                        return  # every watcher left was refused for good
                opened = asyncio.get_running_loop().time()
                try:
                    await self._session()
                except asyncio.CancelledError as exc:
                    # gRPC cancels our calls when the client's channels are closed.
                    closed = self._client.closed_under(exc)
                    if closed is None:
                        raise
                    self._end_all(closed)
                    return
                except Exception as exc:
                    if self._closed:
                        return
                    fatal = self._fatal(exc)
                    if fatal is not None:
                        self._end_all(fatal)
                        return
                    self._requeue()
                    if asyncio.get_running_loop().time() - opened >= _HEALTHY_S:
                        # It served a while: a fresh failure, not the same one again
                        # (a member that keeps refusing, a message we cannot take).
                        backoff.reset()
                    wait = backoff.failed()
                    _log.info(
                        "etcd watch stream broke (%s); reopening in %.2f s", _describe(exc), wait
                    )
                    self._client.members.failed(self._endpoint)
                    await asyncio.sleep(wait)
                    continue
                # The session ended because nobody watched for a while; a watcher
                # may have come while it was shutting down.
                self._requeue()
                if not self._live():
                    return
        except Exception as exc:
            # A bug of ours: end the watchers rather than leave them waiting forever.
            _log.exception("etcd watch stream failed")
            self._end_all(BackendError(f"the watch stream failed: {exc!r}"))
        finally:
            if self._task is asyncio.current_task():
                self._task = None

    def _fatal(self, exc: Exception) -> LeaseError | None:
        """The error that ends every watcher, or ``None`` to reopen the stream."""
        if self._client.closed:
            return ProviderClosed("the provider is closed")
        if isinstance(exc, grpc.aio.AioRpcError):
            error: Exception = to_lease_error(exc)
        else:
            error = exc
        # Wrong credentials do not get better by retrying; anything else might.
        return error if isinstance(error, PermissionDenied) else None

    async def _session(self) -> None:
        """One stream: returns when idle, raises when it broke."""
        self._endpoint = self._client.members.preferred()
        # A member frozen before our login answers costs a create's share, no more.
        login_timeout = self._create_timeout()
        metadata = await self._client.auth.metadata(self._endpoint, login_timeout=login_timeout)
        call = self._client.watch_stream(metadata, self._endpoint)
        self._heard_at = asyncio.get_running_loop().time()  # a new stream starts trusted
        sender = asyncio.create_task(self._send_loop(call))
        receiver = asyncio.create_task(self._receive_loop(call))
        try:
            done, _ = await asyncio.wait((sender, receiver), return_when=asyncio.FIRST_COMPLETED)
        finally:
            call.cancel()
            sender.cancel()
            receiver.cancel()
            await asyncio.wait((sender, receiver))
            # Retrieve both outcomes so none is reported as never retrieved.
            for task in (sender, receiver):
                if not task.cancelled():
                    task.exception()
        for task in (receiver, sender):
            if task not in done:
                continue
            if task.cancelled():
                # Nobody but gRPC cancels these tasks here: it does so to the call's
                # readers and writers when the client's channel is closed.
                if self._client.closed:
                    raise ProviderClosed("the provider is closed")
                raise _StreamBroken("gRPC cancelled the watch call")
            if (error := task.exception()) is not None:
                raise error
        if receiver in done:
            raise _StreamBroken("etcd ended the watch stream")
        # The sender returned: nobody watched for idle_timeout seconds.

    async def _send_loop(self, call: _WatchCall) -> None:
        """The only writer: cancels, then creates one at a time; returns when idle."""
        while True:
            self._work.clear()
            while self._cancels:
                request = pb.WatchCancelRequest(watch_id=self._cancels.popleft())
                await call.write(pb.WatchRequest(cancel_request=request))
            if self._creating is None and self._pending:
                watcher = next(iter(self._pending))
                del self._pending[watcher]
                self._creating = watcher
                create = pb.WatchCreateRequest(
                    key=watcher.key,
                    range_end=watcher.range_end,
                    start_revision=watcher.next_revision,
                    # Lets a quiet watcher's resume point follow the store (see _progress).
                    progress_notify=True,
                )
                loop = asyncio.get_running_loop()
                self._create_deadline = loop.time() + self._create_timeout()
                await call.write(pb.WatchRequest(create_request=create))
                continue
            if self._creating is not None:
                # A member that froze before answering (or a connection that never
                # came up, which keepalive does not cover) must not stall every create.
                if asyncio.get_running_loop().time() >= self._create_deadline:
                    raise _StreamBroken("etcd did not confirm a watch in time")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(self._create_deadline):
                        await self._work.wait()
                continue
            if self._live():
                await self._probe(call)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._idle_timeout):
                    await self._work.wait()
            if not self._live():
                return

    async def _probe(self, call: _WatchCall) -> None:
        """Wait for work; meanwhile check that a quiet stream still answers.

        Any answer proves the stream alive; a progress request draws one (etcd 3.4+,
        with watch_id -1, which matches no watcher and moves no resume point).
        """
        now = asyncio.get_running_loop().time()
        if self._probed_at > self._heard_at:  # a probe is out, unanswered
            wake_at = self._probed_at + _PROBE_PATIENCE_S
            if now >= wake_at:
                raise _StreamBroken("etcd stopped answering the watch stream")
        elif now - self._heard_at >= _PROBE_AFTER_S:
            # Its patience counts from here, however soon the last answer came.
            self._probed_at = now
            await call.write(pb.WatchRequest(progress_request=pb.WatchProgressRequest()))
            wake_at = now + _PROBE_PATIENCE_S
        else:
            wake_at = self._heard_at + _PROBE_AFTER_S
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(wake_at):
                await self._work.wait()

    def _create_timeout(self) -> float:
        """How long a create may go unanswered: the client's share per member."""
        members = len(self._client.endpoints)
        if members == 1:
            return self._client.timeout
        return max(self._client.timeout / members, 0.5)

    async def _receive_loop(self, call: _WatchCall) -> None:
        """Dispatch every response; returns at end of stream."""
        while True:
            response = await call.read()
            if not isinstance(response, pb.WatchResponse):
                return  # grpc.aio.EOF: etcd ended the stream
            self._heard_at = asyncio.get_running_loop().time()
            self._dispatch(response)

    def _dispatch(self, response: pb.WatchResponse) -> None:
        if response.created:
            self._on_created(response)
            return
        watcher = self._active.get(response.watch_id)
        if watcher is None:
            return  # cancelled by us; late answers are dropped
        if response.events:
            watcher._deliver(response.events)
        if response.compact_revision > 0:
            # etcd dropped this watch: its start revision is older than what it keeps.
            del self._active[response.watch_id]
            watcher.watch_id = None
            watcher._compacted(response.compact_revision)
            if not watcher.ended:
                self._pending[watcher] = None
                self._work.set()
        elif response.canceled:
            # Not asked for and not a compaction: re-create everything, with backoff.
            raise _StreamBroken(f"etcd cancelled a watch: {response.cancel_reason!r}")
        elif not response.events:
            watcher._progress(response.header.revision)

    def _on_created(self, response: pb.WatchResponse) -> None:
        watcher, self._creating = self._creating, None
        self._work.set()  # the next create may go
        if watcher is None:
            raise _StreamBroken("etcd confirmed a watch that was not asked for")
        if response.canceled:
            if response.compact_revision > 0:
                watcher._compacted(response.compact_revision)
                if not watcher.ended:
                    self._pending[watcher] = None
            elif not watcher.ended:
                self._refused(watcher, response.cancel_reason)
            return
        self._refusals.accepted(watcher)
        if watcher.ended:
            self._cancels.append(response.watch_id)  # cancelled while being created
            return
        if watcher.next_revision == 0:
            # etcd starts a "from now" watch right after the revision in this header.
            watcher.next_revision = response.header.revision + 1
        watcher.watch_id = response.watch_id
        self._active[response.watch_id] = watcher
        if response.events:
            watcher._deliver(response.events)

    def _refused(self, watcher: Watcher, reason: str) -> None:
        """etcd would not create the watch: check why on a fresh stream, or end the watcher."""
        if not is_auth_refusal(reason):
            watcher._finish(BackendError(f"etcd: cannot watch {watcher.key!r}: {reason}"))
            return
        self._refusals.add(watcher)
        self._pending[watcher] = None
        raise _StreamBroken(f"etcd refused a watch: {reason!r}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return str(to_lease_error(exc))
    return f"{type(exc).__name__}: {exc}"


def _log_unexpected_end(task: asyncio.Task[None]) -> None:
    """Retrieve the task's outcome; ``_run`` handles its own errors, so this is a bug."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        _log.error("etcd watch stream task ended with %r", exc)
