"""Leader election on top of ``hold``, for any provider that can hold leases.

The seat is the lease key ``name``; the leader is whoever holds it. Candidates wait
by watching the seat (no polling) and take it as soon as it is free::

    election = Election(provider, "reports", me, ttl_ms=10_000)
    async with election.leadership() as lease:
        await produce_reports(fence=lease.token)   # cancelled if leadership is lost
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager

from etcd_leases.contract import HoldingProvider, check_key, check_owner, check_ttl_ms
from etcd_leases.errors import BackendUnavailable, LeaseLost
from etcd_leases.hold import HeldLease, hold

Callback = Callable[..., Awaitable[None] | None]

_log = logging.getLogger(__name__)
# Waiting out an unreachable etcd: first retry after this, doubling up to the max.
_RETRY_MIN_S = 0.1
_RETRY_MAX_S = 1.0
# How long run waits for on_new_leader's first report before campaigning anyway.
_FIRST_REPORT_S = 1.0
# While etcd stays unreachable, say so this often.
_LOG_EVERY_S = 10.0


async def _call(callback: Callback | None, *args: object) -> None:
    if callback is not None:
        result = callback(*args)
        if inspect.isawaitable(result):
            await result


class Election:
    """One candidate in the election ``name``."""

    def __init__(self, provider: HoldingProvider, name: str, candidate: str, ttl_ms: int) -> None:
        check_key(name, "name")
        check_owner(candidate, "candidate")
        check_ttl_ms(ttl_ms)
        self.provider = provider
        self.name = name
        self.candidate = candidate
        self.ttl_ms = ttl_ms
        self._seat: AbstractAsyncContextManager[HeldLease] | None = None
        self._lease: HeldLease | None = None

    @property
    def lease(self) -> HeldLease | None:
        """The seat while this candidate holds it."""
        return self._lease

    async def campaign(self, timeout: float | None = None) -> HeldLease:
        """Block until this candidate leads (or ``timeout`` passes: :class:`LeaseHeld`)."""
        if self._lease is not None and not self._lease.lost.is_set():
            return self._lease
        await self.resign()
        seat = hold(
            self.provider,
            self.name,
            self.candidate,
            self.ttl_ms,
            wait=True if timeout is None else timeout,
        )
        self._lease = await seat.__aenter__()
        self._seat = seat
        return self._lease

    async def resign(self) -> None:
        """Give up the seat if this candidate holds it (a no-op otherwise)."""
        seat, self._seat, self._lease = self._seat, None, None
        if seat is not None:
            await seat.__aexit__(None, None, None)

    async def leader(self) -> str | None:
        """The current leader, or ``None`` when the seat is empty."""
        return await self.provider.get_lease_owner(self.name)

    async def observe(self) -> AsyncIterator[str | None]:
        """The leader now, then each change of leader; ``None`` for an empty seat."""
        last: object = object()
        async with aclosing(self.provider.watch_owner(self.name)) as states:
            async for state in states:
                if state.owner != last:
                    last = state.owner
                    yield state.owner

    @asynccontextmanager
    async def leadership(self, timeout: float | None = None) -> AsyncIterator[HeldLease]:
        """Campaign, then run the block as leader.

        If leadership is lost, the block is cancelled and the ``async with`` raises
        :class:`LeaseLost`. The seat is given up when the block ends.
        """
        lease = await self.campaign(timeout)
        _log.info("election %r: %r leads (token %d)", self.name, self.candidate, lease.token)
        task = asyncio.current_task()
        assert task is not None
        lost_it = False

        async def cancel_on_loss() -> None:
            nonlocal lost_it
            await lease.lost.wait()
            lost_it = True
            _log.warning(
                "election %r: %r lost the leadership: %s",
                self.name,
                self.candidate,
                lease.lost_reason,
            )
            task.cancel(f"leadership of {self.name!r} lost")

        watchdog = asyncio.get_running_loop().create_task(cancel_on_loss())
        try:
            yield lease
        except asyncio.CancelledError:
            if lost_it and task.uncancel() == 0:
                raise LeaseLost(
                    f"{self.candidate!r} lost the leadership of {self.name!r}: {lease.lost_reason}"
                ) from None
            raise
        finally:
            watchdog.cancel()
            await self.resign()
        if lost_it:
            # The block ended on its own as the seat was lost: say so all the same.
            raise LeaseLost(f"{self.candidate!r} lost the leadership of {self.name!r}")

    async def run(
        self,
        on_started_leading: Callable[[HeldLease], Awaitable[None]],
        on_stopped_leading: Callback | None = None,
        on_new_leader: Callback | None = None,
        *,
        stop: asyncio.Event | None = None,
    ) -> None:
        """Lead whenever possible, as client-go's leader elector does.

        ``on_started_leading(lease)`` runs while this candidate leads and is cancelled
        when leadership is lost; ``on_stopped_leading()`` follows every term;
        ``on_new_leader(leader)`` hears of every change of leader (``None``: empty
        seat). After a loss the candidate campaigns again. ``run`` returns when
        ``on_started_leading`` returns, or once ``stop`` is set (ending the current
        term or campaign); cancelling it ends it too, giving the seat back at once
        (as client-go's ``ReleaseOnCancel``). While etcd is unreachable it keeps
        campaigning and logs a warning every few seconds.
        """
        stop = stop or asyncio.Event()
        reported = asyncio.Event()
        observer = asyncio.get_running_loop().create_task(
            self._report_leaders(on_new_leader, reported)
        )
        try:
            # on_new_leader first hears of the seat as run found it, before this
            # candidate's own campaign changes it (unless etcd is slow to answer).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reported.wait(), _FIRST_REPORT_S)
            while not stop.is_set():
                if not await self._campaign_until(stop):
                    return
                try:
                    if await self._lead_once(on_started_leading, stop):
                        return
                except LeaseLost:
                    continue
                finally:
                    await _call(on_stopped_leading)
        finally:
            observer.cancel()
            await asyncio.gather(observer, return_exceptions=True)

    async def _lead_once(
        self, on_started_leading: Callable[[HeldLease], Awaitable[None]], stop: asyncio.Event
    ) -> bool:
        """One term: True when the work returned, False when ``stop`` ended it."""
        async with self.leadership() as lease:
            work = asyncio.ensure_future(on_started_leading(lease))
            stopped = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait([work, stopped], return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (work, stopped):
                    task.cancel()
                await asyncio.gather(work, stopped, return_exceptions=True)
            if work.cancelled():
                return False
            work.result()  # the work's own exception, if any
            return True
        raise AssertionError("unreachable: leadership() raises LeaseLost or returns above")

    async def _campaign_until(self, stop: asyncio.Event) -> bool:
        """Campaign until elected (True) or ``stop`` is set (False).

        An unreachable cluster is waited out (a candidate must outlive an outage);
        a closed provider or refused credentials end the run with their error.
        """
        unreachable_since: float | None = None
        next_log_at = 0.0
        while not stop.is_set():
            attempted_at = time.monotonic()
            campaign = asyncio.ensure_future(self.campaign())
            stopped = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait([campaign, stopped], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
                if not campaign.done():
                    campaign.cancel()
                    await asyncio.gather(campaign, return_exceptions=True)
            if campaign.cancelled():
                return False
            if isinstance(error := campaign.exception(), BackendUnavailable):
                now = time.monotonic()
                if unreachable_since is None:
                    # Unanswered since this attempt began (a call waits out its timeout
                    # before it fails), not since its failure was known.
                    unreachable_since = attempted_at
                if now >= next_log_at:  # the first failure, then every few seconds
                    next_log_at = now + _LOG_EVERY_S
                    _log.warning(
                        "election %r: %r cannot campaign, etcd has not answered for %.1f s (%s)",
                        self.name,
                        self.candidate,
                        now - unreachable_since,
                        error,
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), min(_RETRY_MAX_S, self.ttl_ms / 3000))
                continue
            campaign.result()  # re-raise: the provider died under us
            return True
        return False

    async def _report_leaders(
        self, on_new_leader: Callback | None, reported: asyncio.Event
    ) -> None:
        """Tell ``on_new_leader`` of each change, watching again after an outage;
        ``reported`` is set once it heard of the first leader (or there is nobody to tell)."""
        if on_new_leader is None:
            reported.set()
            return
        last: object = object()
        backoff = _RETRY_MIN_S
        while True:
            try:
                async for leader in self.observe():
                    backoff = _RETRY_MIN_S
                    if leader != last:
                        last = leader
                        await _call(on_new_leader, leader)
                        reported.set()
                return
            except BackendUnavailable as exc:
                _log.warning(
                    "election %r: cannot watch the leader (%s); watching again in %.1f s",
                    self.name,
                    exc,
                    backoff,
                )
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, _RETRY_MAX_S)
