"""Background tasks a component starts and must not lose (cleanups, settlements)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

_log = logging.getLogger(__name__)


def log_if_failed(task: asyncio.Task[Any]) -> None:
    """As a task's done callback: log the exception it ended with, as an error."""
    if not task.cancelled() and (error := task.exception()) is not None:
        name = getattr(task.get_coro(), "__qualname__", task.get_name())
        _log.error("background task %s failed", name, exc_info=error)


class BackgroundTasks:
    """Tasks started off the caller's path, referenced until done (so none is collected
    half way), and waited for when their owner closes. A task that fails is logged at
    once (:func:`log_if_failed`): each one catches what etcd can answer, so a failure is
    a defect, which asyncio would report only when the task is collected, if ever."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        log_if_failed(task)

    async def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the tasks running now."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)
