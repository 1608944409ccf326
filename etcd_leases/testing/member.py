"""One etcd process on 127.0.0.1, with fault injection (stop, kill, pause, resume, restart)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence

from etcd_leases.testing.binaries import _child_env, find_etcdctl
from etcd_leases.testing.errors import EtcdctlError, EtcdStartError
from etcd_leases.testing.registry import _HOST, _forget_process, spawn
from etcd_leases.testing.tls import TLSFiles

#: Raft heartbeat interval passed to every member, in milliseconds.
HEARTBEAT_INTERVAL_MS = 25
#: Raft election timeout passed to every member, in milliseconds.
ELECTION_TIMEOUT_MS = 250
#: How long :meth:`EtcdMember.start` / :meth:`EtcdCluster.start` wait, in seconds.
DEFAULT_START_TIMEOUT = 20.0

# How often a start is retried when a port turned out to be taken.
_START_ATTEMPTS = 3


class EtcdMember:
    """One etcd process, bound to 127.0.0.1.

    Usually created by :class:`EtcdCluster`; it can also be used on its own,
    in which case it forms a one-member cluster by default.

    :param name: the member name (``--name``).
    :param binary: path of the etcd binary.
    :param data_dir: the data directory; kept across :meth:`restart`.
    :param log_path: file that receives the process's stdout and stderr
        (appended to, so it covers restarts).
    :param client_port: port of the client URL.
    :param peer_port: port of the (plain HTTP) peer URL.
    :param initial_cluster: ``--initial-cluster``; defaults to this member alone.
    :param cluster_token: ``--initial-cluster-token``; defaults to a unique one.
    :param tls: serve clients over HTTPS with these files.
    :param extra_args: further command-line arguments for etcd.
    :param start_timeout: how long :meth:`start` waits for health, in seconds.
    :param host: the address to bind and advertise (127.0.0.1 unless the member runs
        in a network namespace of its own, see :class:`EtcdCluster`).
    :param command_prefix: run etcd through this, e.g. ``["ip", "netns", "exec", "ns0"]``
        (it must exec etcd, so that signals reach etcd itself).
    :param raft_timing: (heartbeat interval, election timeout) in milliseconds; fast by
        default. etcd's own defaults, (100, 1000), elect a new leader as slowly as
        users' clusters do.
    :param initial_cluster_state: ``"new"``, or ``"existing"`` for a member added to
        a running cluster (see :meth:`EtcdCluster.replace_member`).
    """

    def __init__(
        self,
        name: str,
        *,
        binary: str,
        data_dir: str,
        log_path: str,
        client_port: int,
        peer_port: int,
        initial_cluster: str | None = None,
        cluster_token: str | None = None,
        tls: TLSFiles | None = None,
        extra_args: Sequence[str] = (),
        start_timeout: float = DEFAULT_START_TIMEOUT,
        host: str = _HOST,
        command_prefix: Sequence[str] = (),
        raft_timing: tuple[int, int] = (HEARTBEAT_INTERVAL_MS, ELECTION_TIMEOUT_MS),
        initial_cluster_state: str = "new",
    ) -> None:
        self.name = name
        self.raft_timing = raft_timing
        self.initial_cluster_state = initial_cluster_state
        self.host = host
        self.command_prefix = tuple(command_prefix)
        self.binary = binary
        self.data_dir = data_dir
        self.log_path = log_path
        self.client_port = client_port
        self.peer_port = peer_port
        self.initial_cluster = initial_cluster or f"{name}={self.peer_url}"
        self.cluster_token = cluster_token or f"etcd-leases-{uuid.uuid4().hex}"
        self.tls = tls
        self.extra_args = tuple(extra_args)
        self.start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._log_offset = 0
        self._opener: urllib.request.OpenerDirector | None = None

    # -- addresses ---------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``"HOST:PORT"`` of the client URL (HOST is 127.0.0.1 unless set)."""
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        """``http://HOST:PORT``, or ``https://`` when TLS is on."""
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        """``http://HOST:PORT`` used for raft traffic."""
        return f"http://{self.host}:{self.peer_port}"

    # -- process state -----------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The pid of the running process, else None."""
        process = self._process
        if process is None or process.poll() is not None:
            return None
        return process.pid

    @property
    def running(self) -> bool:
        """Whether the process is alive (a paused process is running)."""
        return self.pid is not None

    @property
    def paused(self) -> bool:
        """Whether the process was stopped with :meth:`pause`."""
        return self._paused and self.running

    @property
    def returncode(self) -> int | None:
        """Exit status of the last process once it has ended, else None."""
        process = self._process
        return None if process is None else process.poll()

    def command(self) -> list[str]:
        """The command line this member is started with."""
        args = [
            *self.command_prefix,
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.initial_cluster}",
            f"--initial-cluster-state={self.initial_cluster_state}",
            f"--initial-cluster-token={self.cluster_token}",
            f"--heartbeat-interval={self.raft_timing[0]}",
            f"--election-timeout={self.raft_timing[1]}",
        ]
        if self.tls is not None:
            args += [f"--cert-file={self.tls.server_cert}", f"--key-file={self.tls.server_key}"]
            if self.tls.client_cert_auth:
                args += ["--client-cert-auth", f"--trusted-ca-file={self.tls.ca_cert}"]
        args += self.extra_args
        return args

    # -- lifecycle ---------------------------------------------------------

    def start(self, timeout: float | None = None) -> None:
        """Start the process and wait until it reports healthy.

        If the ports are taken, a couple of retries are made after a short
        pause (the ports of a member cannot change: the other members know
        them).  On failure the process is killed and :class:`EtcdStartError`
        is raised, quoting the end of the log.
        """
        for attempt in range(1, _START_ATTEMPTS + 1):
            self._spawn()
            try:
                self.wait_ready(timeout)
                return
            except EtcdStartError as exc:
                self.kill()
                if not exc.port_conflict or attempt == _START_ATTEMPTS:
                    raise
                time.sleep(0.5 * attempt)
            except BaseException:
                self.kill()
                raise

    def _spawn(self) -> None:
        """Start the process without waiting for it to become healthy."""
        if self.running:
            raise RuntimeError(f"etcd member {self.name!r} is already running (pid {self.pid})")
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            log.write(f"--- etcd-leases: starting {' '.join(self.command())}\n".encode())
            log.flush()
            process = spawn(self.command(), len(self.command_prefix), log, _child_env())
        self._process = process
        self._paused = False

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until ``GET /health`` answers ``"health": "true"`` (a NOSPACE alarm aside).

        Also usable after :meth:`resume`, or after :meth:`restart` of one
        member of a bigger cluster.

        :raises EtcdStartError: if the process exits or the timeout (default
            :attr:`start_timeout`) passes first.
        """
        _wait_ready([self], self.start_timeout if timeout is None else timeout)

    def _http_opener(self) -> urllib.request.OpenerDirector:
        if self._opener is None:
            handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
            if self.tls is not None:
                handlers.append(urllib.request.HTTPSHandler(context=self.tls.client_ssl_context()))
            self._opener = urllib.request.build_opener(*handlers)
        return self._opener

    def _http(
        self, path: str, timeout: float, data: bytes | None = None
    ) -> dict[str, object] | None:
        """A JSON request to this member's client URL; None if there is no JSON answer."""
        request = urllib.request.Request(f"{self.client_url}{path}", data=data)
        try:
            with self._http_opener().open(request, timeout=timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:  # etcd 3.5 answers 503 when unhealthy
            try:
                body = exc.read()
            except (OSError, http.client.HTTPException):
                return None
            finally:
                exc.close()
        except (OSError, http.client.HTTPException):
            return None
        try:
            answer = json.loads(body)
        except ValueError:
            return None
        return answer if isinstance(answer, dict) else None

    def metric(self, name: str, timeout: float = 2.0) -> float:
        """The value of metric ``name`` in this member's ``/metrics``: a name without
        labels, or one series with its labels as etcd writes them (``name{a="b",...}``)."""
        # Not through _http: etcd's /health is itself a raft write (a quorum read).
        with self._http_opener().open(f"{self.client_url}/metrics", timeout=timeout) as response:
            text = response.read().decode()
        for line in text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        raise RuntimeError(f"{self}: no {name} in /metrics")

    def proposals_committed(self, timeout: float = 2.0) -> int:
        """etcd's ``etcd_server_proposals_committed_total``: the raft writes so far.

        Each grant, revoke, put, delete or txn is one; keep-alives and reads are none.
        """
        return int(self.metric("etcd_server_proposals_committed_total", timeout))

    def leases_expired(self, timeout: float = 2.0) -> int:
        """etcd's ``etcd_debugging_server_lease_expired_total``: the leases this member
        revoked because it judged them expired (as leader, or thinking it still is)."""
        return int(self.metric("etcd_debugging_server_lease_expired_total", timeout))

    def is_healthy(self, timeout: float = 1.0, *, despite_nospace: bool = False) -> bool:
        """Whether ``GET /health`` answers ``"health": "true"`` within ``timeout`` seconds.

        etcd reports healthy once the member knows a leader and can serve a
        linearizable read, and no alarm is raised; ``despite_nospace`` leaves a NOSPACE
        alarm out (etcd's ``?exclude=NOSPACE``).
        """
        answer = self._http("/health?exclude=NOSPACE" if despite_nospace else "/health", timeout)
        return answer is not None and answer.get("health") == "true"

    def status(self, timeout: float = 1.0) -> dict[str, object] | None:
        """The member's ``Maintenance.Status`` as JSON (via the gRPC gateway), or None.

        Includes ``header.member_id``, ``leader``, ``raftTerm``, ``version``;
        64-bit numbers are strings.
        """
        return self._http("/v3/maintenance/status", timeout, data=b"{}")

    def _status_field(self, *path: str) -> str:
        """A field of :meth:`status`, e.g. ``("header", "revision")``; raises if it has none."""
        value: object = self.status(timeout=5.0)
        for name in path:
            value = value.get(name) if isinstance(value, dict) else None
        if value is None:
            raise RuntimeError(f"{self}: no {'.'.join(path)} in its status")
        return str(value)

    def member_id(self) -> int:
        """The member's raft id (``etcdctl member list`` shows it in hex)."""
        return int(self._status_field("header", "member_id"))

    def revision(self) -> int:
        """The store's current revision, as this member knows it."""
        return int(self._status_field("header", "revision"))

    def db_size(self) -> int:
        """The size of the member's backend file in bytes (what the quota is measured on)."""
        return int(self._status_field("dbSize"))

    def defragment(self, timeout: float = 60.0) -> None:
        """Defragment this member's backend: it serves nothing while this runs."""
        self.etcdctl("defrag", timeout=timeout)

    def _check_alive(self) -> None:
        process = self._process
        if process is None:
            raise EtcdStartError(self, "was never started", self.read_log())
        returncode = process.poll()
        if returncode is not None:
            _forget_process(process)
            raise EtcdStartError(self, f"exited with status {returncode}", self.read_log())

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the process: ``SIGTERM``, then ``SIGKILL`` after ``timeout`` seconds.

        Waits for the process to end (so it leaves no zombie).  Does nothing if
        it is not running.
        """
        self._request_stop()
        self._await_stop(timeout)

    def _request_stop(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(OSError):
            process.terminate()
            # A stopped process only handles SIGTERM once it is continued.
            process.send_signal(signal.SIGCONT)
        self._paused = False

    def _await_stop(self, timeout: float) -> None:
        process = self._process
        if process is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(timeout, 0.0))
        self.kill()  # reaps it, and kills it first if it outlived the timeout

    def kill(self) -> None:
        """Kill the process with ``SIGKILL`` and reap it; no-op if not running."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(OSError):
                process.kill()
        process.wait()
        _forget_process(process)
        self._paused = False

    def pause(self) -> None:
        """Freeze the process with ``SIGSTOP`` (it stops answering, but keeps its sockets)."""
        process = self._require_running()
        process.send_signal(signal.SIGSTOP)
        self._paused = True
        _wait_for_proc_state(process.pid, stopped=True)

    def resume(self) -> None:
        """Continue a paused process with ``SIGCONT``.

        Does not wait for it to become healthy; call :meth:`wait_ready` for that.
        """
        process = self._require_running()
        process.send_signal(signal.SIGCONT)
        self._paused = False
        _wait_for_proc_state(process.pid, stopped=False)

    def restart(self, timeout: float | None = None) -> None:
        """:meth:`stop`, then :meth:`start` again on the same data dir and ports."""
        self.stop()
        self.start(timeout)

    def _require_running(self) -> subprocess.Popen[bytes]:
        process = self._process
        if process is None or process.poll() is not None:
            raise RuntimeError(f"etcd member {self.name!r} is not running")
        return process

    # -- tools -------------------------------------------------------------

    def etcdctl(
        self,
        *args: str,
        check: bool = True,
        env: Mapping[str, str] | None = None,
        timeout: float = 30.0,
    ) -> str:
        """Run ``etcdctl`` against this member and return its stdout.

        Uses the ``etcdctl`` next to the etcd binary (else the one on
        ``PATH``), with ``ETCDCTL_API=3``, ``--endpoints`` set to this member
        and the TLS flags when TLS is on.  ``ETCDCTL_*`` variables of our own
        environment are not passed on; ``env`` entries are added on top.

        :raises EtcdctlError: on a non-zero exit status, when ``check``.
        """
        command = [find_etcdctl(self.binary), f"--endpoints={self.client_url}"]
        if self.tls is not None:
            command += [
                f"--cacert={self.tls.ca_cert}",
                f"--cert={self.tls.client_cert}",
                f"--key={self.tls.client_key}",
            ]
        command += args
        child_env = _child_env("ETCDCTL_")
        child_env["ETCDCTL_API"] = "3"
        if env is not None:
            child_env.update(env)
        completed = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=child_env,
            timeout=timeout,
            check=False,
        )
        if check and completed.returncode != 0:
            raise EtcdctlError(command, completed.returncode, completed.stdout, completed.stderr)
        return completed.stdout

    def read_log(self, since_last_start: bool = True) -> str:
        """The member's log, from its last start (or from the beginning)."""
        try:
            with open(self.log_path, "rb") as log:
                if since_last_start:
                    log.seek(self._log_offset)
                return log.read().decode(errors="replace")
        except OSError as exc:
            return f"<cannot read {self.log_path}: {exc}>"

    def __repr__(self) -> str:
        state = "paused" if self.paused else "running" if self.running else "stopped"
        return f"<EtcdMember {self.name} {self.client_url} {state} pid={self.pid}>"


def _wait_for_proc_state(pid: int, *, stopped: bool, timeout: float = 1.0) -> None:
    """Best effort (Linux): wait until /proc shows the process (not) stopped."""
    path = f"/proc/{pid}/stat"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as handle:
                state = handle.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return
        if (state in ("T", "t")) == stopped or time.monotonic() >= deadline:
            return
        time.sleep(0.002)


def start_members(members: Sequence[EtcdMember], timeout: float = DEFAULT_START_TIMEOUT) -> None:
    """Start the members of one cluster together (raft needs a quorum before any is
    healthy) and wait until all are; on failure they are killed again."""
    try:
        for member in members:
            member._spawn()
        _wait_ready(members, timeout)
    except BaseException:
        for member in members:
            with contextlib.suppress(Exception):
                member.kill()
        raise


def _wait_ready(members: Sequence[EtcdMember], timeout: float) -> None:
    """Wait until every member is healthy; fail fast if one exits."""
    deadline = time.monotonic() + timeout
    pending = list(members)
    for member in pending:
        if member.paused:
            raise RuntimeError(f"etcd member {member.name!r} is paused; resume() it first")
    while True:
        for member in list(pending):
            member._check_alive()
            remaining = deadline - time.monotonic()
            # A NOSPACE alarm waits for an operator, not for time, and a member under
            # it serves (reads, deletes, keep-alives): it is up.
            if member.is_healthy(min(1.0, max(remaining, 0.1)), despite_nospace=True):
                pending.remove(member)
        if not pending:
            return
        if time.monotonic() >= deadline:
            member = pending[0]
            raise EtcdStartError(member, f"was not healthy after {timeout:g} s", member.read_log())
        time.sleep(0.02)
