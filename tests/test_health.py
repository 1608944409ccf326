"""The probes of ``run`` / ``elect`` (``--metrics-port``): ``/healthz`` answered by the
event loop and failing for a term held past its lease, ``/readyz`` following etcd."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import urllib.error
import urllib.request

import prometheus_client
from prometheus_client import CollectorRegistry

from etcd_leases.cli.health import Health
from etcd_leases.metrics import LeaseMetrics, MeteredProvider
from etcd_leases.testing import EtcdCluster, free_ports
from tests.cli import cli_env, running
from tests.conftest import Live, unique_prefix


def probe(port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    """The status and body of ``GET path``; status 0 when nothing answered in time."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except (TimeoutError, urllib.error.URLError):
        return 0, ""


def probe_until(port: int, path: str, status: int, within: float = 30.0) -> str:
    """Probe until ``path`` answers ``status``; its body."""
    deadline = time.monotonic() + within
    seen = None
    while time.monotonic() < deadline:
        seen = probe(port, path)
        if seen[0] == status:
            return seen[1]
        time.sleep(0.2)
    raise AssertionError(f"{path} never answered {status} in {within} s (last: {seen})")


async def test_a_blocked_event_loop_fails_liveness(live: Live) -> None:
    """/healthz is answered by the loop: while it is blocked, the probe gets nothing,
    where a server thread (prometheus_client's) answers on regardless."""
    metered = MeteredProvider(live.provider, LeaseMetrics(CollectorRegistry()))
    (thread_port,) = free_ports(1)
    thread_server, _ = prometheus_client.start_http_server(
        thread_port, "127.0.0.1", CollectorRegistry()
    )
    try:
        await blocked_loop_probes(metered, thread_port)
    finally:
        thread_server.shutdown()
        thread_server.server_close()


async def blocked_loop_probes(metered: MeteredProvider, thread_port: int) -> None:
    async with contextlib.aclosing(Health(metered, "seat", liveness_timeout=20)) as health:
        port = await health.serve("127.0.0.1", 0)
        assert await asyncio.to_thread(probe, port, "/healthz") == (200, "ok\n")

        answers: dict[int, tuple[int, str]] = {}

        def ask(port: int, path: str) -> None:
            answers[port] = probe(port, path, timeout=1.0)

        asked = [
            threading.Thread(target=ask, args=(port, "/healthz")),
            threading.Thread(target=ask, args=(thread_port, "/metrics")),
        ]
        for thread in asked:
            thread.start()
        time.sleep(3)  # noqa: ASYNC251 - the loop blocked on purpose, as by a stuck callback
        for thread in asked:
            thread.join()
        assert answers[port] == (0, "")  # liveness fails on the probe's timeout
        assert answers[thread_port][0] == 200  # a thread would have said all is well

        assert await asyncio.to_thread(probe, port, "/healthz") == (200, "ok\n")


def test_elect_probes_follow_etcd_and_a_term_held_past_its_lease(etcd_binary: str) -> None:
    """etcd frozen: /readyz fails and the reachable gauge reads 0. The leader's lease
    runs out while its command ignores SIGTERM (--grace 60s): the term goes on without
    a lease, and /healthz fails once that is older than --liveness-timeout."""
    (port,) = free_ports(1)
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        env = cli_env(etcd)
        args = ["elect", "jobs", "--json", "--ttl", "2s", "--grace", "60s"]
        args += ["--metrics-port", str(port), "--liveness-timeout", "1s", "--command-timeout", "1s"]
        ignores_sigterm = (
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        )
        command = ["--", sys.executable, "-c", ignores_sigterm]
        with running([*args, *command], env=env) as (elect,):
            elect.event_named("leading")
            assert probe(port, "/healthz") == (200, "ok\n")
            probe_until(port, "/readyz", 200)
            metrics = probe(port, "/metrics")[1]
            assert "etcd_leases_etcd_reachable 1.0" in metrics
            assert 'etcd_leases_build_info{version="' in metrics
            assert "_created" not in metrics

            etcd.members[0].pause()
            try:
                assert "etcd did not answer" in probe_until(port, "/readyz", 503)
                assert "etcd_leases_etcd_reachable 0.0" in probe(port, "/metrics")[1]
                why = probe_until(port, "/healthz", 503)
                assert "still holds jobs" in why and "after losing its lease" in why, why
            finally:
                etcd.members[0].resume()
            probe_until(port, "/readyz", 200)


def test_run_serves_the_probes_while_it_holds_its_lease(etcd: EtcdCluster) -> None:
    (port,) = free_ports(1)
    env = cli_env(etcd, unique_prefix())
    args = ["run", "job", "--json", "--metrics-port", str(port), "--", "sleep", "60"]
    with running(args, env=env) as (run,):
        run.event_named("started")
        assert probe(port, "/healthz") == (200, "ok\n")
        assert probe_until(port, "/readyz", 200) == "ok\n"
        assert "etcd_leases_leases_held 1.0" in probe(port, "/metrics")[1]
        assert probe(port, "/nothing")[0] == 404
