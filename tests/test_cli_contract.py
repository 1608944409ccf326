"""``etcd-leases`` contract calls, list and watch, and its errors, against a real etcd."""

from __future__ import annotations

import pytest

from etcd_leases.testing import EtcdCluster, free_ports
from tests.cli import cli_env, json_of, run_cli, running
from tests.conftest import enable_auth, unique_prefix


def test_contract_calls_and_their_exit_codes(etcd: EtcdCluster) -> None:
    env = cli_env(etcd, unique_prefix())

    acquired = run_cli("acquire", "job:1", "alice", "--ttl", "30s", "--json", env=env)
    assert acquired.returncode == 0, acquired.stderr
    first = json_of(acquired)
    assert first["acquired"] is True and first["owner"] == "alice" and first["ttl_ms"] == 30_000
    assert isinstance(first["token"], int)

    held = run_cli("acquire", "job:1", "bob", "--json", env=env)
    assert held.returncode == 1
    assert json_of(held) == {
        "key": "job:1",
        "acquired": False,
        "owner": "alice",
        "token": None,
        "ttl_ms": None,
    }
    assert run_cli("acquire", "job:1", "bob", env=env).stdout == "job:1: held by alice\n"

    owner = run_cli("owner", "job:1", env=env)
    assert (owner.returncode, owner.stdout) == (0, "alice\n")
    free = run_cli("owner", "nothing", "--json", env=env)
    assert (free.returncode, json_of(free)) == (1, {"key": "nothing", "owner": None})

    assert run_cli("renew", "job:1", "bob", env=env).returncode == 1
    assert run_cli("renew", "job:1", "alice", "--ttl", "30s", env=env).returncode == 0

    assert run_cli("transfer", "job:1", "bob", "carol", env=env).returncode == 1
    moved = run_cli("transfer", "job:1", "alice", "bob", "--json", env=env)
    assert moved.returncode == 0
    assert json_of(moved) == {"key": "job:1", "transferred": True, "owner": "bob"}
    assert run_cli("owner", "job:1", env=env).stdout == "bob\n"

    version = run_cli("--version", env=env)
    assert version.returncode == 0 and version.stdout.startswith("etcd-leases ")

    # The shared flags may come before the command name too, as etcdctl's do.
    env_without = {k: v for k, v in env.items() if k != "ETCDCTL_ENDPOINTS"}
    first = run_cli(
        "--endpoints", etcd.endpoint_string, "--json", "owner", "job:1", env=env_without
    )
    assert json_of(first) == {"key": "job:1", "owner": "bob"}

    # Release is the contract's no-op for a non-owner, and says whether it released.
    not_owner = run_cli("release", "job:1", "alice", env=env)
    assert not_owner.returncode == 0
    assert not_owner.stdout == "job:1: not held by alice; nothing to release\n"
    assert run_cli("owner", "job:1", env=env).stdout == "bob\n"
    released = run_cli("release", "job:1", "bob", "--json", env=env)
    assert released.returncode == 0
    assert json_of(released) == {"key": "job:1", "owner": "bob", "released": True}
    assert run_cli("owner", "job:1", env=env).returncode == 1
    again = run_cli("release", "job:1", "bob", "--json", env=env)
    assert json_of(again) == {"key": "job:1", "owner": "bob", "released": False}
    assert run_cli("acquire", "job:1", "bob", env=env).returncode == 0
    assert run_cli("release", "job:1", "bob", env=env).stdout == "job:1: released by bob\n"


def test_list_shows_owner_token_and_ttl_left(etcd: EtcdCluster) -> None:
    env = cli_env(etcd, unique_prefix())
    token_a = json_of(run_cli("acquire", "job:a", "alice", "--ttl", "60s", "--json", env=env))
    token_b = json_of(run_cli("acquire", "job:b", "bob", "--ttl", "60s", "--json", env=env))
    run_cli("acquire", "other", "carol", env=env)

    listed = run_cli("list", "job:", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = json_of(listed)
    assert [(r["key"], r["owner"], r["token"]) for r in rows] == [
        ("job:a", "alice", token_a["token"]),
        ("job:b", "bob", token_b["token"]),
    ]
    assert all(50 <= r["ttl_s"] <= 60 for r in rows)

    table = run_cli("list", env=env).stdout.splitlines()
    assert table[0].split() == ["KEY", "OWNER", "TOKEN", "TTL"]
    assert [line.split()[:2] for line in table[1:]] == [
        ["job:a", "alice"],
        ["job:b", "bob"],
        ["other", "carol"],
    ]


def test_watch_prints_the_owners_then_each_change(etcd: EtcdCluster) -> None:
    env = cli_env(etcd, unique_prefix())
    run_cli("acquire", "job:1", "alice", env=env)
    with running(["watch", "job:", "--json"], env=env) as (watch,):
        first = watch.event()  # the state when the watch began
        assert (first["event"], first["key"], first["owner"]) == ("owner", "job:1", "alice")
        run_cli("acquire", "other", "zed", env=env)  # outside job:, not shown
        run_cli("transfer", "job:1", "alice", "bob", env=env)
        moved = watch.event()
        assert (moved["key"], moved["owner"]) == ("job:1", "bob")
        assert moved["token"] > first["token"]
        run_cli("acquire", "job:2", "carol", env=env)
        added = watch.event()
        assert (added["key"], added["owner"]) == ("job:2", "carol")
        run_cli("release", "job:1", "bob", env=env)
        assert watch.event() | {"time": 0} == {
            "time": 0,
            "event": "owner",
            "key": "job:1",
            "owner": None,
            "token": None,
        }


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("127.0.0.1", "is not [http(s)://]host:port"),
        ("localhost:", "is not [http(s)://]host:port"),
        ("127.0.0.1:http", "is not [http(s)://]host:port"),
        ("ftp://127.0.0.1:2379", "the scheme must be http or https"),
        ("http://127.0.0.1:2379/v3", "is not [http(s)://]host:port"),
    ],
)
def test_a_malformed_endpoint_is_refused_at_once(endpoint: str, message: str) -> None:
    # A minute per call: the refusal comes before any connection is tried.
    done = run_cli(
        "owner",
        "k",
        "--endpoints",
        endpoint,
        "--command-timeout",
        "60s",
        env=cli_env(),
        timeout=20,
    )
    assert done.returncode == 2
    # Refused before connecting: nothing but the one line.
    assert done.stderr.count("\n") == 1 and message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("ETCDCTL_ENDPOINTS", "127.0.0.1", "'127.0.0.1' is not [http(s)://]host:port"),
        ("ETCDCTL_USER", "no-password", "ETCDCTL_USER must be name:password"),
        ("ETCDCTL_USER", ":pw", "username must not be empty"),
    ],
)
def test_a_malformed_variable_is_refused_at_once(variable: str, value: str, message: str) -> None:
    env = {**cli_env(), variable: value, "ETCDCTL_COMMAND_TIMEOUT": "60s"}
    done = run_cli("owner", "k", env=env, timeout=20)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def error_line(stderr: str) -> str:
    """The error: one line, the last; log lines of the library may come before it."""
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert all(line.startswith("20") for line in lines[:-1]), lines  # timestamped log lines
    return lines[-1]


def test_unreachable_etcd_exits_3() -> None:
    (port,) = free_ports(1)
    done = run_cli(
        "acquire",
        "k",
        "alice",
        "--endpoints",
        f"127.0.0.1:{port}",
        "--command-timeout",
        "1s",
        env=cli_env(),
    )
    assert done.returncode == 3
    (line,) = done.stderr.strip().splitlines()  # ours alone, nothing from gRPC's C core
    assert line.startswith("etcd-leases: etcd: UNAVAILABLE")


def test_permission_denied_exits_4(etcd_binary: str) -> None:
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        enable_auth(etcd)
        env = cli_env(etcd)
        # app may write only under /allowed/.
        refused = run_cli("acquire", "k", "alice", "--user", "app:apppw", env=env)
        assert refused.returncode == 4, refused.stderr
        assert error_line(refused.stderr).startswith("etcd-leases: etcd: PERMISSION_DENIED")
        allowed = run_cli(
            "acquire", "k", "alice", "--user", "app:apppw", "--prefix", "/allowed/", env=env
        )
        assert allowed.returncode == 0, allowed.stderr
        wrong = run_cli("owner", "k", "--user", "app:wrong", env=env)
        assert wrong.returncode == 4


@pytest.mark.parametrize(
    "args",
    [
        ["acquire", "k", "alice", "--ttl", "soon"],
        ["acquire", "k"],
        ["transfer", "k", "a"],
        ["frobnicate"],
        ["owner", "k", "--user", "nopassword"],
        ["owner", "k", "--cacert", "/nonexistent/ca.pem"],
        ["owner", "k", "--cert", "/nonexistent/cert.pem"],
        ["run", "k"],
        ["elect", "e", "--"],
        ["run", "k", "--", "no-such-command-here"],
    ],
)
def test_usage_errors_exit_2_without_a_traceback(args: list[str]) -> None:
    done = run_cli(*args, env=cli_env(), timeout=20)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(("etcd-leases", "usage:"))
