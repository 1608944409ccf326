"""Fixtures shared by the suite: every etcd test runs once per etcd binary found."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import grpc
import grpc.aio
import pytest

from etcd_leases import EtcdLeaseProvider, InMemoryLeaseProvider, LeaseProvider
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.testing import EtcdCluster, etcd_version, find_etcd_binaries

ETCD_BINARIES = {f"etcd{etcd_version(binary)}": binary for binary in find_etcd_binaries()}


def pytest_configure(config: pytest.Config) -> None:
    """CI names the etcd versions it installed; running without one is an error."""
    found = " ".join(ETCD_BINARIES)
    for version in os.environ.get("ETCD_LEASES_REQUIRE_ETCD", "").split():
        if not any(name.startswith(f"etcd{version}") for name in ETCD_BINARIES):
            raise pytest.UsageError(f"etcd {version} is required but not found (found: {found})")
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)
    config.addinivalue_line(
        "markers", "alone: measures what an idle host sustains; runs with no other test"
    )


# Tests that freeze, kill or partition etcd members, start CPU hogs or many worker
# processes. Under pytest-xdist (the README's command) they run one after another on
# one worker, beside the lighter tests on the other: two of them side by side would be
# a load the host's 2 cores were never meant to carry; one beside light tests is the
# shared machine CI is.
_FAULT_MODULES = {
    "tests.chaos.test_chaos",
    "tests.chaos.test_operations",
    "tests.test_failover",
    "tests.test_keepalive",
    "tests.test_linearizability_faults",
    "tests.test_linearizability_inbox",
    "tests.test_processes",
    "tests.test_stalled_leader",
    "tests.test_threads_processes",
    "tests.test_watch",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__ if isinstance(item, pytest.Function) else ""
        if module in _FAULT_MODULES or _loads_the_host(item):
            item.add_marker(pytest.mark.xdist_group("faults"))


def _loads_the_host(item: pytest.Item) -> bool:
    """Whether the test starts CPU hogs (the load it means is theirs, on an idle host),
    or measures what an idle host sustains (marked ``alone``)."""
    return "hogs" in item.name or item.get_closest_marker("alone") is not None


@pytest.fixture(autouse=True)
def alone_if_it_loads_the_host(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Under pytest-xdist, a test that starts CPU hogs, or measures what an idle host
    sustains (marked ``alone``), runs with no test on the other worker: two hogs beside
    another test's etcd members and processes starve what the test measures (5,000
    leases lost, all at once) more than any host it speaks for.

    A readers-writer lock between the workers (``flock``): every test holds it shared,
    such a test exclusive; the turnstile stops new tests from starting while it waits
    for the running one to end.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # the run's, above each worker's
    alone = _loads_the_host(request.node)
    with open(shared / "turnstile.lock", "a") as turnstile, open(shared / "run.lock", "a") as run:
        fcntl.flock(turnstile, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(run, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM (as CI stops a run) as Ctrl-C: the running test's ``finally`` blocks and
    the fixtures' teardowns still run, so worker processes, frozen ones too, network
    namespaces and etcd members go with the run. A second SIGTERM kills at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt(f"signal {signum}")


class EtcdMembers:
    """One single-member etcd per binary, started on first use, shared by the session."""

    def __init__(self) -> None:
        self._members: dict[str, EtcdCluster] = {}

    def get(self, binary: str) -> EtcdCluster:
        if binary not in self._members:
            cluster = EtcdCluster(1, binary=binary)
            cluster.start()
            self._members[binary] = cluster
        return self._members[binary]

    def close(self) -> None:
        for cluster in self._members.values():
            cluster.stop()


class Records(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class LibraryFailures(Records):
    """ERROR records of a failure in the library's own code: every one from its
    background tasks' logger, and those asyncio logs for a callback or a task whose
    exception passed through ``etcd_leases`` (a timer callback that raises is only
    logged by asyncio, and is never called again)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        if record.name != "asyncio" or _raised_in_the_library(record):
            super().emit(record)


def _raised_in_the_library(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    frames = traceback.extract_tb(exc.__traceback__) if exc is not None else []
    return any(f"{os.sep}etcd_leases{os.sep}" in frame.filename for frame in frames)


# The loggers of the library's background work, whose ERROR records say it failed:
# tasks, the keep-alive sender and readers, the lease-loss callbacks (the recipes'
# own), the watch streams.
_BACKGROUND_LOGGERS = (
    "etcd_leases.etcd.tasks",
    "etcd_leases.etcd.keepalive",  # renewal_stream logs here too
    "etcd_leases.etcd.watch.stream",
    "asyncio",
)


@pytest.fixture(autouse=True)
def no_background_task_fails() -> Iterator[Records]:
    """Fail the test in which a background task of the library (a settlement, a
    revoke, a pool refill, the keep-alive sender, a stream's reader) or one of its
    event-loop callbacks (the keep-alive loop's watchdog) fails: each catches what etcd
    can answer, so its failure is a defect, which would otherwise only be logged. (A
    test that makes one fail on purpose takes the records, and clears them.)"""
    failures = LibraryFailures()
    loggers = [logging.getLogger(name) for name in _BACKGROUND_LOGGERS]
    for logger in loggers:
        logger.addHandler(failures)
    try:
        yield failures
    finally:
        for logger in loggers:
            logger.removeHandler(failures)
    assert not failures.records, [
        f"{r.getMessage()}: {r.exc_info and r.exc_info[1]!r}" for r in failures.records
    ]


@pytest.fixture(scope="session")
def etcd_members() -> Iterator[EtcdMembers]:
    members = EtcdMembers()
    yield members
    members.close()


@pytest.fixture(params=list(ETCD_BINARIES))
def etcd_binary(request: pytest.FixtureRequest) -> str:
    """Overrides the plugin's fixture: the suite runs against every etcd found."""
    return ETCD_BINARIES[str(request.param)]


@pytest.fixture
def etcd(etcd_members: EtcdMembers, etcd_binary: str) -> EtcdCluster:
    """A running single-member etcd (shared; tests keep to their own prefix)."""
    return etcd_members.get(etcd_binary)


def process_gone(pid: int) -> bool:
    """Whether no process has ``pid`` (any more)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait until ``condition()`` holds (checked every 10 ms); fail after ``timeout`` s.

    For what happens in another task or process a moment later: a wait on the
    condition, not a sleep of a guessed length; the bound is a loaded machine's.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        await asyncio.sleep(0.01)


async def settled(provider: EtcdLeaseProvider, timeout: float = 10.0) -> None:
    """Wait until the provider's background work is done: pool refills, settlements of
    interrupted calls, revokes (a wait on the tasks, not a sleep of a guessed length)."""
    groups = (provider._background, provider._pool._background, provider._sessions._background)
    deadline = time.monotonic() + timeout
    while any(group._tasks for group in groups):
        assert time.monotonic() < deadline, f"background work still running after {timeout} s"
        for group in groups:
            await group.wait(max(0.0, deadline - time.monotonic()))


async def past_one_shot(provider: EtcdLeaseProvider) -> None:
    """One acquire and release: that release revokes its lease (the process might be
    a one-shot); from the next acquire on, the pool keeps the leases that come back."""
    await provider.acquire_lease("past-one-shot", "warm-up", 5000)
    await provider.release_lease("past-one-shot", "warm-up")


def process_state(pid: int) -> str:
    """A Linux process's state letter (``/proc/PID/stat``): ``T`` once it is stopped."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


async def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped, so a test's freeze is real."""
    os.kill(pid, signal.SIGSTOP)
    await eventually(lambda: process_state(pid) == "T", f"process {pid} stopped")


def unique_prefix() -> str:
    return f"/test/{uuid.uuid4().hex}/"


async def assert_no_lease_leaked(provider: EtcdLeaseProvider, before: set[int]) -> None:
    """Every lease beside ``before`` is free in the provider's pool: alive, carrying no
    key; and the pool's books name no lease etcd no longer has."""
    alive = set(await provider.client.leases())
    left = alive - before
    assert left <= provider._pool.free_lease_ids(), (
        f"a lease leaked: {await _described(provider, left)}"
    )
    for lease in left:
        assert not (await provider.client.time_to_live(lease, keys=True)).keys
    await assert_books_name_no_gone_lease(provider)


async def _described(provider: EtcdLeaseProvider, leases: set[int]) -> str:
    """What etcd and the provider know of each of ``leases`` not free in its pool (tells
    a lease of this test's from one another test's closing provider granted late)."""
    pool = provider._pool
    lines = []
    for lease in sorted(leases - pool.free_lease_ids()):
        status = await provider.client.time_to_live(lease, keys=True)
        books = [
            name
            for name in ("_out", "_unsettled", "_tainted", "_carrying")
            if lease in getattr(pool, name)
        ]
        lines.append(
            f"lease {lease:x}: granted {status.grantedTTL} s, {status.TTL} s left, "
            f"keys {list(status.keys)}, kept {provider._keepalive.is_kept(lease)}, "
            f"pool books {books}"
        )
    return "\n" + "\n".join(lines)


async def assert_books_name_no_gone_lease(provider: EtcdLeaseProvider) -> None:
    """The pool's books keep no lease etcd no longer has (they would grow without end)."""
    alive = set(await provider.client.leases())
    pool = provider._pool
    books = {*pool._out, *pool._unsettled, *pool._tainted, *pool._carrying}
    assert books | set(pool._carrier_of.values()) <= alive, "the pool's books name gone leases"


async def assert_freed(
    provider: EtcdLeaseProvider, lease_id: int, *, or_expiring: bool = False
) -> None:
    """``lease_id`` is revoked, or back in the provider's pool carrying no key.

    ``or_expiring``: or else carries no key and nothing renews it, so it is gone
    within its TTL (what a release whose answer was lost leaves: it cannot tell which
    lease it freed).
    """
    status = await provider.client.time_to_live(lease_id, keys=True)
    if status.TTL == -1:
        return
    assert not status.keys, "a lease leaked"
    pooled = lease_id in provider._pool.free_lease_ids()
    expiring = or_expiring and not provider._keepalive.is_kept(lease_id)
    assert pooled or expiring, "a lease leaked"


@pytest.fixture
async def client(etcd: EtcdCluster) -> AsyncIterator[EtcdClient]:
    """A bare etcd client (the wire layer under the provider)."""
    client = EtcdClient(etcd.endpoints, timeout=5)
    yield client
    await client.close()


def enable_auth(etcd: EtcdCluster) -> None:
    """Turn auth on: user ``root``/``rootpw``, user ``app``/``apppw`` limited to /allowed/."""
    etcd.etcdctl("user", "add", "root", "--new-user-password=rootpw")
    etcd.etcdctl("role", "add", "app")
    etcd.etcdctl("role", "grant-permission", "app", "readwrite", "/allowed/", "--prefix=true")
    etcd.etcdctl("user", "add", "app", "--new-user-password=apppw")
    etcd.etcdctl("user", "grant-role", "app", "app")
    etcd.etcdctl("auth", "enable")


@pytest.fixture
async def etcd_provider(etcd: EtcdCluster) -> AsyncIterator[EtcdLeaseProvider]:
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix(), timeout=5) as provider:
        yield provider


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Backend:
    """A provider under test, and how to make time pass for it."""

    name: str
    provider: LeaseProvider
    etcd: EtcdCluster | None = None
    prefix: str = ""
    clock: FakeClock | None = None
    extra: list[EtcdLeaseProvider] = field(default_factory=list)

    def another_provider(self) -> LeaseProvider:
        """A second client of the same backend (another process, on etcd)."""
        if self.etcd is None:
            return self.provider
        provider = EtcdLeaseProvider(self.etcd.endpoints, prefix=self.prefix)
        self.extra.append(provider)
        return provider

    async def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass on the backend's clock."""
        if self.clock is not None:
            self.clock.now += seconds
        else:
            await asyncio.sleep(seconds)

    async def expire(self, key: str, ttl_ms: int) -> None:
        """Wait until ``key``'s lease of ``ttl_ms`` has expired (bounded)."""
        await self.sleep(ttl_ms / 1000)
        deadline = time.monotonic() + 5
        while await self.provider.get_lease_owner(key) is not None:
            assert time.monotonic() < deadline, f"{key!r} did not expire"
            await asyncio.sleep(0.05)


@pytest.fixture(params=["memory", *ETCD_BINARIES])
async def backend(
    request: pytest.FixtureRequest, etcd_members: EtcdMembers
) -> AsyncIterator[Backend]:
    """Each conformance test runs on the reference model and on every etcd."""
    name = str(request.param)
    if name == "memory":
        clock = FakeClock()
        yield Backend(name, InMemoryLeaseProvider(clock=clock), clock=clock)
        return
    etcd = etcd_members.get(ETCD_BINARIES[name])
    prefix = unique_prefix()
    provider = EtcdLeaseProvider(etcd.endpoints, prefix=prefix)
    backend = Backend(name, provider, etcd=etcd, prefix=prefix)
    try:
        yield backend
    finally:
        for extra in backend.extra:
            await extra.close()
        await provider.close()


Provider = EtcdLeaseProvider | InMemoryLeaseProvider


class Live:
    """A provider on the real clock, and a way to make more clients of the same backend."""

    def __init__(self, provider: Provider, endpoints: list[str] | None, prefix: str) -> None:
        self.provider = provider
        self.endpoints = endpoints
        self.prefix = prefix
        self.others: list[Provider] = []

    def another(self) -> Provider:
        if self.endpoints is None:
            return self.provider
        other = EtcdLeaseProvider(self.endpoints, prefix=self.prefix)
        self.others.append(other)
        return other


@pytest.fixture(params=["memory", *ETCD_BINARIES])
async def live(request: pytest.FixtureRequest, etcd_members: EtcdMembers) -> AsyncIterator[Live]:
    name = str(request.param)
    prefix = unique_prefix()
    if name == "memory":
        live = Live(InMemoryLeaseProvider(), None, prefix)
    else:
        endpoints = etcd_members.get(ETCD_BINARIES[name]).endpoints
        live = Live(EtcdLeaseProvider(endpoints, prefix=prefix), endpoints, prefix)
    try:
        yield live
    finally:
        for other in live.others:
            await other.close()
        await live.provider.close()


class KeepAliveCall:
    """A provider's keep-alive call, passed through as it is; a test's subclass changes
    what it needs on the wire (install with ``monkeypatch`` on the client's
    ``keep_alive_stream``)."""

    def __init__(
        self,
        call: grpc.aio.StreamStreamCall[pb.LeaseKeepAliveRequest, pb.LeaseKeepAliveResponse],
    ) -> None:
        self._call = call

    async def write(self, request: pb.LeaseKeepAliveRequest) -> None:
        await self._call.write(request)

    async def read(self) -> object:
        return await self._call.read()

    def cancel(self) -> bool:
        return self._call.cancel()


class HeldKeepAliveAnswers(KeepAliveCall):
    """A keep-alive call whose answers wait while ``flowing`` is clear, as a member's do
    when it stops answering keep-alives with its connection up."""

    def __init__(
        self,
        call: grpc.aio.StreamStreamCall[pb.LeaseKeepAliveRequest, pb.LeaseKeepAliveResponse],
        flowing: asyncio.Event,
    ) -> None:
        super().__init__(call)
        self._flowing = flowing

    async def read(self) -> object:
        response = await self._call.read()
        await self._flowing.wait()
        return response


# gRPC's own errors for a call whose stream broke (no etcd error text): seen in CI.
BROKEN_STREAM_ERRORS = [
    (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"),
    (grpc.StatusCode.UNKNOWN, "Stream removed"),
]


def etcd_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error gRPC raises for an answer of ``code`` (or none: DEADLINE_EXCEEDED,
    UNAVAILABLE), as the client sees it."""
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details, debug_error_string=""
    )
