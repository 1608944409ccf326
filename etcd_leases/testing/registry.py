"""Bookkeeping of what this process started: etcd processes, temporary directories, ports.

An :mod:`atexit` hook kills (by pid) every etcd still running when the interpreter
exits and removes the temporary directories of clusters that were never stopped.
``SIGTERM`` (a CI runner or a user stopping pytest) ends a Python process without
running :mod:`atexit` hooks, so the first etcd started from the main thread also
installs a ``SIGTERM`` handler that cleans up, then lets the signal do what it did
before. ``SIGKILL`` of this process (a test runner's timeout, mutmut's among them)
runs nothing: there, where util-linux's ``setpriv`` exists, the kernel ends each etcd
with ``SIGKILL`` (``PR_SET_PDEATHSIG``) when the thread that started it ends, and
:func:`spawn` starts every etcd from one thread that lives as long as this process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import IO

_HOST = "127.0.0.1"

_registry_lock = threading.Lock()
# pid -> (pid of the Python process that started it, process)
_processes: dict[int, tuple[int, subprocess.Popen[bytes]]] = {}
# temporary directory -> pid of the Python process that created it
_directories: dict[str, int] = {}
# ports handed out to clusters that have not been stopped yet
_reserved_ports: set[int] = set()


# Per process (a fork has none of its parent's threads): the thread etcd starts from.
_spawners: dict[int, ThreadPoolExecutor] = {}
_SETPRIV = shutil.which("setpriv")


def spawn(
    argv: Sequence[str], prefix_length: int, log: IO[bytes], env: Mapping[str, str]
) -> subprocess.Popen[bytes]:
    """Start ``argv`` (its first ``prefix_length`` words a wrapper such as ``ip netns
    exec``, which execs the rest), output to ``log``, so that it dies with this
    process; register it."""
    command = list(argv)
    if _SETPRIV is not None:
        command[prefix_length:prefix_length] = [_SETPRIV, "--pdeathsig", "KILL", "--"]

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            # Ctrl-C in a terminal must not hit etcd directly: the harness stops it
            # (or the atexit hook kills it).
            start_new_session=True,
        )

    with _registry_lock:
        spawner = _spawners.get(os.getpid())
        if spawner is None:
            spawner = _spawners[os.getpid()] = ThreadPoolExecutor(1, "etcd-leases-spawner")
    process = spawner.submit(start).result()
    _register_process(process)
    return process


def _register_process(process: subprocess.Popen[bytes]) -> None:
    with _registry_lock:
        _processes[process.pid] = (os.getpid(), process)
    _clean_up_on_sigterm()


# The SIGTERM handler this module replaced, once it has (per process).
_replaced_sigterm: dict[int, signal.Handlers | object] = {}


def _clean_up_on_sigterm() -> None:
    """Install the SIGTERM handler, once per process, if we can (the main thread)."""
    if (
        os.getpid() in _replaced_sigterm
        or threading.current_thread() is not threading.main_thread()
    ):
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN or previous is None or previous is _on_sigterm:
        # Ignored on purpose, installed outside Python, or inherited through fork.
        return
    _replaced_sigterm[os.getpid()] = previous
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _cleanup_at_exit()
    previous = _replaced_sigterm.get(os.getpid(), signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    # The default: die of SIGTERM, as the process would have without us.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _forget_process(process: subprocess.Popen[bytes]) -> None:
    with _registry_lock:
        entry = _processes.get(process.pid)
        if entry is not None and entry[1] is process:
            del _processes[process.pid]


def _cleanup_at_exit() -> None:
    """Kill every etcd this interpreter started and that is still running."""
    me = os.getpid()
    with _registry_lock:
        processes = [proc for owner, proc in _processes.values() if owner == me]
        directories = [path for path, owner in _directories.items() if owner == me]
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(OSError):
                process.kill()
    # All killed before any is waited for: a member in the middle of a disk write dies
    # only once the write ends (seconds on a loaded disk), and one after another, the
    # waits added up past what a SIGTERM's sender waits for (CI, stop 40).
    deadline = time.monotonic() + 10
    for process in processes:
        with contextlib.suppress(Exception):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        _forget_process(process)
    for path in directories:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_cleanup_at_exit)


def free_ports(count: int = 1) -> list[int]:
    """Return ``count`` distinct TCP ports on 127.0.0.1 that are free right now.

    The ports are picked by the kernel (binding to port 0).  They are free when
    returned, but nothing stops another process from taking them before etcd
    binds them: :class:`EtcdCluster` retries with new ports when that happens.
    Ports in use by clusters of this process that are not stopped are skipped.
    """
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            if len(sockets) > count + 100:
                raise RuntimeError("could not find free ports on 127.0.0.1")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((_HOST, 0))
            port = int(sock.getsockname()[1])
            with _registry_lock:
                if port in _reserved_ports:
                    continue
            ports.append(port)
    finally:
        for sock in sockets:
            sock.close()
    return ports


def _reserve_ports(count: int) -> list[int]:
    ports = free_ports(count)
    with _registry_lock:
        _reserved_ports.update(ports)
    return ports


def _release_ports(ports: Sequence[int]) -> None:
    with _registry_lock:
        _reserved_ports.difference_update(ports)
