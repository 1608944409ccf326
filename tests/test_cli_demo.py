"""``etcd-leases demo`` and ``etcd-leases server``, run as a user would."""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path
from typing import Any

from etcd_leases.testing import EtcdCluster, free_ports
from tests.cli import cli_env, run_cli, running
from tests.conftest import unique_prefix


def events_of(stdout: str) -> dict[str, list[dict[str, Any]]]:
    events: dict[str, list[dict[str, Any]]] = {}
    for line in stdout.splitlines():
        event = json.loads(line)
        events.setdefault(event["event"], []).append(event)
    return events


def test_the_demo_runs_to_completion_on_its_own_etcd() -> None:
    done = run_cli("demo", "--json", env=cli_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    # A known etcd bug is said once, not by every connection; a hand-over is no loss.
    assert done.stderr.count("bug 15247") <= 1, done.stderr
    assert "lost 'job:8'" not in done.stderr
    events = events_of(done.stdout)
    # The crash is real: a process killed, whose lease etcd expires after its TTL
    # (2 s, renewed every 2/3 s), rather than a provider closed cleanly.
    (crash,) = events["crash"]
    assert not Path(f"/proc/{crash['pid']}").exists()
    assert events["takeover"][1]["seconds"] > 1.0
    assert len(events["etcd"]) == 2  # started, then stopped and removed
    (fenced,) = events["fenced"]
    assert fenced["applied"] is False and fenced["stored"] == "step 2 by worker-b"
    assert events["takeover"][0]["seconds"] > 0
    assert len(events["member_killed"]) == 1
    assert events["survived"][0]["leader"] == events["handover"][-1]["leader"]
    assert "clean" in events
    for pid in events["etcd"][0].get("pids", []):
        assert not Path(f"/proc/{pid}").exists()


def test_the_demo_against_a_given_etcd_removes_what_it_wrote(etcd: EtcdCluster) -> None:
    prefix = unique_prefix()
    done = run_cli("demo", "--json", "--prefix", prefix, env=cli_env(etcd), timeout=120)
    assert done.returncode == 0, done.stderr
    events = events_of(done.stdout)
    assert "etcd" not in events  # it started no etcd of its own
    assert events["start"][0]["prefix"].startswith(prefix)
    assert etcd.etcdctl("get", "--prefix", prefix).strip() == ""


def free_pair() -> int:
    """A port free with the next one: a member's client and peer ports."""
    while True:
        (port,) = free_ports(1)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def test_server_runs_an_etcd_until_sigterm() -> None:
    port = free_pair()
    with running(["server", "--port", str(port), "--json"], env=cli_env()) as (server,):
        started = json.loads(server.line(within=60))
        assert started["endpoints"] == [f"127.0.0.1:{port}"]
        env = cli_env()
        env["ETCDCTL_ENDPOINTS"] = ",".join(started["endpoints"])
        assert run_cli("acquire", "k", "alice", env=env).returncode == 0
        assert run_cli("owner", "k", env=env).stdout == "alice\n"
        server.signal(signal.SIGTERM)
        assert server.wait() == 128 + signal.SIGTERM
        for pid in started["pids"]:
            assert not Path(f"/proc/{pid}").exists()
        assert not Path(started["data_dir"]).exists()  # a throwaway etcd


def test_server_keeps_its_data_dir_and_exits_130_on_ctrl_c(tmp_path: Path) -> None:
    port = free_pair()
    args = ["server", "--port", str(port), "--data-dir", str(tmp_path), "--json"]
    env = cli_env()
    env["ETCDCTL_ENDPOINTS"] = f"127.0.0.1:{port}"
    for run in range(2):
        with running(args, env=env) as (server,):
            json.loads(server.line(within=60))
            if run == 0:
                assert run_cli("acquire", "k", "alice", "--ttl", "5m", env=env).returncode == 0
            else:  # the same etcd again, from the data it kept
                assert run_cli("owner", "k", env=env).stdout == "alice\n"
            server.signal(signal.SIGINT)
            assert server.wait() == 128 + signal.SIGINT
    assert (tmp_path / "etcd0").is_dir()


def test_server_listens_where_other_commands_look_by_default() -> None:
    """On etcdctl's default endpoint, 127.0.0.1:2379, unless that is taken: then it
    says so, naming the port."""
    with running(["server"], env=cli_env()) as (server,):
        try:
            banner = server.line(within=60)
        except AssertionError:  # it ended: 2379 is taken here
            assert server.wait() == 2
            assert "--port 2379: 127.0.0.1:23" in server.stderr()
            return
        assert "running on 127.0.0.1:2379" in banner
        done = run_cli("owner", "nobody", env=cli_env())  # no endpoints given
        assert done.returncode == 1, done.stderr
        server.signal(signal.SIGINT)
        assert server.wait() == 130


def test_server_refuses_a_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("server", "--port", str(port), env=cli_env(), timeout=30)
    assert done.returncode == 2
    assert (
        done.stderr
        == f"etcd-leases: --port {port}: 127.0.0.1:{port} is in use (try another --port)\n"
    )
