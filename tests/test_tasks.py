"""Background tasks: referenced until done, and a failure logged at once."""

from __future__ import annotations

import asyncio
import logging

from etcd_leases.etcd.tasks import BackgroundTasks
from tests.conftest import Records


async def test_a_failed_task_is_logged_at_once_a_cancelled_or_finished_one_is_not(
    no_background_task_fails: Records,
) -> None:
    tasks = BackgroundTasks()

    async def fails() -> None:
        raise RuntimeError("broken")

    async def finishes() -> None:
        pass

    async def waits() -> None:
        await asyncio.sleep(60)

    for coroutine in (fails(), finishes(), waits()):
        tasks.start(coroutine)
    await asyncio.sleep(0.1)
    (waiting,) = tasks._tasks  # the others are done, and forgotten
    waiting.cancel()
    await tasks.wait(5)
    assert not tasks._tasks
    records = no_background_task_fails.records
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.ERROR, f"background task {fails.__qualname__} failed")
    ]
    assert records[0].exc_info is not None and str(records[0].exc_info[1]) == "broken"
    records.clear()  # failed on purpose
