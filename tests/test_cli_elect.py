"""``etcd-leases elect``: a command run only by the leader, in real processes."""

from __future__ import annotations

import re
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

from etcd_leases.testing import EtcdCluster, free_ports
from tests.cli import Running, cli_env, running
from tests.conftest import unique_prefix

TTL_S = 10


def next_event(
    procs: list[Running], name: str, within: float = 30
) -> tuple[Running, dict[str, Any]]:
    """The first ``name`` event any of ``procs`` prints."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for proc in procs:
            try:
                event = proc.event(within=0.02)
            except AssertionError:
                continue
            if event["event"] == name:
                return proc, event
    raise AssertionError(f"no {name!r} event in {within} s")


def running_commands(procs: list[Running]) -> dict[int, list[int]]:
    return {proc.process.pid: proc.children() for proc in procs if proc.children()}


def test_only_the_leader_runs_the_command_and_sigterm_hands_over_at_once(
    etcd: EtcdCluster,
) -> None:
    env = cli_env(etcd, unique_prefix())
    commands = [
        ["elect", "reports", "--id", f"c{i}", "--ttl", f"{TTL_S}s", "--json", "--", "sleep", "60"]
        for i in range(3)
    ]
    with running(*commands, env=env) as procs:
        leader, term = next_event(procs, "leading")
        assert term["leader"] in {"c0", "c1", "c2"}
        for _ in range(5):  # exactly one command runs, the leader's
            assert running_commands(procs) == {leader.process.pid: [term["pid"]]}
            time.sleep(0.2)

        signalled_at = time.monotonic()
        leader.signal(signal.SIGTERM)
        followers = [proc for proc in procs if proc is not leader]
        successor, next_term = next_event(followers, "leading", within=TTL_S)
        took = time.monotonic() - signalled_at
        print(f"successor's command started {took * 1000:.0f} ms after SIGTERM (TTL {TTL_S} s)")
        # Well before the old leader's lease could have run out: it was given back.
        assert took < TTL_S
        assert next_term["token"] > term["token"]
        assert leader.wait() == 128 + signal.SIGTERM  # as the exit-code table says
        assert not Path(f"/proc/{term['pid']}").exists()
        assert running_commands(followers) == {successor.process.pid: [next_term["pid"]]}


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^(etcd_leases_\S+) (\S+)$", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def test_metrics_of_a_running_elect(etcd: EtcdCluster) -> None:
    prefix = unique_prefix()
    env = cli_env(etcd, prefix)
    (port,) = free_ports(1)
    args = ["elect", "jobs", "--id", "solo", "--json", "--metrics-port", str(port)]
    with running([*args, "--", "sleep", "60"], env=env) as (elect,):
        first = elect.event_named("leading")
        metrics = scrape(port)
        assert metrics['etcd_leases_leader{election="jobs"}'] == 1
        assert metrics["etcd_leases_leases_held"] == 1
        assert metrics['etcd_leases_calls_total{call="acquire",outcome="acquired"}'] >= 1
        assert metrics['etcd_leases_call_duration_seconds_count{call="acquire"}'] >= 1

        # Leadership taken away from outside: the command stops, the candidate runs again.
        etcd.etcdctl("del", prefix + "jobs")
        elect.event_named("stopped")
        second = elect.event_named("leading")
        assert second["token"] > first["token"] and second["pid"] != first["pid"]
        metrics = scrape(port)
        assert metrics["etcd_leases_leases_lost_total"] == 1
        assert metrics["etcd_leases_renewals_failed_total"] == 0
        assert metrics['etcd_leases_leader{election="jobs"}'] == 1


def test_a_candidate_says_how_long_etcd_has_not_answered() -> None:
    (port,) = free_ports(1)
    env = cli_env()
    env["ETCDCTL_ENDPOINTS"] = f"127.0.0.1:{port}"  # nothing listens there
    args = ["elect", "e", "--command-timeout", "1s", "--ttl", "3s", "--", "sleep", "60"]
    with running(args, env=env) as (elect,):
        time.sleep(3)  # the first failed campaign, about 1 s, is logged at once
        elect.signal(signal.SIGINT)
        assert elect.wait() == 128 + signal.SIGINT
        stderr = elect.stderr()
    figures = [float(f) for f in re.findall(r"has not answered for ([0-9.]+) s", stderr)]
    assert figures, stderr
    # At least the attempt's own timeout, not the 0.0 s of when its failure was known.
    assert figures[0] >= 0.9
