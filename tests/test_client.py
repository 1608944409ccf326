"""The etcd client's own promises: a revoke says whether the lease was still there;
closing the client under a call ends it with ``ProviderClosed`` in its words, at once,
and a caller's own cancel stays a cancel."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import pytest

from etcd_leases import BackendUnavailable, LeaseValueError, ProviderClosed
from etcd_leases.etcd import client as client_module
from etcd_leases.etcd.backoff import Backoff
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.lease_ids import new_lease_id
from etcd_leases.etcd.txn import Txn, put
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.testing import EtcdCluster, free_ports

KEY = b"close-test"


async def test_a_revoke_says_whether_etcd_still_had_the_lease(client: EtcdClient) -> None:
    lease_id = new_lease_id()
    await client.grant(5, lease_id)
    assert await client.revoke(lease_id) is True
    assert await client.revoke(lease_id) is False  # gone already: no error either
    assert (await client.time_to_live(lease_id)).TTL == -1


async def test_a_grant_sent_again_finds_the_lease_its_first_copy_made(
    client: EtcdClient,
) -> None:
    """As after a lost answer: the same ID again is the lease granted, at its TTL."""
    lease_id = new_lease_id()
    granted = await client.grant(5, lease_id)
    try:
        assert await client.grant(5, lease_id) == granted
        assert await client.grant(granted + 4, lease_id) == granted  # the first one's
    finally:
        await client.revoke(lease_id)


@pytest.fixture
def frozen(etcd_binary: str) -> Iterator[EtcdCluster]:
    """A one-member cluster of the test's own; the test freezes it."""
    with EtcdCluster(1, binary=etcd_binary) as cluster:
        try:
            yield cluster
        finally:
            if cluster.members[0].paused:
                cluster.members[0].resume()


async def in_flight(cluster: EtcdCluster) -> tuple[EtcdClient, asyncio.Task[object]]:
    """A client whose call waits on the frozen member (its version read before)."""
    client = EtcdClient(cluster.endpoints, timeout=10)
    await client.range(KEY)  # connected, the server's version known
    cluster.members[0].pause()
    call = asyncio.ensure_future(client.range(KEY))
    await asyncio.sleep(0.3)  # sent; the member will not answer it
    assert not call.done()
    return client, call


async def test_a_call_cut_short_by_the_close_says_so(frozen: EtcdCluster) -> None:
    client, call = await in_flight(frozen)
    await client.close()
    with pytest.raises(ProviderClosed, match=r"^the provider is closed$"):
        await call
    with pytest.raises(ProviderClosed, match=r"^the provider is closed$"):
        await client.range(KEY)  # and any call after it, at once


async def test_a_cancelled_caller_stays_cancelled_when_the_client_closes(
    frozen: EtcdCluster,
) -> None:
    client, call = await in_flight(frozen)
    call.cancel()
    await client.close()  # gRPC cancels the call too: still the caller's cancel
    await asyncio.wait([call])
    assert call.cancelled()


async def test_a_call_backing_off_when_the_client_closes_ends_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (port,) = free_ports(1)  # nothing listens: each attempt fails at once, then waits
    client = EtcdClient([f"127.0.0.1:{port}"], timeout=10)
    failed = asyncio.Event()
    member_failed = client.members.failed

    def failing(index: int, *, no_leader: bool = False) -> int:
        failed.set()
        return member_failed(index, no_leader=no_leader)

    monkeypatch.setattr(client.members, "failed", failing)
    call = asyncio.ensure_future(client.range(KEY))
    await failed.wait()
    await client.close()  # while the call waits to try again
    with pytest.raises(ProviderClosed, match=r"^the provider is closed$"):
        await call


async def test_a_call_tries_again_at_a_doubling_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    """20 ms after the first failed attempt, doubling up to 0.5 s, until the timeout;
    each call at its own pace (the member-list read the first call starts has one)."""
    paces: list[list[float]] = []

    class RecordedBackoff(Backoff):
        def __init__(self, first_s: float, max_s: float) -> None:
            super().__init__(first_s, max_s)
            self.waits: list[float] = []
            paces.append(self.waits)

        def failed(self) -> float:
            self.waits.append(super().failed())
            return self.waits[-1]

    monkeypatch.setattr(client_module, "Backoff", RecordedBackoff)
    (port,) = free_ports(1)  # nothing listens: each attempt fails at once
    client = EtcdClient([f"127.0.0.1:{port}"], timeout=4.0)
    try:
        with pytest.raises(BackendUnavailable):
            await client.range(KEY)
    finally:
        await client.close()
    assert paces
    for waits in paces:
        assert waits[:6] == [0.02, 0.04, 0.08, 0.16, 0.32, 0.5]
        assert set(waits[6:]) == {0.5}


NO_SECONDS = "must be a positive number of seconds"


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"timeout": 0}, f"timeout {NO_SECONDS}, got 0"),
        ({"timeout": -1.5}, f"timeout {NO_SECONDS}, got -1.5"),
        ({"timeout": float("nan")}, f"timeout {NO_SECONDS}, got nan"),
        ({"cert": "c.pem"}, "cert and key must be given together"),
        ({"key": "k.pem"}, "cert and key must be given together"),
        ({"username": "u"}, "username and password must be given together"),
        ({"password": "p"}, "username and password must be given together"),
        ({"username": "", "password": "p"}, "username must not be empty"),
        ({"member_sync_interval": 0}, f"member_sync_interval {NO_SECONDS} or None, got 0"),
        ({"member_sync_interval": -2}, f"member_sync_interval {NO_SECONDS} or None, got -2"),
    ],
)
def test_a_bad_setting_is_refused_in_its_own_words(options: dict[str, Any], words: str) -> None:
    settings: dict[str, Any] = {"timeout": 1.0} | options
    with pytest.raises(LeaseValueError, match=f"^{re.escape(words)}$"):
        EtcdClient("127.0.0.1:2379", **settings)


async def test_a_new_client_has_seen_nothing_yet() -> None:
    """The least settings are taken (any positive seconds; no member sync at all)."""
    for interval in (0.001, None):
        client = EtcdClient("127.0.0.1:2379", timeout=0.001, member_sync_interval=interval)
        assert client.timeout == 0.001
        assert client.server_version is None and client.revision_seen == 0
        assert client.keepalive_observers == [] and not client.closed
        await client.close()


async def test_a_ca_file_alone_means_tls_to_plain_endpoints(etcd_binary: str) -> None:
    """``host:port`` endpoints (no scheme) speak TLS when only the CA is given."""
    with EtcdCluster(1, binary=etcd_binary, tls=True) as etcd:
        client = EtcdClient(etcd.endpoints, timeout=2.0, ca_cert=etcd.ca_cert)
        try:
            lease_id = new_lease_id()
            await client.grant(5, lease_id)
            assert await client.revoke(lease_id) is True
        finally:
            await client.close()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_an_answer_past_grpcs_default_size_limit_arrives(etcd_binary: str, tls: bool) -> None:
    """etcd does not cap what it sends (a large range, a watch replaying history): an
    answer past gRPC's 4 MiB default must arrive, on plain and TLS channels alike."""
    with EtcdCluster(1, binary=etcd_binary, tls=tls) as etcd:
        client = EtcdClient(etcd.endpoints, timeout=10.0, ca_cert=etcd.ca_cert if tls else None)
        try:
            value = b"x" * 1_000_000  # under etcd's 1.5 MiB limit on a request
            for i in range(5):
                await client.txn(Txn.when().then(put(b"big/%d" % i, value)).request)
            assert [len(kv.value) for kv in await client.range_prefix(b"big/")] == [len(value)] * 5
        finally:
            await client.close()


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``reader`` to ``writer``; the first bytes ``delay`` seconds late."""
    try:
        while chunk := await reader.read(65536):
            await asyncio.sleep(delay)
            delay = 0.0
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def test_a_transaction_that_never_left_goes_to_another_member(etcd: EtcdCluster) -> None:
    """A transaction is sent once: when its answer is lost its outcome is unknown. One
    gRPC failed before sending it (no connection to the member: "failed to connect to
    all addresses") never reached etcd, and goes to the next member. It failed at once
    before: a hold then took its put for one that may have landed, and left the key
    to its TTL, for a member that was down."""
    (nobody,) = free_ports(1)
    client = EtcdClient(
        [f"127.0.0.1:{nobody}", *etcd.endpoints], timeout=5, member_sync_interval=None
    )
    key = KEY + b"-never-left"
    put = pb.RequestOp(request_put=pb.PutRequest(key=key, value=b"once"))
    try:
        assert (await client.txn(pb.TxnRequest(success=[put]))).succeeded
        kv = await client.range(key)
        assert kv is not None and kv.version == 1
    finally:
        await client.call(
            "/etcdserverpb.KV/DeleteRange", pb.DeleteRangeRequest(key=key), pb.DeleteRangeResponse
        )
        await client.close()


async def test_a_member_slow_to_set_up_a_connection_answers_the_first_call(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd's first bytes on each connection come 0.5 s late (a loaded host, a distant
    one, TLS over a long link): the first call is answered on its first attempt. gRPC
    gave a connection attempt 0.1 s (``grpc.min_reconnect_backoff_ms``, its minimum
    connect timeout), so each new connection failed its first calls, as "connection
    attempt timed out before receiving SETTINGS frame"."""
    host, port = etcd.endpoints[0].rsplit(":", 1)

    async def slow_link(to_client: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        from_server, server = await asyncio.open_connection(host, int(port))
        await asyncio.gather(_relay(to_client, server, 0.0), _relay(from_server, client, 0.5))

    proxy = await asyncio.start_server(slow_link, "127.0.0.1", 0)
    client = EtcdClient(
        [f"127.0.0.1:{proxy.sockets[0].getsockname()[1]}"], timeout=5, member_sync_interval=None
    )
    paths: list[str] = []
    attempt = client._attempt

    async def noted(index: int, path: str, *args: Any) -> Any:
        paths.append(path)
        return await attempt(index, path, *args)

    monkeypatch.setattr(client, "_attempt", noted)
    try:
        assert await client.range(KEY) is None
        assert paths.count("/etcdserverpb.KV/Range") == 1, paths
    finally:
        await client.close()
        proxy.close()
