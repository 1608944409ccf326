"""The CLI against an etcd that serves TLS and wants client certificates (issue 20):
the files given as flags or as etcdctl's variables are used, and nothing else gets in."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from etcd_leases.testing import EtcdCluster
from tests.cli import cli_env, json_of, run_cli


@pytest.fixture(scope="module")
def tls_etcd() -> Iterator[EtcdCluster]:
    with EtcdCluster(1, tls=True, client_cert_auth=True) as cluster:
        yield cluster


def test_tls_files_as_flags(tls_etcd: EtcdCluster) -> None:
    env = cli_env(tls_etcd, prefix="/tls-flags/")
    files = ["--cacert", tls_etcd.ca_cert, "--cert", tls_etcd.client_cert]
    files += ["--key", tls_etcd.client_key]
    done = run_cli("acquire", "k", "alice", "--ttl", "30s", "--json", *files, env=env)
    assert done.returncode == 0, done.stderr
    assert json_of(done)["acquired"] is True
    done = run_cli("owner", "k", *files, env=env)
    assert (done.returncode, done.stdout.strip()) == (0, "alice"), done.stderr


def test_tls_files_from_etcdctl_variables(tls_etcd: EtcdCluster) -> None:
    env = cli_env(tls_etcd, prefix="/tls-env/")
    env["ETCDCTL_CACERT"] = tls_etcd.ca_cert
    env["ETCDCTL_CERT"] = tls_etcd.client_cert
    env["ETCDCTL_KEY"] = tls_etcd.client_key
    done = run_cli("acquire", "k", "bob", "--ttl", "30s", env=env)
    assert done.returncode == 0, done.stderr
    done = run_cli("owner", "k", env=env)
    assert (done.returncode, done.stdout.strip()) == (0, "bob"), done.stderr


def test_without_a_client_certificate_nothing_gets_in(tls_etcd: EtcdCluster) -> None:
    env = cli_env(tls_etcd, prefix="/tls-none/")
    done = run_cli("owner", "k", "--cacert", tls_etcd.ca_cert, "--command-timeout", "3s", env=env)
    assert done.returncode == 3 and done.stdout == ""
    # Only the command's own line: not gRPC's C core logging each refused handshake.
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("etcd-leases: etcd: UNAVAILABLE"), done.stderr


def test_grpc_logs_only_when_the_user_asks(tls_etcd: EtcdCluster) -> None:
    # gRPC's C core logs at DEBUG whatever happens (at ERROR, only a handshake it saw
    # fail in time: not every run); the user's GRPC_VERBOSITY is theirs to keep.
    env = cli_env(tls_etcd, prefix="/tls-none/") | {"GRPC_VERBOSITY": "DEBUG"}
    done = run_cli("owner", "k", "--cacert", tls_etcd.ca_cert, "--command-timeout", "2s", env=env)
    assert done.returncode == 3
    lines = done.stderr.strip().splitlines()
    assert len(lines) > 1 and lines[-1].startswith("etcd-leases: etcd: UNAVAILABLE")
