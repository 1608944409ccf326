"""A blocking facade over the async core, for threaded programs (Celery, Django, scripts).

The same providers, ``hold`` and ``Election``, as plain calls and context managers::

    from etcd_leases.sync import EtcdLeaseProvider

    with EtcdLeaseProvider("127.0.0.1:2379") as provider:
        with provider.hold("job:42", me, 15_000) as lease:
            lease.check()

Each provider drives its async twin on one background event loop (an anyio blocking
portal), so it is safe to call from several threads at once. Code inside a ``hold``
runs in the caller's thread and cannot be cancelled: it watches ``lease.lost`` or
calls ``lease.check()``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import ExitStack, contextmanager
from types import TracebackType
from typing import Any, Self, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from etcd_leases import providers
from etcd_leases.contract import AcquireResult, HoldingProvider
from etcd_leases.election import Election as AsyncElection
from etcd_leases.errors import LeaseLost
from etcd_leases.hold import HeldLease, adopt, hold

T = TypeVar("T")


class SyncHeldLease:
    """A held lease seen from a thread: the same fields, blocking methods."""

    def __init__(self, portal: BlockingPortal, lease: HeldLease) -> None:
        self.key, self.owner, self.token, self.ttl_ms = (
            lease.key,
            lease.owner,
            lease.token,
            lease.ttl_ms,
        )
        self._portal = portal
        self._lease = lease
        #: Set the moment the tenure is over (mirrors the async event).
        self.lost = threading.Event()
        self._stop_mirroring: Callable[[], object]
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:  # a caller's thread
            self._stop_mirroring = portal.start_task_soon(self._mirror_loss).cancel
        else:  # the provider's own loop (Election.run's worker)
            self._stop_mirroring = loop.create_task(self._mirror_loss()).cancel

    async def _mirror_loss(self) -> None:
        await self._lease.lost.wait()
        self.lost.set()

    @property
    def lost_reason(self) -> str | None:
        return self._lease.lost_reason

    def remaining(self) -> float:
        """Seconds of guaranteed validity (see :meth:`HeldLease.remaining`)."""
        return self._lease.remaining()

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless the tenure is still guaranteed."""
        self._lease.check()

    def transfer(self, to_owner: str, ttl_ms: int | None = None) -> None:
        self._portal.call(self._lease.transfer, to_owner, ttl_ms)

    def put(self, data_key: str, value: str | bytes) -> bool:
        return self._portal.call(self._lease.put, data_key, value)

    def delete(self, data_key: str) -> bool:
        return self._portal.call(self._lease.delete, data_key)

    def __repr__(self) -> str:
        return f"<Sync{self._lease!r}>"


class SyncLeaseProvider:
    """Blocking calls to an async :class:`HoldingProvider` built on a private event loop."""

    def __init__(self, make: Callable[[], HoldingProvider]) -> None:
        self._exit: ExitStack | None = ExitStack()
        self._portal: BlockingPortal = self._exit.enter_context(start_blocking_portal("asyncio"))

        async def build() -> HoldingProvider:
            return make()  # inside the loop: gRPC channels belong to it

        self.aio: HoldingProvider = self._portal.call(build)

    @property
    def portal(self) -> BlockingPortal:
        return self._portal

    def run(self, coroutine: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run an async function of the provider's loop and wait for its result."""
        result: T = self._portal.call(coroutine)
        return result

    def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> AcquireResult:
        return self._portal.call(self.aio.acquire_lease, key, owner, ttl_ms)

    def get_lease_owner(self, key: str) -> str | None:
        return self._portal.call(self.aio.get_lease_owner, key)

    def release_lease(self, key: str, owner: str) -> None:
        self._portal.call(self.aio.release_lease, key, owner)

    def renew_lease(self, key: str, owner: str, ttl_ms: int) -> bool:
        return self._portal.call(self.aio.renew_lease, key, owner, ttl_ms)

    def transfer_lease(self, key: str, from_owner: str, to_owner: str, ttl_ms: int) -> bool:
        return self._portal.call(self.aio.transfer_lease, key, from_owner, to_owner, ttl_ms)

    def get_value(self, data_key: str) -> bytes | None:
        return self._portal.call(self.aio.get_value, data_key)

    @contextmanager
    def hold(
        self, key: str, owner: str, ttl_ms: int, *, wait: bool | float = False
    ) -> Iterator[SyncHeldLease]:
        """Blocking :func:`etcd_leases.hold`: acquire, keep alive, release at the end."""
        with self._portal.wrap_async_context_manager(
            hold(self.aio, key, owner, ttl_ms, wait=wait)
        ) as lease:
            yield from self._held(lease)

    @contextmanager
    def adopt(self, key: str, owner: str, ttl_ms: int) -> Iterator[SyncHeldLease]:
        """Blocking :func:`etcd_leases.adopt`."""
        with self._portal.wrap_async_context_manager(adopt(self.aio, key, owner, ttl_ms)) as lease:
            yield from self._held(lease)

    def _held(self, lease: HeldLease) -> Iterator[SyncHeldLease]:
        held = SyncHeldLease(self._portal, lease)
        try:
            yield held
        finally:
            held._stop_mirroring()

    def close(self) -> None:
        """Close the async provider and stop its loop; idempotent."""
        if self._exit is None:
            return
        close: Callable[[], Awaitable[None]] | None = getattr(self.aio, "close", None)
        try:
            if close is not None:
                self._portal.call(close)
        finally:
            exit_stack, self._exit = self._exit, None
            exit_stack.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class EtcdLeaseProvider(SyncLeaseProvider):
    """Blocking :class:`etcd_leases.EtcdLeaseProvider`; takes the same arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(lambda: providers.EtcdLeaseProvider(*args, **kwargs))

    @classmethod
    def from_env(cls, **overrides: Any) -> Self:
        provider = cls.__new__(cls)
        SyncLeaseProvider.__init__(
            provider, lambda: providers.EtcdLeaseProvider.from_env(**overrides)
        )
        return provider


class InMemoryLeaseProvider(SyncLeaseProvider):
    """Blocking :class:`etcd_leases.InMemoryLeaseProvider` (shared by the threads using it)."""

    def __init__(self) -> None:
        super().__init__(providers.InMemoryLeaseProvider)


class Election:
    """Blocking :class:`etcd_leases.Election` over a sync provider."""

    def __init__(self, provider: SyncLeaseProvider, name: str, candidate: str, ttl_ms: int) -> None:
        self._portal = provider.portal
        self._election = AsyncElection(provider.aio, name, candidate, ttl_ms)
        self._lease: SyncHeldLease | None = None
        self._stop = self._portal.call(self._new_event)

    @staticmethod
    async def _new_event() -> asyncio.Event:
        return asyncio.Event()

    @property
    def name(self) -> str:
        return self._election.name

    @property
    def candidate(self) -> str:
        return self._election.candidate

    def campaign(self, timeout: float | None = None) -> SyncHeldLease:
        """Block until leader (or ``timeout`` passes: :class:`LeaseHeld`)."""
        lease = self._portal.call(self._election.campaign, timeout)
        if self._lease is None or self._lease._lease is not lease:
            self._lease = SyncHeldLease(self._portal, lease)
        return self._lease

    def resign(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease._stop_mirroring()
        self._portal.call(self._election.resign)

    def leader(self) -> str | None:
        return self._portal.call(self._election.leader)

    def observe(self) -> Iterator[str | None]:
        """The leader now, then each change of leader (``None``: empty seat); blocking."""
        changes: queue.Queue[tuple[str | None, BaseException | None]] = queue.Queue()

        async def pump() -> None:
            try:
                async for leader in self._election.observe():
                    changes.put((leader, None))
            except Exception as exc:  # handed to the reading thread
                changes.put((None, exc))

        future = self._portal.start_task_soon(pump)
        try:
            while True:
                leader, error = changes.get()
                if error is not None:
                    raise error
                yield leader
        finally:
            future.cancel()

    @contextmanager
    def leadership(self, timeout: float | None = None) -> Iterator[SyncHeldLease]:
        """Campaign, run the block as leader, resign at the end.

        A thread cannot be cancelled: the block watches ``lease.lost`` or calls
        ``lease.check()``; if leadership was lost, leaving the block raises
        :class:`LeaseLost`.
        """
        lease = self.campaign(timeout)
        try:
            yield lease
        finally:
            lost = lease.remaining() <= 0  # the loop's own view, not the mirrored event
            self.resign()
        if lost:
            raise LeaseLost(
                f"{self.candidate!r} lost the leadership of {self.name!r}: {lease.lost_reason}"
            )

    def run(
        self,
        on_started_leading: Callable[[SyncHeldLease], None],
        on_stopped_leading: Callable[[], None] | None = None,
        on_new_leader: Callable[[str | None], None] | None = None,
    ) -> None:
        """Blocking :meth:`etcd_leases.Election.run`, until :meth:`stop` or the work returns.

        ``on_started_leading(lease)`` runs in a worker thread; when leadership is lost
        ``lease.lost`` is set and it should return. The next term starts only after it
        has returned, so two terms never overlap in this process.
        """

        async def lead(lease: HeldLease) -> None:
            held = SyncHeldLease(self._portal, lease)
            work = asyncio.get_running_loop().run_in_executor(None, on_started_leading, held)
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                await work  # never start another term while this one still runs
                raise
            finally:
                held._stop_mirroring()

        async def in_thread(callback: Callable[..., None] | None, *args: Any) -> None:
            if callback is not None:
                await asyncio.get_running_loop().run_in_executor(None, callback, *args)

        async def run() -> None:
            try:
                await self._election.run(
                    lead,
                    lambda: in_thread(on_stopped_leading),
                    lambda leader: in_thread(on_new_leader, leader),
                    stop=self._stop,
                )
            finally:
                # A stop() made before this run began ends it; once it has, the
                # next run starts afresh.
                self._stop.clear()

        self._portal.call(run)

    def stop(self) -> None:
        """Make :meth:`run` return after the current term (or campaign) ends.

        Called before :meth:`run` starts, it makes that run return at once.
        """
        self._portal.call(self._set_stop)

    async def _set_stop(self) -> None:
        self._stop.set()
