"""The README's code blocks: each is run here as written, or listed in NOT_RUN with why.

A block that is a fragment (it uses names the surrounding prose gives, such as
``provider`` or ``my_pod_name``) runs with those names defined around it, and
addresses the README hard-codes (``127.0.0.1:2379``, port 9100) are swapped for the
test's own etcd and a free port; nothing else of a block is changed.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from etcd_leases import EtcdLeaseProvider
from etcd_leases.testing import EtcdCluster, free_ports
from etcd_leases.threads import Threads
from tests.conftest import eventually

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS: list[str] = [code for _, code in re.findall(r"```(\w+)\n(.*?)```", README, re.DOTALL)]

# Each block is named by how it begins. Blocks run by the tests below:
QUICKSTART = "import asyncio\nfrom etcd_leases import EtcdLeaseProvider\n"
HOLDING = "async with provider.hold("
ON_SIGTERM = "import asyncio\nimport contextlib\nimport signal\n"
ELECTION = "from etcd_leases import Election, EtcdLeaseProvider\n"
NATIVE = "# One lock and one election shared with etcdctl"
THREADS = "from etcd_leases.threads import Threads\n"
DELIVERY_MODES = "await threads.send("
BLOCKING = "from etcd_leases.sync import EtcdLeaseProvider\n"
COMMAND_LINE = "etcd-leases acquire job:42"
METRICS = "import prometheus_client\n"
CONFIGURATION = "EtcdLeaseProvider(\n"
TESTING_SCRIPT = "import asyncio\n\nfrom etcd_leases import EtcdLeaseProvider\n"
TESTING_TEST = "from etcd_leases import EtcdLeaseProvider\n\n\nasync def test_"
RUN = [
    QUICKSTART,
    HOLDING,
    ON_SIGTERM,
    ELECTION,
    NATIVE,
    THREADS,
    DELIVERY_MODES,
    BLOCKING,
    COMMAND_LINE,
    METRICS,
    CONFIGURATION,
    TESTING_SCRIPT,
    TESTING_TEST,
]
DOCTOR_OUTPUT = "127.0.0.1:2379: etcd "
# Blocks not run, and why.
NOT_RUN = {
    "python3 -m venv .venv && .venv/bin/pip install -q '.[server]'": (
        "installs into a new virtualenv (a download, minutes); the demo it ends with runs "
        "in test_cli_demo"
    ),
    ".venv/bin/pip install -q -e '.[dev]' && .venv/bin/python -m pytest -n 2": "this test suite",
    "pip install .  ": "package installs",
    "python3 -m venv .venv && . .venv/bin/activate": "a package install",
    "python -m pytest -n 2\n": "this test suite",
    DOCTOR_OUTPUT: "the output of `etcd-leases doctor`, checked in test_command_line",
    "$ etcdctl elect --listen reports": (
        "etcdctl's output, with lease IDs that change each run; the interop it shows is "
        "tested in test_native_interop"
    ),
    "docker build -f deploy/Dockerfile": (
        "needs a Docker engine and a cluster; test_deploy runs the image's install and "
        "renders and checks the overlay"
    ),
}


def block(start: str) -> str:
    """The one README block that begins with ``start``."""
    found = [code for code in BLOCKS if code.startswith(start)]
    assert len(found) == 1, f"{len(found)} README blocks begin with {start!r}"
    return found[0]


def swapped(code: str, old: str, new: str) -> str:
    """``code`` with its one ``old`` (an address the README hard-codes) made ``new``."""
    assert code.count(old) == 1, f"expected one {old!r} in the block"
    return code.replace(old, new)


def test_every_block_is_run_or_listed_with_why() -> None:
    starts = [*RUN, *NOT_RUN]
    for code in BLOCKS:
        claimed = [start for start in starts if code.startswith(start)]
        assert len(claimed) == 1, f"README block claimed by {claimed}:\n{code}"
    for start in starts:
        block(start)


@pytest.fixture(scope="module")
def readme_etcd() -> Iterator[EtcdCluster]:
    """An etcd of the README tests' own: the blocks use the default prefix."""
    with EtcdCluster(1) as etcd:
        yield etcd


@pytest.fixture
async def provider(readme_etcd: EtcdCluster) -> AsyncIterator[EtcdLeaseProvider]:
    """A provider on the default prefix, as the blocks' own."""
    async with EtcdLeaseProvider(readme_etcd.endpoints) as provider:
        yield provider


def env(etcd: EtcdCluster | None = None) -> dict[str, str]:
    """Our environment without the user's etcd settings; the test etcd's endpoint."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETCDCTL_", "ETCD_LEASES_"))}
    env.update(PYTHONPATH=str(ROOT), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    if etcd is not None:
        env["ETCDCTL_ENDPOINTS"] = etcd.endpoint_string
    return env


def run_script(
    script: str, tmp_path: Path, etcd: EtcdCluster | None = None
) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"block_{uuid.uuid4().hex}.py"
    path.write_text(script)
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env=env(etcd),
        capture_output=True,
        text=True,
        timeout=120,
    )


def fragment(code: str, *names: str) -> Callable[..., Coroutine[Any, Any, None]]:
    """A fragment of an async function, as one taking ``names`` (the prose's)."""
    source = f"async def fragment({', '.join(names)}):\n" + textwrap.indent(code, "    ")
    namespace: dict[str, Any] = {}
    exec(compile(source, "README.md", "exec"), namespace)
    function: Callable[..., Coroutine[Any, Any, None]] = namespace["fragment"]
    return function


async def test_quickstart(readme_etcd: EtcdCluster, tmp_path: Path) -> None:
    script = swapped(block(QUICKSTART), '"127.0.0.1:2379"', repr(readme_etcd.endpoint_string))
    done = run_script(script, tmp_path)
    assert done.returncode == 0 and done.stdout == "", done.stderr
    async with EtcdLeaseProvider(readme_etcd.endpoints) as provider:
        assert await provider.get_lease_owner("thread:42") is None  # released
        assert (await provider.acquire_lease("thread:42", "worker-b", 15_000)).acquired
        try:
            done = run_script(script, tmp_path)
        finally:
            await provider.release_lease("thread:42", "worker-b")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "route the follow-up to worker-b\n"


async def test_holding_a_lease(provider: EtcdLeaseProvider) -> None:
    example = fragment(block(HOLDING), "provider", "me", "work")
    await example(provider, "worker-a", ["step 1", "step 2"])
    assert await provider.get_value("job:42/state") == b"step 2"
    assert await provider.get_lease_owner("job:42") is None


# What the election blocks leave to the reader: who this is, and the leader's work.
ELECTION_PRELUDE = """\
import asyncio
my_pod_name = "pod-a"
async def do_leader_work(fence):
    print("working with token", fence, flush=True)
    await asyncio.sleep(0.1)
"""


def start_script(script: str, tmp_path: Path, etcd: EtcdCluster) -> subprocess.Popen[str]:
    path = tmp_path / f"block_{uuid.uuid4().hex}.py"
    path.write_text(script)
    return subprocess.Popen(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env=env(etcd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_until(process: subprocess.Popen[str], wanted: str) -> list[str]:
    """The lines ``process`` printed up to the first containing ``wanted``."""
    assert process.stdout is not None
    lines: list[str] = []
    while not lines or wanted not in lines[-1]:
        line = process.stdout.readline()
        assert line, f"ended before printing {wanted!r}: {lines}"
        lines.append(line)
    return lines


async def test_leader_election(
    readme_etcd: EtcdCluster, provider: EtcdLeaseProvider, tmp_path: Path
) -> None:
    script = ELECTION_PRELUDE + block(ELECTION) + "\nasyncio.run(main())\n"
    process = start_script(script, tmp_path, readme_etcd)
    try:
        # Both lines, in either order: the leader report runs beside the lead.
        lines = await asyncio.wait_for(asyncio.to_thread(read_until, process, "leader: pod-a"), 30)
        if not any("working with token" in line for line in lines):
            lines += await asyncio.wait_for(
                asyncio.to_thread(read_until, process, "working with token"), 30
            )
        assert "leader: pod-a\n" in lines
        assert await provider.get_lease_owner("reports") == "pod-a"
    finally:
        process.kill()
        process.communicate()


async def test_releasing_on_sigterm(
    readme_etcd: EtcdCluster, provider: EtcdLeaseProvider, tmp_path: Path
) -> None:
    """The block, with the election block's lead: SIGTERM hands the seat over at once
    (well before its 10 s TTL) and the process exits 0."""
    script = ELECTION_PRELUDE + block(ELECTION) + block(ON_SIGTERM)
    process = start_script(script, tmp_path, readme_etcd)
    try:
        await asyncio.wait_for(asyncio.to_thread(read_until, process, "working with token"), 30)
        assert await provider.get_lease_owner("reports") == "pod-a"
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(asyncio.to_thread(process.communicate), 30)
        assert process.returncode == 0, stderr
        assert await provider.get_lease_owner("reports") is None
    finally:
        process.kill()
        process.communicate()


def test_etcd_native_elections_and_locks(readme_etcd: EtcdCluster, tmp_path: Path) -> None:
    done = run_script(block(NATIVE), tmp_path, readme_etcd)
    assert done.returncode == 0, done.stderr
    locked, leading = done.stdout.splitlines()
    lock_token = int(locked.removeprefix("migrating, fencing token "))
    assert int(leading.removeprefix("leading reports, fencing token ")) > lock_token
    assert readme_etcd.etcdctl("get", "--prefix", "migrations/") == ""  # released
    assert readme_etcd.etcdctl("get", "--prefix", "reports/") == ""  # resigned


async def test_agent_threads(readme_etcd: EtcdCluster) -> None:
    replies: list[tuple[str, str, int]] = []

    async def reply(thread: str, text: str, fence: int) -> None:
        replies.append((thread, text, fence))

    async with EtcdLeaseProvider(readme_etcd.endpoints, prefix=f"/{uuid.uuid4().hex}/") as p:
        example = asyncio.create_task(fragment(block(THREADS), "provider", "reply")(p, reply))
        try:
            await eventually(lambda: len(replies) == 2 or example.done(), "both replies")
            assert not example.done(), example  # serve() runs until cancelled
        finally:
            example.cancel()
            await asyncio.gather(example, return_exceptions=True)
    assert [(thread, text) for thread, text, _ in replies] == [
        ("alice\0chat-1", "hello"),
        ("alice\0chat-1", "hi"),
    ]


async def test_delivery_modes(readme_etcd: EtcdCluster, capsys: pytest.CaptureFixture[str]) -> None:
    async def handle(*_: object) -> None:
        raise AssertionError("no worker runs here")

    async with EtcdLeaseProvider(readme_etcd.endpoints, prefix=f"/{uuid.uuid4().hex}/") as p:
        threads = Threads(p, handle)
        await fragment(block(DELIVERY_MODES), "threads")(threads)
        assert await p.inbox.pending("bob\0chat-2") == []
    assert capsys.readouterr().out == "no run held the thread\n1 queued messages dropped\n"


async def test_blocking_api(
    readme_etcd: EtcdCluster, provider: EtcdLeaseProvider, tmp_path: Path
) -> None:
    script = swapped(block(BLOCKING), '"127.0.0.1:2379"', repr(readme_etcd.endpoint_string))
    done = run_script(script, tmp_path)
    assert done.returncode == 0, done.stderr
    assert await provider.get_value("job:42/state") == b"done"
    assert await provider.get_lease_owner("job:42") is None


# The command-line block's lines that end on their own, with the exit code each
# documents for this sequence; the others run until stopped (watch, elect, server)
# or are the tour (demo, see test_cli_demo). run's CMD is the test's script.
COMMANDS_RUN = {
    "acquire": 0,
    "owner": 0,
    "renew": 0,
    "transfer": 0,
    "release": 0,
    "list": 0,
    "doctor": 0,
    "run": 0,
    "send": 0,
    "wake": 0,  # a message waits (no worker serves here)
    "abort": 1,  # no run holds the thread
    "cancel-pending": 0,
}
# dead-letters needs a thread with dead letters: tests/test_threads_processes.py runs it.
COMMANDS_NOT_RUN = {"watch", "elect", "server", "demo", "dead-letters"}


def test_command_line(readme_etcd: EtcdCluster, tmp_path: Path) -> None:
    nightly = tmp_path / "nightly.sh"
    nightly.write_text('#!/bin/sh\necho "nightly with token $ETCD_LEASES_TOKEN"\n')
    nightly.chmod(0o755)
    command = Path(sys.executable).parent / "etcd-leases"
    outputs: dict[str, str] = {}
    lines = block(COMMAND_LINE).splitlines()
    assert {shlex.split(line, comments=True)[1] for line in lines} == {
        *COMMANDS_RUN,
        *COMMANDS_NOT_RUN,
    }
    for line in lines:
        words = shlex.split(line, comments=True)
        if words[1] in COMMANDS_NOT_RUN:
            continue
        done = subprocess.run(
            [str(command), *words[1:]],
            cwd=tmp_path,
            env=env(readme_etcd),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == COMMANDS_RUN[words[1]], (line, done.stderr)
        outputs[words[1]] = done.stdout
    assert outputs["owner"].strip() == "worker-a"
    assert "nightly with token" in outputs["run"]
    assert outputs["cancel-pending"] == "chat-1: 1 cancelled\n"
    # The shape of doctor's output the README shows (both etcd versions have the bug).
    doctor = block(DOCTOR_OUTPUT).splitlines()[0].split(":")[-1]
    assert doctor.split(",")[1:2] == [" raft leader"], doctor
    assert "raft leader" in outputs["doctor"] and "known bug: etcd bug 15247" in outputs["doctor"]


def test_metrics(readme_etcd: EtcdCluster, tmp_path: Path) -> None:
    (port,) = free_ports(1)
    script = "from etcd_leases import EtcdLeaseProvider\n"
    script += swapped(block(METRICS), "9100", str(port))
    script += (
        "import urllib.request\n"
        f"print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())\n"
    )
    done = run_script(script, tmp_path, readme_etcd)
    assert done.returncode == 0, done.stderr
    assert "etcd_leases_leases_held 0.0" in done.stdout


def test_configuration(tmp_path: Path) -> None:
    """The documented keywords and from_env exist (nothing connects until used)."""
    script = "from etcd_leases import EtcdLeaseProvider\n" + block(CONFIGURATION)
    done = run_script(script, tmp_path)
    assert done.returncode == 0, done.stderr


def test_the_testing_section_runs_as_written(tmp_path: Path) -> None:
    done = run_script(block(TESTING_SCRIPT), tmp_path)
    assert done.returncode == 0, done.stderr

    (tmp_path / "test_example.py").write_text(block(TESTING_TEST))
    plugins = ["-p", "etcd_leases.testing", "-p", "pytest_asyncio.plugin"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugins, "-o", "asyncio_mode=auto"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_the_test_count_is_the_suites() -> None:
    (said,) = re.findall(r"\(([0-9,]+) tests\)", README)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    collected = re.search(r"^(\d+) tests? collected", done.stdout, re.MULTILINE)
    assert collected is not None, done.stdout[-2000:] + done.stderr
    assert int(said.replace(",", "")) == int(collected.group(1))
