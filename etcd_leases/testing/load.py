"""A loaded host: CPU hogs for tests and benchmarks, killed by pid when done."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# Busy until its parent is gone: a process killed inside ``cpu_hogs`` (SIGKILL, a
# runner's timeout) runs no clean-up, and its hogs would load the host for good.
_HOG = "import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent: pass"


@contextmanager
def cpu_hogs(count: int) -> Iterator[list[int]]:
    """``count`` busy-looping Python processes for the duration of the block (or until
    the calling process dies); their pids."""
    parent = str(os.getpid())
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG, parent]) for _ in range(count)]
    try:
        yield [hog.pid for hog in hogs]
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
