"""``etcd-leases demo`` and ``etcd-leases server``, run as a user would."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from etcd_leases.testing import EtcdCluster
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
    events = events_of(done.stdout)
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


def test_server_runs_an_etcd_until_sigterm() -> None:
    with running(["server", "--json"], env=cli_env()) as (server,):
        started = json.loads(server.line(within=60))
        env = cli_env()
        env["ETCDCTL_ENDPOINTS"] = ",".join(started["endpoints"])
        assert run_cli("acquire", "k", "alice", env=env).returncode == 0
        assert run_cli("owner", "k", env=env).stdout == "alice\n"
        server.signal(signal.SIGTERM)
        assert server.wait() == 0
        for pid in started["pids"]:
            assert not Path(f"/proc/{pid}").exists()
