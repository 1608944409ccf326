"""Holding a lease: background renewal, loss detection, fencing and waiting.

Written against the contract (:class:`HoldingProvider`), so it runs on etcd and on
the in-memory model alike::

    async with provider.hold("job:42", me, 15_000) as lease:
        while work_left():
            lease.check()                        # raises LeaseLost once it is gone
            await lease.put("job:42/state", ...)  # applies only while we hold it
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, cast

from etcd_leases.contract import AcquireResult, HoldingProvider, Keeper, check_owner
from etcd_leases.errors import (
    BackendUnavailable,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    LeaseTypeError,
    LeaseValueError,
)

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

_log = logging.getLogger(__name__)


class HeldLease:
    """One tenure of ``key`` by ``owner``, kept alive until the ``hold`` block ends."""

    def __init__(
        self,
        provider: HoldingProvider,
        key: str,
        owner: str,
        acquired: AcquireResult,
        keeper: Keeper,
    ) -> None:
        assert acquired.token is not None and acquired.ttl_ms is not None
        self.key = key
        self.owner = owner
        #: The fencing token: show it to anything this lease protects.
        self.token: int = acquired.token
        #: The TTL granted, in ms.
        self.ttl_ms: int = acquired.ttl_ms
        self._provider = provider
        self._keeper = keeper
        self._handed_on = False
        self._ended_by_holder = False
        on_lost = getattr(keeper, "on_lost", None)  # see EtcdKeeper.on_lost
        if on_lost is not None:
            on_lost(self._log_loss)
        else:
            # Referenced, so not collected; it ends when the tenure does.
            self._loss_logger = asyncio.get_running_loop().create_task(self._wait_for_loss())

    async def _wait_for_loss(self) -> None:
        await self._keeper.lost.wait()
        self._log_loss()

    def _log_loss(self) -> None:
        if not self._ended_by_holder:
            _log.warning(
                "%r lost %r (token %d): %s", self.owner, self.key, self.token, self.lost_reason
            )

    @property
    def lost(self) -> asyncio.Event:
        """Set the moment the tenure is over: expired, taken, deleted or handed on."""
        return self._keeper.lost

    @property
    def lost_reason(self) -> str | None:
        return self._keeper.lost_reason

    def remaining(self) -> float:
        """Seconds of guaranteed validity on this process's clock; 0 once lost.

        Counted from when the last answered renewal was *sent*, so it never runs
        past what etcd allows.
        """
        return 0.0 if self.lost.is_set() else self._keeper.remaining()

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless the tenure is still guaranteed."""
        if self.remaining() <= 0:
            reason = self.lost_reason or "its TTL ran out with no renewal answered"
            raise LeaseLost(f"{self.owner!r} lost {self.key!r}: {reason}")

    async def transfer(self, to_owner: str, ttl_ms: int | None = None) -> None:
        """Hand the key to ``to_owner`` atomically; this lease is then lost.

        The new owner takes over with :func:`adopt`, with no gap in between.
        """
        check_owner(to_owner, "to_owner")
        self.check()
        # Before the await: the key's watch may report the hand-off before the
        # transaction's answer arrives, and it is no loss.
        self._ended_by_holder = True
        try:
            moved = await self._provider.transfer_lease(
                self.key, self.owner, to_owner, self.ttl_ms if ttl_ms is None else ttl_ms
            )
        except BaseException:
            self._ended_by_holder = False
            raise
        if not moved:
            self._ended_by_holder = False
            self._keeper.lose("lost before it could be transferred")
            self.check()
        self._handed_on = True
        self._keeper.lose(f"transferred to {to_owner!r}")
        _log.info("%r handed %r (token %d) to %r", self.owner, self.key, self.token, to_owner)

    async def release_with(self, release: Callable[[], Awaitable[bool]]) -> bool:
        """End the tenure by ``release``, the caller's own atomic, fenced step that frees
        the key (say, only while an inbox is empty); whether it did.

        The key's watch then reports no loss, and the block's exit releases nothing more.
        """
        self._ended_by_holder = True  # before the await: the key's change is ours
        if not await release():
            self._ended_by_holder = False
            return False
        self._handed_on = True
        self._keeper.lose("released by its holder")
        return True

    async def put(self, data_key: str, value: str | bytes) -> bool:
        """Write ``data_key`` only while this tenure holds the key; whether it applied."""
        if self.remaining() <= 0:
            return False
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        return await self._provider.put_fenced(self.key, self.owner, self.token, data_key, data)

    async def delete(self, data_key: str) -> bool:
        """Delete ``data_key`` only while this tenure holds the key; whether it applied."""
        if self.remaining() <= 0:
            return False
        return await self._provider.delete_fenced(self.key, self.owner, self.token, data_key)

    async def _finish(self) -> None:
        """End the tenure: lost to anyone still looking first, then the key released.

        The release runs to its end even if the task is cancelled again meanwhile (a
        shutdown does), so a successor need not wait a TTL; the cancel follows.
        It never raises for an unreachable etcd: the work is done, the tenure ends on
        its own when its TTL runs out, and the holder's clock has it over already.
        """
        still_held = not self.lost.is_set() and not self._handed_on
        self._ended_by_holder = True
        self._keeper.lose("released by its holder")
        if not still_held:
            return
        releasing = asyncio.ensure_future(self._release())
        cancelled = False
        while not releasing.done():
            try:
                await asyncio.shield(releasing)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
        releasing.result()

    async def _release(self) -> None:
        try:
            await self._provider.release_lease(self.key, self.owner)
        except BackendUnavailable as exc:
            _log.warning(
                "could not release %r held by %r (%s); it expires on its own within %d ms",
                self.key,
                self.owner,
                exc,
                self.ttl_ms,
            )

    def __repr__(self) -> str:
        state = "lost" if self.lost.is_set() else f"{self.remaining():.3f}s left"
        return f"<HeldLease {self.key!r} by {self.owner!r} token={self.token} {state}>"


# The classes seen to be HoldingProviders: checking a runtime Protocol walks every
# attribute it names (about 0.1 ms, a tenth of a take), and a class keeps its methods.
_holding_classes: weakref.WeakSet[type] = weakref.WeakSet()


def _holding(provider: object) -> HoldingProvider:
    if type(provider) in _holding_classes:
        return cast(HoldingProvider, provider)
    if isinstance(provider, HoldingProvider):
        _holding_classes.add(type(provider))
    else:
        raise LeaseTypeError(
            f"{type(provider).__name__} cannot hold leases: it needs watch_owner, "
            "keep_lease, put_fenced, delete_fenced and get_value (see HoldingProvider)"
        )
    return provider


def _wait_seconds(wait: bool | float) -> float | None:
    """``None`` to wait for ever; a number of seconds otherwise (0: do not wait)."""
    if wait is True:
        return None
    if wait is False:
        return 0.0
    if not isinstance(wait, int | float) or not wait >= 0:
        raise LeaseValueError(f"wait must be a bool or a number of seconds >= 0, got {wait!r}")
    return float(wait)


# Give-backs of tenures nobody will hold, left to finish on their own: referenced
# here so the event loop does not drop them half way.
_give_backs: set[asyncio.Task[None]] = set()


async def _release_quietly(provider: HoldingProvider, key: str, owner: str) -> None:
    with contextlib.suppress(LeaseError):
        await provider.release_lease(key, owner)


def _give_back(provider: HoldingProvider, key: str, owner: str) -> None:
    """Release a key taken for a holder that will not hold it, in the background."""
    task = asyncio.get_running_loop().create_task(_release_quietly(provider, key, owner))
    _give_backs.add(task)
    task.add_done_callback(_give_backs.discard)


async def _keep(
    provider: HoldingProvider, key: str, owner: str, result: AcquireResult, sent_at: float
) -> HeldLease:
    assert result.token is not None and result.ttl_ms is not None
    valid_until = sent_at + result.ttl_ms / 1000
    try:
        keeper = await provider.keep_lease(key, owner, result.token, result.ttl_ms, valid_until)
    except BaseException:
        # Acquired but not kept (cancelled, or the backend failed): give the key back
        # rather than leave it taken, by no one, until its TTL runs out.
        _give_back(provider, key, owner)
        raise
    return HeldLease(provider, key, owner, result, keeper)


async def _acquire(
    provider: HoldingProvider, key: str, owner: str, ttl_ms: int, wait: float | None
) -> HeldLease:
    result, keeper = await provider.acquire_kept(key, owner, ttl_ms)
    if keeper is None:
        if wait == 0:
            raise LeaseHeld(key, result.owner)
        result, keeper = await _wait_for(provider, key, owner, ttl_ms, wait, result.owner)
    return HeldLease(provider, key, owner, result, keeper)


async def _wait_for(
    provider: HoldingProvider,
    key: str,
    owner: str,
    ttl_ms: int,
    wait: float | None,
    holder: str | None,
) -> tuple[AcquireResult, Keeper]:
    """Watch ``key`` and acquire it as soon as it is free."""
    acquired: tuple[AcquireResult, Keeper] | None = None
    try:
        async with asyncio.timeout(wait), aclosing(provider.watch_owner(key)) as states:
            # The first state is the key as it is now, so a release between our
            # attempt and the watch's start is not missed.
            async for state in states:
                if state.owner is not None and state.owner != owner:
                    holder = state.owner
                    continue
                result, keeper = await provider.acquire_kept(key, owner, ttl_ms)
                if keeper is not None:
                    acquired = result, keeper
                    break
                holder = result.owner
    except TimeoutError:
        pass  # taken just in time, or not at all
    except BaseException:
        if acquired is not None:  # cancelled while the watch closed: give it back
            acquired[1].lose("given back: its holder was cancelled")
            _give_back(provider, key, owner)
        raise
    if acquired is None:
        raise LeaseHeld(key, holder)
    return acquired


@asynccontextmanager
async def hold(
    provider: object, key: str, owner: str, ttl_ms: int, *, wait: bool | float = False
) -> AsyncIterator[HeldLease]:
    """Acquire ``key`` and keep it alive for the block; release it at the end.

    ``wait=False`` raises :class:`LeaseHeld` naming the holder if the key is taken;
    ``wait=True`` (or a number of seconds) waits for the key, watching it, and takes
    it as soon as it is free. Inside, ``lease.lost`` is set and ``lease.check()``
    raises the moment the tenure ends. Cancelling the task gives the key back at once
    (as client-go's ``ReleaseOnCancel``).
    """
    holding = _holding(provider)
    held = await _acquire(holding, key, owner, ttl_ms, _wait_seconds(wait))
    try:
        yield held
    finally:
        await held._finish()


@asynccontextmanager
async def adopt(provider: object, key: str, owner: str, ttl_ms: int) -> AsyncIterator[HeldLease]:
    """Take over the tenure someone transferred to ``owner``, like ``hold`` does.

    Raises :class:`LeaseLost` if ``owner`` does not hold ``key`` (any more).
    """
    holding = _holding(provider)
    sent_at = time.monotonic()
    if not await holding.renew_lease(key, owner, ttl_ms):
        raise LeaseLost(f"{owner!r} does not hold {key!r}: there is no tenure to adopt")
    # Just renewed, so this is the same tenure; it tells us its token.
    result = await holding.acquire_lease(key, owner, ttl_ms)
    if not result.acquired:
        raise LeaseLost(f"{owner!r} lost {key!r} while adopting it")
    held = await _keep(holding, key, owner, result, sent_at)
    try:
        yield held
    finally:
        await held._finish()


class Holding:
    """Gives a provider ``hold`` and ``adopt`` methods (see the functions of this module)."""

    def hold(
        self, key: str, owner: str, ttl_ms: int, *, wait: bool | float = False
    ) -> AbstractAsyncContextManager[HeldLease]:
        return hold(self, key, owner, ttl_ms, wait=wait)

    def adopt(self, key: str, owner: str, ttl_ms: int) -> AbstractAsyncContextManager[HeldLease]:
        return adopt(self, key, owner, ttl_ms)
