"""Known etcd bugs: not repeated by short commands, logged once by long-lived ones,
shown by ``etcd-leases doctor``."""

from __future__ import annotations

import signal

from etcd_leases.etcd.version import has_bug_15247
from etcd_leases.testing import EtcdCluster, etcd_version, free_ports
from tests.cli import cli_env, json_of, run_cli, running
from tests.conftest import unique_prefix


def test_short_commands_do_not_repeat_the_known_bug(etcd: EtcdCluster) -> None:
    env = cli_env(etcd, unique_prefix())
    for args in (["acquire", "k", "alice"], ["owner", "k"], ["list"], ["release", "k", "alice"]):
        done = run_cli(*args, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stderr == "", args


def test_doctor_shows_each_endpoint_version_and_known_bugs(
    etcd: EtcdCluster, etcd_binary: str
) -> None:
    version = etcd_version(etcd_binary)
    env = cli_env(etcd)
    done = run_cli("doctor", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{etcd.endpoints[0]}: etcd {version}, raft leader")
    assert ("known bug: etcd bug 15247" in done.stdout) is has_bug_15247(version)
    (report,) = json_of(run_cli("doctor", "--json", env=env))["endpoints"]
    assert report["version"] == version and report["is_leader"] is True
    assert len(report["known_bugs"]) == (1 if has_bug_15247(version) else 0)


def test_doctor_exits_3_naming_an_endpoint_that_does_not_answer(etcd: EtcdCluster) -> None:
    (port,) = free_ports(1)
    endpoints = f"{etcd.endpoints[0]},127.0.0.1:{port}"
    done = run_cli("doctor", "--endpoints", endpoints, "--command-timeout", "1s", env=cli_env())
    assert done.returncode == 3, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{etcd.endpoints[0]}: etcd ")
    assert lines[-1].startswith(f"127.0.0.1:{port}: not answering: etcd: UNAVAILABLE")


def test_a_long_lived_command_logs_the_known_bug_once(etcd: EtcdCluster, etcd_binary: str) -> None:
    env = cli_env(etcd, unique_prefix())
    args = ["elect", "e", "--id", "solo", "--json", "--", "sleep", "60"]
    with running(args, env=env) as (elect,):
        elect.event_named("leading")
        elect.signal(signal.SIGTERM)
        assert elect.wait() == 128 + signal.SIGTERM
        logged = elect.stderr().count("bug 15247")
    assert logged == (1 if has_bug_15247(etcd_version(etcd_binary)) else 0)
