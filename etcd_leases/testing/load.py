"""A loaded host: CPU hogs for tests and benchmarks, killed by pid when done."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cpu_hogs(count: int) -> Iterator[list[int]]:
    """``count`` busy-looping Python processes for the duration of the block; their pids."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield [hog.pid for hog in hogs]
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
