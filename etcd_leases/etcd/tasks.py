"""Background tasks a component starts and must not lose (cleanups, settlements)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

_log = logging.getLogger(__name__)


class BackgroundTasks:
    """Tasks started off the caller's path, referenced until done (so none is collected
    half way), and waited for when their owner closes. A task that fails is logged at
    once, as an error: each one catches what etcd can answer, so a failure is a defect,
    and asyncio would report it only when the task is collected, if ever."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            _log.error("background task %s failed", task.get_coro(), exc_info=error)

    async def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the tasks running now."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)
