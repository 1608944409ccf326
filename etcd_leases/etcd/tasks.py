"""Background tasks a component starts and must not lose (cleanups, settlements)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class BackgroundTasks:
    """Tasks started off the caller's path, referenced until done (so none is collected
    half way), and waited for when their owner closes."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the tasks running now."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)
