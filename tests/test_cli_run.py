"""``etcd-leases run``: a command run while a lease is held, against a real etcd."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from etcd_leases.cli.exits import LEASE_LOST
from etcd_leases.testing import EtcdCluster
from tests.cli import cli_env, json_of, run_cli, running
from tests.conftest import unique_prefix


def test_the_command_gets_the_token_and_its_exit_code_is_ours(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    prefix = unique_prefix()
    env = cli_env()  # the connection given as flags: the command gets it as variables
    connection = ["--endpoints", f"http://{etcd.endpoints[0]}", "--prefix", prefix]
    seen = tmp_path / "env"
    variables = ["KEY", "OWNER", "TOKEN", "TTL_MS", "PREFIX"]
    words = " ".join(f"$ETCD_LEASES_{name}" for name in variables)
    script = f'echo "{words} $ETCDCTL_ENDPOINTS" > {seen}; exit 7'
    args = ["run", "job", "--owner", "w1", "--ttl", "5s", *connection, "--json"]
    done = run_cli(*args, "--", "sh", "-c", script, env=env)
    assert done.returncode == 7, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["event"] for e in events] == ["started", "exited"]
    token = events[0]["token"]
    assert seen.read_text().split() == [
        "job",
        "w1",
        str(token),
        "5000",
        prefix,
        f"http://{etcd.endpoints[0]}",
    ]
    # Released when the command ended.
    assert run_cli("owner", "job", *connection, env=env).returncode == 1


def test_the_command_is_stopped_when_the_lease_is_deleted(etcd: EtcdCluster) -> None:
    prefix = unique_prefix()
    env = cli_env(etcd, prefix)
    with running(["run", "job", "--ttl", "30s", "--json", "--", "sleep", "60"], env=env) as (run,):
        started = run.event_named("started")
        (child,) = run.children()
        assert child == started["pid"]
        etcd.etcdctl("del", prefix + "job")
        lost = run.event_named("lost")
        assert "deleted" in lost["reason"]
        assert run.event_named("exited")["code"] == 128 + signal.SIGTERM
        # Not the command's code: a supervisor tells a lost lease from a failed command.
        assert run.wait() == LEASE_LOST == 75


def test_a_command_ignoring_sigterm_is_killed_after_the_grace(etcd: EtcdCluster) -> None:
    env = cli_env(etcd, unique_prefix())
    command = ["sh", "-c", 'trap "" TERM; exec sleep 60']
    args = ["run", "job", "--owner", "w1", "--grace", "0.5s", "--json", "--", *command]
    with running(args, env=env) as (run,):
        run.event_named("started")
        assert run_cli("release", "job", "w1", env=env).returncode == 0
        run.event_named("lost")
        assert run.event_named("exited")["code"] == 128 + signal.SIGKILL
        assert run.wait() == LEASE_LOST


def test_sigterm_stops_the_command_and_releases_the_lease(etcd: EtcdCluster) -> None:
    env = cli_env(etcd, unique_prefix())
    with running(["run", "job", "--ttl", "30s", "--json", "--", "sleep", "60"], env=env) as (run,):
        run.event_named("started")
        (child,) = run.children()
        run.signal(signal.SIGTERM)
        assert run.wait() == 128 + signal.SIGTERM  # the command's code: it died of SIGTERM
        assert not Path(f"/proc/{child}").exists() or _zombie(child)
    # Released at once, not left to its 30 s TTL.
    assert run_cli("owner", "job", env=env).returncode == 1


def _zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_a_held_key_exits_1_and_wait_takes_it_when_freed(etcd: EtcdCluster) -> None:
    env = cli_env(etcd, unique_prefix())
    assert run_cli("acquire", "job", "alice", "--ttl", "30s", env=env).returncode == 0
    held = run_cli("run", "job", "--json", "--", "true", env=env)
    assert held.returncode == 1
    assert json_of(held) == {"key": "job", "acquired": False, "owner": "alice"}
    timed_out = run_cli("run", "job", "--wait", "0.5s", "--", "true", env=env)
    assert timed_out.returncode == 1

    with running(["run", "job", "--wait", "--json", "--", "sh", "-c", "exit 3"], env=env) as (run,):
        assert run_cli("owner", "job", env=env).stdout == "alice\n"
        assert run_cli("release", "job", "alice", env=env).returncode == 0
        assert run.event_named("started")["owner"] != "alice"
        assert run.wait() == 3


def test_the_command_dies_with_a_killed_supervisor(etcd: EtcdCluster) -> None:
    env = cli_env(etcd, unique_prefix())
    with running(["run", "job", "--json", "--", "sleep", "60"], env=env) as (run,):
        child = run.event_named("started")["pid"]
        run.signal(signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and not _zombie(child):
            assert time.monotonic() < deadline, "the command outlived its supervisor"
            time.sleep(0.05)
