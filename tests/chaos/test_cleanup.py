"""A chaos run stopped with SIGTERM (as CI stops pytest) leaves nothing behind: its
worker processes and network namespaces go with it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import process_gone

ROOT = Path(__file__).resolve().parents[2]

# A test holding what a chaos run holds: namespaces, and a worker it ends in `finally`.
INTERRUPTED_RUN = textwrap.dedent(
    """
    import subprocess, sys, time
    from tests.chaos.partitions import Partitions

    def test_interrupted() -> None:
        partitions = Partitions(2)
        partitions.create()
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        try:
            print("READY", worker.pid, partitions.bridge, *partitions.namespaces, flush=True)
            time.sleep(120)
        finally:
            worker.kill()
            worker.wait()
            partitions.destroy()
    """
)


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


def link_exists(name: str) -> bool:
    shown = subprocess.run(["ip", "link", "show", name], capture_output=True, check=False)
    return shown.returncode == 0


def test_sigterm_ends_a_chaos_run_cleanly(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        why = "network namespaces need root and iproute2's 'ip'"
        if os.environ.get("ETCD_LEASES_REQUIRE_PARTITIONS") == "1":
            pytest.fail(f"ETCD_LEASES_REQUIRE_PARTITIONS=1 but {why}")
        pytest.skip(why)
    test_file = tmp_path / "test_interrupted.py"
    test_file.write_text(INTERRUPTED_RUN)
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "tests.conftest", str(test_file)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert run.stdout is not None
    line = ""
    while not line.startswith("READY"):
        line = run.stdout.readline()
        assert line, "the interrupted run ended before it was ready"
    _, pid_text, bridge, *created = line.split()
    worker = int(pid_text)
    try:
        assert not process_gone(worker) and set(created) <= namespaces()
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
        assert process_gone(worker), "the worker outlived the run"
        assert not set(created) & namespaces(), "the run left network namespaces behind"
        assert not link_exists(bridge), "the run left its bridge behind"
    finally:
        run.kill()
        run.wait()
        if not process_gone(worker):  # our grandchild: clean up after a failed assertion
            os.kill(worker, signal.SIGKILL)
        for namespace in set(created) & namespaces():
            subprocess.run(["ip", "netns", "del", namespace], check=False)
        if link_exists(bridge):
            subprocess.run(["ip", "link", "del", bridge], check=False)
