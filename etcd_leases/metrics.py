"""Prometheus metrics for any lease provider, by wrapping it (``pip install '.[metrics]'``).

``MeteredProvider(provider)`` is the provider, counted: it implements the same
calls (and the recipes' :class:`HoldingProvider` capabilities) by delegating, so
``hold``, ``adopt`` and :class:`Election` work on it unchanged::

    metered = MeteredProvider(EtcdLeaseProvider.from_env())
    prometheus_client.start_http_server(9100)
    async with metered.hold("job:42", me, 15_000) as lease: ...

Metrics (all prefixed ``etcd_leases_``):

- ``calls_total{call, outcome}``: every call; outcome ``ok``, ``acquired`` / ``held``,
  ``true`` / ``false``, or the error's class name (``BackendUnavailable``...);
- ``call_duration_seconds{call}``: latency histogram;
- ``leases_held``: tenures kept alive in the background now (``hold``, ``adopt``);
- ``leases_lost_total``: tenures that ended without their holder ending them
  (expired, taken, deleted, handed on by someone else);
- ``renewals_failed_total``: of those, the ones whose TTL ran out with no renewal
  answered (etcd unreachable, process stalled);
- ``leader{election}``: 1 while this process leads the election, else 0, as
  client-go's ``leader_election_master_status`` (set with :meth:`LeaseMetrics.set_leading`);
- ``build_info{version}``: always 1; the library's version in its label;
- ``etcd_reachable``: 1 while etcd answers, 0 from the moment a call or check found it
  unreachable (set by every call, keep-alive answer and :meth:`MeteredProvider.etcd_answers`);
- ``keepalive_round_trip_seconds``: histogram of keep-alive round trips (request sent to
  answer read), on an :class:`EtcdLeaseProvider`.

prometheus_client also exports a ``_created`` series beside every counter and
histogram by default; call ``prometheus_client.disable_created_metrics()`` once at
start-up to leave them out (``etcd-leases run`` / ``elect`` do).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from types import TracebackType
from typing import Any, Self, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from etcd_leases import __version__
from etcd_leases.contract import AcquireResult, HoldingProvider, Keeper, OwnerState
from etcd_leases.errors import BackendError, BackendUnavailable, LeaseError, PermissionDenied
from etcd_leases.etcd.kept_lease import DEADLINE_PASSED
from etcd_leases.hold import Holding

T = TypeVar("T")

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LeaseMetrics:
    """The metrics, registered once per registry (``REGISTRY`` by default)."""

    _default: LeaseMetrics | None = None

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.calls = Counter(
            "etcd_leases_calls",
            "Lease calls by kind and outcome",
            ["call", "outcome"],
            registry=registry,
        )
        self.call_duration = Histogram(
            "etcd_leases_call_duration_seconds",
            "Lease call latency",
            ["call"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.leases_held = Gauge(
            "etcd_leases_leases_held", "Tenures kept alive now", registry=registry
        )
        self.leases_lost = Counter(
            "etcd_leases_leases_lost",
            "Tenures that ended without their holder ending them",
            registry=registry,
        )
        self.renewals_failed = Counter(
            "etcd_leases_renewals_failed",
            "Tenures lost because no renewal was answered before their TTL ran out",
            registry=registry,
        )
        self.leader = Gauge(
            "etcd_leases_leader",
            "1 while this process leads the election, else 0",
            ["election"],
            registry=registry,
        )
        self.build_info = Gauge(
            "etcd_leases_build_info",
            "Always 1; the etcd-leases version in its label",
            ["version"],
            registry=registry,
        )
        self.build_info.labels(version=__version__).set(1)
        self.etcd_reachable = Gauge(
            "etcd_leases_etcd_reachable",
            "1 while etcd answers, 0 since a call or check found it unreachable",
            registry=registry,
        )
        self.keepalive_round_trip = Histogram(
            "etcd_leases_keepalive_round_trip_seconds",
            "Keep-alive round trips, from request sent to answer read",
            buckets=_BUCKETS,
            registry=registry,
        )

    @classmethod
    def default(cls) -> LeaseMetrics:
        """The metrics on the default registry (created on first use)."""
        if cls._default is None:
            cls._default = cls()
        return cls._default

    def set_leading(self, election: str, leading: bool) -> None:
        """Record whether this process leads ``election`` (from Election.run's callbacks)."""
        self.leader.labels(election=election).set(1 if leading else 0)

    def keepalive_answered(self, round_trip_s: float) -> None:
        """A keep-alive was answered after ``round_trip_s``: etcd is reachable."""
        self.keepalive_round_trip.observe(round_trip_s)
        self.etcd_reachable.set(1)


class MeteredKeeper:
    """A kept tenure, counted in ``leases_held`` until it ends, and as lost if not by us."""

    def __init__(
        self,
        inner: Keeper,
        metrics: LeaseMetrics,
        on_end: Callable[[MeteredKeeper], object],
    ) -> None:
        self._inner = inner
        self._metrics = metrics
        self._on_end = on_end
        self._ended = False
        #: Set while its holder releases or hands it on: that ending is no loss.
        self.ending_by_holder = False
        metrics.leases_held.inc()
        self._watch = asyncio.get_running_loop().create_task(self._count_loss())

    @property
    def lost(self) -> asyncio.Event:
        return self._inner.lost

    @property
    def lost_reason(self) -> str | None:
        return self._inner.lost_reason

    def remaining(self) -> float:
        return self._inner.remaining()

    def lose(self, reason: str) -> None:
        # The recipes call this when the holder ends the tenure (release, transfer).
        self.ending_by_holder = True
        self.end()
        self._inner.lose(reason)

    def end(self) -> None:
        """Count the end of the tenure, once: a loss unless its holder ended it."""
        if self._ended:
            return
        self._ended = True
        self._on_end(self)
        self._metrics.leases_held.dec()
        if not self.ending_by_holder:
            self._metrics.leases_lost.inc()
            if self._inner.lost_reason == DEADLINE_PASSED:
                self._metrics.renewals_failed.inc()

    async def _count_loss(self) -> None:
        try:
            await self._inner.lost.wait()
        except asyncio.CancelledError:
            # The event loop is ending, and the tenure with it.
            self.ending_by_holder = True
            raise
        finally:
            self.end()


def _outcome(result: object) -> str:
    if isinstance(result, tuple) and result and isinstance(result[0], AcquireResult):
        result = result[0]
    if isinstance(result, AcquireResult):
        return "acquired" if result.acquired else "held"
    if isinstance(result, bool):
        return "true" if result else "false"
    return "ok"


class MeteredProvider(Holding):
    """``provider``, its calls counted and timed in ``metrics`` (see the module doc)."""

    def __init__(self, provider: HoldingProvider, metrics: LeaseMetrics | None = None) -> None:
        self.provider = provider
        self.metrics = metrics or LeaseMetrics.default()
        # The tenures kept through us, so a release or transfer by their holder,
        # which the backend may report as a loss first, is not counted as one.
        self._kept: dict[tuple[str, str], MeteredKeeper] = {}
        # An EtcdLeaseProvider's client reports its keep-alives' round trips.
        observers = getattr(getattr(provider, "client", None), "keepalive_observers", None)
        if isinstance(observers, list):
            observers.append(self.metrics.keepalive_answered)

    async def etcd_answers(self, key: str, timeout: float) -> bool:
        """Whether etcd answers a read of ``key`` within ``timeout`` seconds (a
        linearizable read on etcd: a quorum answered); sets ``etcd_reachable``."""
        try:
            async with asyncio.timeout(timeout):
                await self.provider.get_lease_owner(key)
        except (TimeoutError, BackendUnavailable):
            self.metrics.etcd_reachable.set(0)
            return False
        except LeaseError:  # answered, with a refusal (permission denied...)
            pass
        self.metrics.etcd_reachable.set(1)
        return True

    async def _measure(self, call: str, awaitable: Awaitable[T]) -> T:
        started = time.perf_counter()
        outcome = "ok"
        try:
            result = await awaitable
            outcome = _outcome(result)
            self.metrics.etcd_reachable.set(1)
            return result
        except BaseException as exc:
            outcome = type(exc).__name__
            if isinstance(exc, BackendUnavailable):
                self.metrics.etcd_reachable.set(0)
            elif isinstance(exc, BackendError | PermissionDenied):  # answered: full, refused
                self.metrics.etcd_reachable.set(1)
            raise
        finally:
            self.metrics.calls.labels(call=call, outcome=outcome).inc()
            self.metrics.call_duration.labels(call=call).observe(time.perf_counter() - started)

    async def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> AcquireResult:
        return await self._measure("acquire", self.provider.acquire_lease(key, owner, ttl_ms))

    async def get_lease_owner(self, key: str) -> str | None:
        return await self._measure("get_owner", self.provider.get_lease_owner(key))

    async def release_lease(self, key: str, owner: str) -> None:
        if (kept := self._kept.get((key, owner))) is not None:
            kept.ending_by_holder = True
        await self._measure("release", self.provider.release_lease(key, owner))

    async def renew_lease(self, key: str, owner: str, ttl_ms: int) -> bool:
        return await self._measure("renew", self.provider.renew_lease(key, owner, ttl_ms))

    async def transfer_lease(self, key: str, from_owner: str, to_owner: str, ttl_ms: int) -> bool:
        kept = self._kept.get((key, from_owner))
        if kept is not None:
            kept.ending_by_holder = True
        moved = await self._measure(
            "transfer", self.provider.transfer_lease(key, from_owner, to_owner, ttl_ms)
        )
        if kept is not None and not moved:
            kept.ending_by_holder = False  # it was lost before: a loss after all
            kept.end()  # counted now: hold's lose() that follows would say "by its holder"
        return moved

    def watch_owner(self, key: str) -> AsyncGenerator[OwnerState, None]:
        return self.provider.watch_owner(key)

    async def acquire_kept(
        self, key: str, owner: str, ttl_ms: int
    ) -> tuple[AcquireResult, MeteredKeeper | None]:
        result, keeper = await self._measure(
            "acquire", self.provider.acquire_kept(key, owner, ttl_ms)
        )
        return result, None if keeper is None else self._metered(key, owner, keeper)

    async def keep_lease(
        self, key: str, owner: str, token: int, ttl_ms: int, valid_until: float
    ) -> MeteredKeeper:
        keeper = await self._measure(
            "keep", self.provider.keep_lease(key, owner, token, ttl_ms, valid_until)
        )
        return self._metered(key, owner, keeper)

    def _metered(self, key: str, owner: str, keeper: Keeper) -> MeteredKeeper:
        def forget(ended: MeteredKeeper) -> None:
            if self._kept.get((key, owner)) is ended:  # not a later tenure of the same pair
                del self._kept[(key, owner)]

        kept = MeteredKeeper(keeper, self.metrics, forget)
        self._kept[(key, owner)] = kept
        return kept

    async def put_fenced(
        self, key: str, owner: str, token: int, data_key: str, value: bytes
    ) -> bool:
        return await self._measure(
            "put_fenced", self.provider.put_fenced(key, owner, token, data_key, value)
        )

    async def delete_fenced(self, key: str, owner: str, token: int, data_key: str) -> bool:
        return await self._measure(
            "delete_fenced", self.provider.delete_fenced(key, owner, token, data_key)
        )

    async def get_value(self, data_key: str) -> bytes | None:
        return await self._measure("get_value", self.provider.get_value(data_key))

    async def close(self) -> None:
        """Close the wrapped provider (if it can be closed)."""
        close: Any = getattr(self.provider, "close", None)
        if close is not None:
            await close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
