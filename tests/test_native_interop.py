"""etcd-native elections and locks against the real ``etcdctl elect`` / ``etcdctl lock``
of each etcd version under test: one election, one lock, whoever the candidates are."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from etcd_leases import EtcdLeaseProvider, LeaseLost, LeaseTypeError, LeaseValueError
from etcd_leases.etcd.native import Leader, NativeElection, NativeLock
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.testing import EtcdCluster
from etcd_leases.testing.binaries import _child_env, find_etcdctl

from .conftest import eventually

# A window in which a process that wrongly took a lock or leadership would have said
# so (it prints within milliseconds of its Campaign or Lock returning).
_WRONG_WINDOW_S = 1.5


class Child:
    """A child process whose stdout lines are read with a bound."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    async def line(self, within: float = 30.0) -> str:
        assert self.process.stdout is not None
        try:
            raw = await asyncio.wait_for(self.process.stdout.readline(), within)
        except TimeoutError:
            raise AssertionError(f"no output from pid {self.pid} in {within} s") from None
        if not raw:
            assert self.process.stderr is not None
            error = (await self.process.stderr.read()).decode()
            raise AssertionError(f"pid {self.pid} ended ({await self.process.wait()}): {error}")
        return raw.decode().rstrip("\n")

    async def says_nothing_for(self, seconds: float) -> None:
        """Fail if it prints a line (or ends) within ``seconds``."""
        assert self.process.stdout is not None
        try:
            raw = await asyncio.wait_for(self.process.stdout.readline(), seconds)
        except TimeoutError:
            return
        raise AssertionError(f"pid {self.pid} printed {raw!r} (while it should wait)")

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    async def wait(self, within: float = 30.0) -> int:
        return await asyncio.wait_for(self.process.wait(), within)


Spawn = Callable[..., Awaitable[Child]]


@pytest.fixture
async def spawn(etcd: EtcdCluster) -> AsyncIterator[Spawn]:
    """``await spawn("etcdctl", *args)`` (the etcdctl of the etcd under test) or
    ``await spawn("ours", role, name)``; every process started is killed by pid at the end."""
    started: list[Child] = []

    async def start(what: str, *args: str) -> Child:
        env = _child_env("ETCDCTL_") | {"ETCDCTL_API": "3"}
        if what == "etcdctl":
            command = [find_etcdctl(etcd.binary), f"--endpoints={etcd.endpoint_string}", *args]
        else:
            command = [sys.executable, "-u", "-m", "tests.native_children", args[0]]
            command += [etcd.endpoint_string, *args[1:]]
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        started.append(Child(process))
        return started[-1]

    yield start
    for child in started:
        if child.process.returncode is None:
            child.process.kill()
        await child.wait()


@pytest.fixture
async def provider(etcd: EtcdCluster) -> AsyncIterator[EtcdLeaseProvider]:
    async with EtcdLeaseProvider(etcd.endpoints, timeout=5) as provider:
        yield provider


@pytest.fixture
def name() -> str:
    return f"interop-{uuid.uuid4().hex[:12]}"


async def queue(provider: EtcdLeaseProvider, name: str) -> list[pb.KeyValue]:
    """The keys of election or lock ``name`` as etcdctl lays them out, oldest first."""
    kvs = await provider.client.range_prefix(f"{name}/".encode())
    return sorted(kvs, key=lambda kv: kv.create_revision)


async def queued(provider: EtcdLeaseProvider, name: str, count: int) -> list[pb.KeyValue]:
    """Wait until ``count`` keys queue under ``name``; them, oldest first."""
    deadline = time.monotonic() + 30
    while len(kvs := await queue(provider, name)) != count:
        assert time.monotonic() < deadline, f"{count} keys under {name}/: got {len(kvs)}"
        await asyncio.sleep(0.02)
    return kvs


async def enqueued(provider: EtcdLeaseProvider, name: str, *, besides: str | None) -> pb.KeyValue:
    """Wait until a key other than ``besides`` queues under ``name`` (etcdctl's
    ``<name>/``, whatever our code does); it."""
    deadline = time.monotonic() + 30
    while not (kvs := [kv for kv in await queue(provider, name) if kv.key.decode() != besides]):
        assert time.monotonic() < deadline, f"no key under {name}/ besides {besides}"
        await asyncio.sleep(0.02)
    (kv,) = kvs
    return kv


async def test_our_key_is_etcds_layout(
    provider: EtcdLeaseProvider, spawn: Spawn, name: str
) -> None:
    """``<name>/<lease id hex>`` with the proposal, on the session lease: ``etcdctl elect
    --listen`` reports our leader and our proclaims."""
    election = NativeElection(provider, name, ttl_s=5)
    token = await election.campaign("ours", timeout=30)
    (kv,) = await queue(provider, name)
    lease = (await provider.client.time_to_live(kv.lease)).ID
    assert kv.key.decode() == f"{name}/{lease:x}" == election.key
    assert (kv.value, kv.create_revision) == (b"ours", token)
    assert await election.leader() == Leader("ours", f"{name}/{lease:x}", token)
    observer = await spawn("etcdctl", "elect", "--listen", name)
    assert [await observer.line(), await observer.line()] == [election.key, "ours"]
    await election.proclaim("ours, again")
    assert [await observer.line(), await observer.line()] == [election.key, "ours, again"]
    assert election.token == token  # a proclaim keeps the tenure
    await election.resign()
    assert await queue(provider, name) == []


async def test_etcdctl_leads_then_resigns_to_our_candidate(
    provider: EtcdLeaseProvider, spawn: Spawn, name: str
) -> None:
    theirs = await spawn("etcdctl", "elect", name, "theirs")
    their_key = await theirs.line()
    assert await theirs.line() == "theirs"
    election = NativeElection(provider, name, ttl_s=5)
    campaign = asyncio.create_task(election.campaign("ours"))
    first, second = await queued(provider, name, 2)
    assert first.key.decode() == their_key and second.key.decode() == election.key
    assert not campaign.done()
    assert await election.leader() == Leader("theirs", their_key, first.create_revision)
    theirs.signal(signal.SIGINT)  # etcdctl resigns on SIGINT
    token = await asyncio.wait_for(campaign, 30)
    assert await theirs.wait() == 0
    assert token == second.create_revision > first.create_revision
    await election.resign()


async def test_our_leader_resigns_to_etcdctl_and_etcdctl_waits_for_it(
    provider: EtcdLeaseProvider, spawn: Spawn, name: str
) -> None:
    election = NativeElection(provider, name, ttl_s=5)
    token = await election.campaign("ours", timeout=30)
    theirs = await spawn("etcdctl", "elect", name, "theirs")
    their_kv = await enqueued(provider, name, besides=election.key)
    await theirs.says_nothing_for(_WRONG_WINDOW_S)
    assert [kv.key.decode() for kv in await queue(provider, name)] == [
        election.key,
        their_kv.key.decode(),
    ]
    await election.resign()
    assert await theirs.line() == their_kv.key.decode()
    assert their_kv.create_revision > token


async def test_our_leader_killed_etcdctl_leads_once_its_lease_expires(
    provider: EtcdLeaseProvider, spawn: Spawn, name: str
) -> None:
    ours = await spawn("ours", "leader", name)
    _, token_text, our_key = (await ours.line()).split()
    our_kv = await provider.client.range(our_key.encode())
    assert our_kv is not None and our_kv.create_revision == int(token_text)
    theirs = await spawn("etcdctl", "elect", name, "theirs")
    their_kv = await enqueued(provider, name, besides=our_kv.key.decode())
    await theirs.says_nothing_for(_WRONG_WINDOW_S)
    ours.process.kill()
    await ours.wait()
    assert await theirs.line(within=30) == their_kv.key.decode()
    assert (await provider.client.time_to_live(our_kv.lease)).TTL == -1  # it expired first
    assert their_kv.create_revision > our_kv.create_revision


async def test_etcdctl_leader_killed_ours_leads_once_its_lease_ends(
    provider: EtcdLeaseProvider, spawn: Spawn, name: str
) -> None:
    """``etcdctl elect`` keeps its session 60 s (it has no --ttl): after its kill, ours
    waits while that lease lives, and leads once it ends (revoked here, as etcd does
    when it expires, rather than wait a minute)."""
    theirs = await spawn("etcdctl", "elect", name, "theirs")
    await theirs.line()
    election = NativeElection(provider, name, ttl_s=5)
    campaign = asyncio.create_task(election.campaign("ours"))
    their_kv, _ = await queued(provider, name, 2)
    theirs.process.kill()
    await theirs.wait()
    done, _ = await asyncio.wait([campaign], timeout=2)
    assert not done, "ours led while the killed leader's lease still lived"
    await provider.client.revoke(their_kv.lease)
    token = await asyncio.wait_for(campaign, 30)
    assert token > their_kv.create_revision
    await election.resign()


async def test_etcdctl_lock_excludes_ours_and_hands_it_over(
    provider: EtcdLeaseProvider, spawn: Spawn, name: str
) -> None:
    theirs = await spawn("etcdctl", "lock", name)
    their_key = await theirs.line()
    lock = NativeLock(provider, name, ttl_s=5)
    assert await lock.try_acquire() is None
    assert lock.key is None and [kv.key.decode() for kv in await queue(provider, name)] == [
        their_key
    ]  # try_acquire left the queue
    acquiring = asyncio.create_task(lock.acquire())
    their_kv, our_kv = await queued(provider, name, 2)
    assert not acquiring.done()
    theirs.signal(signal.SIGINT)  # etcdctl unlocks on SIGINT
    token = await asyncio.wait_for(acquiring, 30)
    assert await theirs.wait() == 0
    assert token == our_kv.create_revision > their_kv.create_revision
    assert our_kv.value == their_kv.value == b""
    await lock.release()


async def test_our_lock_excludes_etcdctl_and_hands_it_over(
    provider: EtcdLeaseProvider, spawn: Spawn, name: str
) -> None:
    tokens: list[int] = []
    for _ in range(2):  # a second round: tokens keep growing across holders
        lock = NativeLock(provider, name, ttl_s=5)
        async with asyncio.timeout(60), lock:
            assert lock.token is not None
            tokens.append(lock.token)
            theirs = await spawn("etcdctl", "lock", name)
            their_kv = await enqueued(provider, name, besides=lock.key)
            await theirs.says_nothing_for(_WRONG_WINDOW_S)
            assert [kv.create_revision for kv in await queue(provider, name)] == [
                lock.token,
                their_kv.create_revision,
            ]
        assert await theirs.line() == their_kv.key.decode()
        tokens.append(their_kv.create_revision)
        theirs.signal(signal.SIGINT)
        assert await theirs.wait() == 0
    assert tokens == sorted(set(tokens)), tokens  # strictly increasing


async def test_a_killed_holder_hands_the_lock_over_once_its_lease_expires(
    provider: EtcdLeaseProvider, spawn: Spawn, name: str
) -> None:
    """Both ways: etcdctl (``--ttl 2``) killed, ours takes it; ours killed, etcdctl does."""
    theirs = await spawn("etcdctl", "lock", "--ttl=2", name)
    await theirs.line()
    lock = NativeLock(provider, name, ttl_s=5)
    acquiring = asyncio.create_task(lock.acquire())
    their_kv, _ = await queued(provider, name, 2)
    theirs.process.kill()
    await theirs.wait()
    token = await asyncio.wait_for(acquiring, 30)
    assert (await provider.client.time_to_live(their_kv.lease)).TTL == -1
    assert token > their_kv.create_revision
    await lock.release()

    ours = await spawn("ours", "holder", name)
    _, token_text, our_key = (await ours.line()).split()
    our_kv = await provider.client.range(our_key.encode())
    assert our_kv is not None and our_kv.create_revision == int(token_text)
    theirs = await spawn("etcdctl", "lock", name)
    their_kv = await enqueued(provider, name, besides=our_kv.key.decode())
    await theirs.says_nothing_for(_WRONG_WINDOW_S)
    ours.process.kill()
    await ours.wait()
    assert await theirs.line(within=30) == their_kv.key.decode()
    assert (await provider.client.time_to_live(our_kv.lease)).TTL == -1
    assert token < our_kv.create_revision < their_kv.create_revision


async def test_our_locks_exclude_each_other_and_a_timeout_leaves_the_queue(
    provider: EtcdLeaseProvider, name: str
) -> None:
    first, second = NativeLock(provider, name, ttl_s=5), NativeLock(provider, name, ttl_s=5)
    token = await first.acquire(timeout=30)
    with pytest.raises(TimeoutError):
        await second.acquire(timeout=0.5)
    assert [kv.create_revision for kv in await queue(provider, name)] == [token]
    acquiring = asyncio.create_task(second.acquire())
    await queued(provider, name, 2)
    await first.release()
    assert first.lost.is_set()
    assert await asyncio.wait_for(acquiring, 30) > token
    second.check()
    await second.release()


async def test_observe_follows_etcdctls_leaders(
    provider: EtcdLeaseProvider, spawn: Spawn, name: str
) -> None:
    election = NativeElection(provider, name)
    assert await election.leader() is None
    async with contextlib.aclosing(election.observe()) as leaders:
        assert await anext(leaders) is None
        first = await spawn("etcdctl", "elect", name, "first")
        first_key = await first.line()
        seen = await asyncio.wait_for(anext(leaders), 30)
        assert seen is not None and (seen.key, seen.value) == (first_key, "first")
        second = await spawn("etcdctl", "elect", name, "second")
        await queued(provider, name, 2)
        first.signal(signal.SIGINT)
        seen = await asyncio.wait_for(anext(leaders), 30)
        assert seen is not None and (seen.key, seen.value) == (await second.line(), "second")
        second.signal(signal.SIGINT)
        assert await asyncio.wait_for(anext(leaders), 30) is None


async def test_a_candidate_whose_key_went_while_it_waited_does_not_lead(
    etcd: EtcdCluster, provider: EtcdLeaseProvider, spawn: Spawn, name: str
) -> None:
    """Our key deleted (or its lease expired) while etcdctl led: when etcdctl resigns,
    ours must not lead, since a candidate arriving then would lead too."""
    theirs = await spawn("etcdctl", "elect", name, "theirs")
    await theirs.line()
    election = NativeElection(provider, name, ttl_s=5)
    campaign = asyncio.create_task(election.campaign("ours", timeout=30))
    _, our_kv = await queued(provider, name, 2)
    etcd.etcdctl("del", our_kv.key.decode())
    theirs.signal(signal.SIGINT)
    with pytest.raises(LeaseLost):
        await campaign
    assert await queue(provider, name) == []


async def test_deleting_the_key_ends_the_tenure(
    etcd: EtcdCluster, provider: EtcdLeaseProvider, name: str
) -> None:
    election = NativeElection(provider, name, ttl_s=5)
    await election.campaign("ours", timeout=30)
    key = election.key
    assert key is not None
    etcd.etcdctl("del", key)
    await eventually(election.lost.is_set, "leadership lost")
    assert election.key is None
    lease_id = int(key.rsplit("/", 1)[1], 16)
    assert not provider._keepalive.is_kept(lease_id)  # left to expire, not renewed for ever
    with pytest.raises(LeaseLost, match="deleted"):
        election.check()
    await election.resign()


@pytest.mark.parametrize("kind", [NativeElection, NativeLock])
async def test_bad_arguments_are_refused_before_anything_is_sent(
    provider: EtcdLeaseProvider, kind: type[NativeElection | NativeLock]
) -> None:
    with pytest.raises(LeaseValueError, match="name"):
        kind(provider, "")
    with pytest.raises(LeaseTypeError, match="ttl_s"):
        kind(provider, "x", ttl_s=1.5)  # type: ignore[arg-type]
    with pytest.raises(LeaseValueError, match="ttl_s"):
        kind(provider, "x", ttl_s=0)


async def test_a_bad_proposal_is_refused_before_anything_is_sent(
    provider: EtcdLeaseProvider, name: str
) -> None:
    election = NativeElection(provider, name)
    with pytest.raises(LeaseValueError, match="value"):
        await election.campaign("")
    with pytest.raises(LeaseValueError, match="value"):
        await election.campaign("\ud800")  # not encodable as UTF-8
    assert election.key is None and await queue(provider, name) == []
