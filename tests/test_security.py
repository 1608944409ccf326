"""TLS and username/password auth, each against a real etcd started with them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from etcd_leases import Election, EtcdLeaseProvider, HeldLease, LeaseError, PermissionDenied
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.txn import Txn, put
from etcd_leases.etcd.watch import WatchStream
from etcd_leases.testing import EtcdCluster
from tests.conftest import enable_auth, eventually


async def test_tls_with_client_certificates(etcd_binary: str) -> None:
    with EtcdCluster(1, binary=etcd_binary, tls=True, client_cert_auth=True) as etcd:
        async with EtcdLeaseProvider(
            etcd.endpoints, ca_cert=etcd.ca_cert, cert=etcd.client_cert, key=etcd.client_key
        ) as provider:
            assert (await provider.acquire_lease("k", "alice", 5000)).acquired
            assert await provider.get_lease_owner("k") == "alice"
        # https:// URLs work the same; without a client certificate etcd refuses us.
        async with EtcdLeaseProvider(
            etcd.client_urls, ca_cert=etcd.ca_cert, timeout=1.0
        ) as no_cert:
            with pytest.raises(LeaseError):
                await no_cert.get_lease_owner("k")
        # Plain text to a TLS port fails as a LeaseError too, not a raw gRPC error.
        async with EtcdLeaseProvider(etcd.endpoints, timeout=1.0) as plain:
            with pytest.raises(LeaseError):
                await plain.get_lease_owner("k")


async def test_tls_files_from_etcdctl_variables(
    etcd_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``from_env`` takes the endpoints and the three TLS files from etcdctl's variables."""
    with EtcdCluster(1, binary=etcd_binary, tls=True, client_cert_auth=True) as etcd:
        monkeypatch.setenv("ETCDCTL_ENDPOINTS", ",".join(etcd.client_urls))
        monkeypatch.setenv("ETCDCTL_CACERT", etcd.ca_cert)
        monkeypatch.setenv("ETCDCTL_CERT", etcd.client_cert)
        monkeypatch.setenv("ETCDCTL_KEY", etcd.client_key)
        async with EtcdLeaseProvider.from_env() as provider:
            assert (await provider.acquire_lease("k", "alice", 5000)).acquired
            assert await provider.get_lease_owner("k") == "alice"
        # Without the CA the server is not trusted; without cert and key etcd refuses us.
        for missing in (["ETCDCTL_CACERT"], ["ETCDCTL_CERT", "ETCDCTL_KEY"]):
            with monkeypatch.context() as without:
                for variable in missing:
                    without.delenv(variable)
                async with EtcdLeaseProvider.from_env(timeout=1.0) as refused:
                    with pytest.raises(LeaseError):
                        await refused.get_lease_owner("k")


@pytest.fixture
def auth_etcd(etcd_binary: str) -> Iterator[EtcdCluster]:
    """etcd with auth on, tokens living one second, and a user limited to /allowed/."""
    with EtcdCluster(1, binary=etcd_binary, extra_args=["--auth-token-ttl=1"]) as etcd:
        enable_auth(etcd)
        yield etcd


async def test_auth_with_password(auth_etcd: EtcdCluster) -> None:
    async with EtcdLeaseProvider(
        auth_etcd.endpoints, username="app", password="apppw", prefix="/allowed/"
    ) as provider:
        first = await provider.acquire_lease("k", "alice", 5000)
        assert first.acquired
        # Simple tokens expire (1 s here): the client logs in again and replays.
        await asyncio.sleep(2.5)
        assert await provider.get_lease_owner("k") == "alice"
        assert await provider.renew_lease("k", "alice", 5000)
        await provider.release_lease("k", "alice")
        assert await provider.get_lease_owner("k") is None


async def test_user_and_prefix_from_etcdctl_variables(
    auth_etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``from_env`` logs in as ``ETCDCTL_USER`` (``name:password``, the password may hold
    a colon) under ``ETCD_LEASES_PREFIX``; keyword arguments win over the variables."""
    root = "--user=root:rootpw"
    auth_etcd.etcdctl(root, "user", "add", "colon", "--new-user-password=a:pw")
    auth_etcd.etcdctl(root, "user", "grant-role", "colon", "app")
    monkeypatch.setenv("ETCDCTL_ENDPOINTS", auth_etcd.endpoint_string)
    monkeypatch.setenv("ETCDCTL_USER", "colon:a:pw")
    monkeypatch.setenv("ETCD_LEASES_PREFIX", "/allowed/")
    async with EtcdLeaseProvider.from_env(timeout=2.0) as provider:
        assert provider.prefix == "/allowed/"
        assert (await provider.acquire_lease("k", "alice", 5000)).acquired
        assert await provider.get_lease_owner("k") == "alice"
    async with EtcdLeaseProvider.from_env(prefix="/elsewhere/", timeout=2.0) as outside:
        with pytest.raises(PermissionDenied):
            await outside.get_lease_owner("k")
    monkeypatch.setenv("ETCDCTL_USER", "colon:a")
    async with EtcdLeaseProvider.from_env(timeout=2.0) as wrong_password:
        with pytest.raises(PermissionDenied):
            await wrong_password.get_lease_owner("k")


async def test_auth_refusals_are_permission_denied(auth_etcd: EtcdCluster) -> None:
    async with EtcdLeaseProvider(
        auth_etcd.endpoints, username="app", password="wrong", timeout=2.0
    ) as wrong_password:
        with pytest.raises(PermissionDenied):
            await wrong_password.get_lease_owner("k")
    async with EtcdLeaseProvider(auth_etcd.endpoints, timeout=2.0) as anonymous:
        with pytest.raises(PermissionDenied):
            await anonymous.get_lease_owner("k")
    async with EtcdLeaseProvider(
        auth_etcd.endpoints, username="app", password="apppw", prefix="/elsewhere/", timeout=2.0
    ) as outside:
        with pytest.raises(PermissionDenied):
            await outside.acquire_lease("k", "alice", 5000)
    # The refused attempt's lease went back to the pool, revoked when it closed.
    root_view = auth_etcd.etcdctl("--user=root:rootpw", "lease", "list")
    assert root_view.strip().endswith("found 0 leases")


async def test_election_run_ends_on_refused_credentials(auth_etcd: EtcdCluster) -> None:
    """As Election.run's docstring says: it waits out an unreachable etcd, but refused
    credentials (or a seat outside the user's permissions) end it with their error."""
    terms: list[HeldLease] = []
    leaders: list[str | None] = []

    async def lead(lease: HeldLease) -> None:
        terms.append(lease)

    async with EtcdLeaseProvider(
        auth_etcd.endpoints, username="app", password="wrong", prefix="/allowed/", timeout=2.0
    ) as wrong_password:
        election = Election(wrong_password, "seat", "alice", 5000)
        with pytest.raises(PermissionDenied):
            await asyncio.wait_for(election.run(lead, on_new_leader=leaders.append), 10)
    async with EtcdLeaseProvider(
        auth_etcd.endpoints, username="app", password="apppw", prefix="/elsewhere/", timeout=2.0
    ) as outside:
        election = Election(outside, "seat", "alice", 5000)
        with pytest.raises(PermissionDenied):
            await asyncio.wait_for(election.run(lead), 10)
    assert not terms and not leaders


async def test_a_watch_ends_when_its_credentials_are_refused_on_reopening(
    etcd_binary: str,
) -> None:
    """A watch stream that breaks is reopened on another member, logging in there; when
    etcd then refuses the credentials (the user was deleted meanwhile), retrying cannot
    help: the watch ends with ``PermissionDenied`` instead of retrying for ever."""
    with EtcdCluster(3, binary=etcd_binary) as etcd:
        enable_auth(etcd)
        root = "--user=root:rootpw"
        etcd.etcdctl(root, "user", "add", "watcher", "--new-user-password=pw")
        etcd.etcdctl(root, "user", "grant-role", "watcher", "app")
        async with (
            EtcdLeaseProvider(
                etcd.endpoints, username="watcher", password="pw", prefix="/allowed/"
            ) as watching,
            EtcdLeaseProvider(
                etcd.endpoints, username="app", password="apppw", prefix="/allowed/"
            ) as writing,
        ):
            changes = watching.watch_owner("k")  # read, then watched, on the first member
            assert (await anext(changes)).owner is None
            await writing.acquire_lease("k", "alice", 30_000)
            assert (await asyncio.wait_for(anext(changes), 10)).owner == "alice"
            etcd.etcdctl(root, "user", "delete", "watcher")
            etcd.members[0].kill()
            with pytest.raises(PermissionDenied):
                await asyncio.wait_for(anext(changes), 20)
            await changes.aclose()


async def test_with_auth_calls_move_past_a_killed_member(etcd_binary: str) -> None:
    """A member failure with auth on is a member failure still (not a refused token):
    the call moves on, logging in on the next member."""
    with EtcdCluster(3, binary=etcd_binary) as etcd:
        enable_auth(etcd)
        async with EtcdLeaseProvider(
            etcd.endpoints, username="app", password="apppw", prefix="/allowed/", timeout=5.0
        ) as provider:
            assert (await provider.acquire_lease("k", "alice", 10_000)).acquired
            etcd.members[0].kill()  # the member the provider logged in on
            assert await provider.get_lease_owner("k") == "alice"
            assert await provider.transfer_lease("k", "alice", "bob", 10_000)


async def test_a_login_on_a_frozen_member_costs_a_call_only_its_share(etcd_binary: str) -> None:
    """A member that froze after its connection came up, when the client must log in on
    it again (its token refused, as a renewal stream's may be): the login waits for the
    attempt's share of the timeout, not for all of it, so the call moves on and answers.
    Decided by the answer: a login waiting out the whole timeout leaves none to move on."""
    with EtcdCluster(3, binary=etcd_binary) as etcd:
        enable_auth(etcd)
        client = EtcdClient(etcd.endpoints, timeout=3.0, username="app", password="apppw")
        try:
            assert await client.range(b"/allowed/k") is None  # logged in on members[0]
            etcd.members[0].pause()
            client.auth.invalidate(0)
            assert await client.range(b"/allowed/k") is None
            assert client.members.preferred() != 0
        finally:
            etcd.members[0].resume()
            await client.close()


async def test_a_watch_logging_in_on_a_frozen_member_moves_on_within_its_share(
    etcd_binary: str,
) -> None:
    """The watch stream's login too waits only a create's share of the timeout (a third,
    with three members). Decided by order, not by seconds: a transaction (never retried)
    sent on the frozen member first fails at the whole timeout, after the watch, begun
    later, has moved to another member and been created there."""
    with EtcdCluster(3, binary=etcd_binary) as etcd:
        enable_auth(etcd)
        client = EtcdClient(etcd.endpoints, timeout=3.0, username="app", password="apppw")
        stream = WatchStream(client)
        try:
            await client.range(b"/allowed/k")  # logged in on members[0]
            etcd.members[0].pause()
            client.auth.invalidate(0)
            stuck = asyncio.ensure_future(
                client.txn(Txn.when().then(put(b"/allowed/t", b"")).request)
            )
            await asyncio.sleep(0.2)
            watcher = stream.watch(b"/allowed/k", client.revision_seen + 1)
            await eventually(lambda: watcher.registered, "the watch created elsewhere")
            assert not stuck.done()
            with pytest.raises(LeaseError):
                await stuck
        finally:
            etcd.members[0].resume()
            await stream.close()
            await client.close()
