"""``etcd-leases`` refuses bad input up front, in one line, and keeps to its timeouts."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from etcd_leases.testing import EtcdCluster, free_ports
from tests.cli import cli_env, run_cli
from tests.conftest import enable_auth, unique_prefix


def refused_in_one_line(args: list[str], bad: str) -> None:
    # A minute per etcd call: a refusal comes before anything is asked of etcd.
    (port,) = free_ports(1)
    env = {**cli_env(), "ETCDCTL_ENDPOINTS": f"127.0.0.1:{port}"}  # nothing listens there
    done = run_cli(*args, "--command-timeout", "60s", env=env, timeout=20)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert bad in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "bad"),
    [
        (["owner", "k", "--endpoints", "bad host:99"], "'bad host:99'"),
        (["acquire", "k", "alice", "--ttl", "0"], "'0'"),
        (["acquire", "k", "alice", "--ttl", "-5s"], "'-5s'"),
        (["run", "k", "--metrics-port", "99999", "--", "true"], "'99999'"),
        (["run", "job", "echo", "hi"], "'echo hi'"),
        (["elect", "e", "sleep", "1"], "'sleep 1'"),
    ],
)
def test_bad_input_is_refused_in_one_line_naming_it(args: list[str], bad: str) -> None:
    refused_in_one_line(args, bad)


def test_a_tls_file_that_is_not_pem_is_refused(tmp_path: Path) -> None:
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("hello\n")
    refused_in_one_line(["owner", "k", "--cacert", str(not_pem)], f"--cacert {not_pem}")
    refused_in_one_line(["owner", "k", "--cert", str(not_pem), "--key", str(not_pem)], "--cert")


def test_a_metrics_port_in_use_is_named(etcd: EtcdCluster) -> None:
    env = cli_env(etcd, unique_prefix())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("run", "job", "--metrics-port", str(port), "--", "true", env=env)
    assert done.returncode == 2, done.stderr
    assert f"127.0.0.1:{port}" in done.stderr and "in use" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert run_cli("owner", "job", env=env).returncode == 1  # no lease was taken


@pytest.mark.parametrize(
    "args", [["acquire", "k", "alice"], ["list"], ["run", "k", "--", "true"]], ids=lambda a: a[0]
)
def test_command_timeout_bounds_the_whole_command(etcd_binary: str, args: list[str]) -> None:
    """Against a frozen etcd, each call waits its timeout: before, a command of
    several (the server's version, a grant, the transaction) took a multiple."""
    timeout = 4
    with EtcdCluster(1, binary=etcd_binary) as frozen:
        frozen.members[0].pause()
        started = time.monotonic()
        flags = ["--command-timeout", f"{timeout}s"]  # before run's "--"
        done = run_cli(args[0], *flags, *args[1:], env=cli_env(frozen))
        took = time.monotonic() - started
    print(f"{args[0]} against a frozen etcd, --command-timeout {timeout}s: {took:.1f} s")
    assert done.returncode == 3, done.stderr
    assert f"within --command-timeout {timeout} s" in done.stderr
    # Python's start-up on a loaded machine, not another timeout.
    assert took < timeout + 3


def test_dial_timeout_bounds_connecting() -> None:
    (port,) = free_ports(1)
    args = ["owner", "k", "--endpoints", f"127.0.0.1:{port}", "--command-timeout", "60s"]
    done = run_cli(*args, "--dial-timeout", "1s", env=cli_env(), timeout=30)
    assert done.returncode == 3, done.stderr
    assert f"could not connect to 127.0.0.1:{port} within --dial-timeout 1 s" in done.stderr


def test_password_apart_from_the_user_as_etcdctl_takes_it(etcd_binary: str) -> None:
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        enable_auth(etcd)
        env = cli_env(etcd, "/allowed/")
        flags = run_cli("acquire", "k", "alice", "--user", "app", "--password", "apppw", env=env)
        assert flags.returncode == 0, flags.stderr
        variables = {**env, "ETCDCTL_USER": "app", "ETCDCTL_PASSWORD": "apppw"}
        assert run_cli("owner", "k", env=variables).stdout == "alice\n"
        wrong = run_cli("owner", "k", "--user", "app", "--password", "wrong", env=env)
        assert wrong.returncode == 4
        no_user = run_cli("owner", "k", "--password", "apppw", env=env)
        assert no_user.returncode == 2 and "--user" in no_user.stderr
