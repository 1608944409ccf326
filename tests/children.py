"""Programs the process tests run as children: ``python -m tests.children <role> ...``.

Each prints one line per event, flushed, for the parent to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from etcd_leases import Election, EtcdLeaseProvider, HeldLease, LeaseLost


def say(*words: object) -> None:
    print(*words, flush=True)


async def holder(endpoints: str, prefix: str) -> None:
    """Hold ``res`` (1 s TTL) and, once resumed after a long pause, report what it sees."""
    async with (
        EtcdLeaseProvider(endpoints, prefix=prefix) as provider,
        provider.hold("res", "child", 1000) as lease,
    ):
        assert await lease.put(prefix + "data", "child")
        # Taken before saying "held": the parent may freeze us the moment it reads it.
        last = time.monotonic()
        say("held", lease.token)
        while True:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            if now - last > 0.5:  # we were frozen
                break
            last = now
        remaining = lease.remaining()
        try:
            lease.check()
            checked = "ok"
        except LeaseLost:
            checked = "LeaseLost"
        applied = await lease.put(prefix + "data", "stale child")
        say(json.dumps({"remaining": remaining, "check": checked, "put": applied}))


async def candidate(endpoints: str, prefix: str, name: str) -> None:
    """Campaign for ``leader`` (1 s TTL) for ever, reporting each term."""
    async with EtcdLeaseProvider(endpoints, prefix=prefix) as provider:

        async def lead(lease: HeldLease) -> None:
            say("lead", name, lease.token, time.monotonic())
            await asyncio.Event().wait()

        def stopped() -> None:
            say("stopped", name, time.monotonic())

        say("ready", name)
        await Election(provider, "leader", name, 1000).run(lead, stopped)


async def sigterm_leader(endpoints: str, prefix: str) -> None:
    """Lead ``seat`` (30 s TTL) until SIGTERM, handing over on it as the README shows."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    async with EtcdLeaseProvider(endpoints, prefix=prefix) as provider:

        async def lead(lease: HeldLease) -> None:
            say("lead", lease.token)
            await asyncio.Event().wait()

        await Election(provider, "seat", "child", 30_000).run(lead)


ROLES: dict[str, Callable[..., Coroutine[Any, Any, None]]] = {
    "holder": holder,
    "candidate": candidate,
    "sigterm_leader": sigterm_leader,
}

if __name__ == "__main__":
    role, *args = sys.argv[1:]
    with contextlib.suppress(asyncio.CancelledError):  # the SIGTERM handler's cancel
        asyncio.run(ROLES[role](*args))
