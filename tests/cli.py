"""Running the ``etcd-leases`` command as a user would: ``python -m etcd_leases ...``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from queue import Empty, Queue
from typing import Any

from etcd_leases.testing import EtcdCluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = [sys.executable, "-m", "etcd_leases"]


def cli_env(etcd: EtcdCluster | None = None, prefix: str | None = None) -> dict[str, str]:
    """The test's environment without the user's etcdctl and gRPC log settings, plus ours."""
    settings = ("ETCDCTL_", "ETCD_LEASES_", "GRPC_VERBOSITY")
    env = {k: v for k, v in os.environ.items() if not k.startswith(settings)}
    env["PYTHONPATH"] = ROOT
    if etcd is not None:
        env["ETCDCTL_ENDPOINTS"] = etcd.endpoint_string
    if prefix is not None:
        env["ETCD_LEASES_PREFIX"] = prefix
    return env


def run_cli(
    *args: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def json_of(done: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(done.stdout)


class Running:
    """A command left running; its stdout lines readable with a timeout."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [*COMMAND, *args],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: Queue[str | None] = Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def line(self, within: float = 30) -> str:
        try:
            line = self._lines.get(timeout=within)
        except Empty:
            raise AssertionError(f"no output from {self.process.args!r} in {within} s") from None
        assert line is not None, f"ended with {self.process.wait()}: {self.stderr()}"
        return line

    def event(self, within: float = 30) -> dict[str, Any]:
        """The next ``--json`` event."""
        event: dict[str, Any] = json.loads(self.line(within))
        return event

    def event_named(self, name: str, within: float = 30) -> dict[str, Any]:
        while True:
            event = self.event(within)
            if event.get("event") == name:
                return event

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        return self.process.wait(timeout)

    def stderr(self) -> str:
        if self.process.poll() is None or self.process.stderr is None:
            return ""
        return self.process.stderr.read()

    def children(self) -> list[int]:
        """Pids of its child processes now (Linux)."""
        pid = self.process.pid
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as file:
                return [int(p) for p in file.read().split()]
        except FileNotFoundError:
            return []

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


@contextlib.contextmanager
def running(*commands: list[str], env: dict[str, str]) -> Iterator[list[Running]]:
    """Commands left running for the block; killed (with their children) after it."""
    started: list[Running] = []
    try:
        for command in commands:
            started.append(Running(command, env))
        yield started
    finally:
        for proc in started:
            # Children first: one left running would hold the output pipe open.
            for child in proc.children():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            proc.stop()
