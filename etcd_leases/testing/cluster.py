"""A throwaway etcd cluster of several members, started and stopped together."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from types import TracebackType

from etcd_leases.testing.binaries import find_etcd_binary
from etcd_leases.testing.errors import EtcdctlError, EtcdStartError
from etcd_leases.testing.member import (
    _START_ATTEMPTS,
    DEFAULT_START_TIMEOUT,
    ELECTION_TIMEOUT_MS,
    HEARTBEAT_INTERVAL_MS,
    EtcdMember,
    _wait_ready,
)
from etcd_leases.testing.registry import (
    _HOST,
    _directories,
    _registry_lock,
    _release_ports,
    _reserve_ports,
)
from etcd_leases.testing.tls import TLSFiles, _make_tls_files

_TEMP_PREFIX = "etcd-leases-"


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
    :param hosts: the address of each member (default: 127.0.0.1 for all), for
        members that run in network namespaces of their own, and then
    :param command_prefixes: what to run each member's etcd through, e.g.
        ``["ip", "netns", "exec", "ns0"]`` (see ``tests/chaos/partitions.py``).
    :param raft_timing: (heartbeat interval, election timeout) in milliseconds of every
        member; (25, 250) by default, so elections take a fraction of a second.
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
        hosts: Sequence[str] = (),
        command_prefixes: Sequence[Sequence[str]] = (),
        raft_timing: tuple[int, int] = (HEARTBEAT_INTERVAL_MS, ELECTION_TIMEOUT_MS),
    ) -> None:
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least one member, not {size}")
        if client_cert_auth and not tls:
            raise ValueError("client_cert_auth=True needs tls=True")
        if len(hosts) not in (0, size) or len(command_prefixes) not in (0, size):
            raise ValueError(f"hosts and command_prefixes need one entry per member ({size})")
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
        self.hosts = tuple(hosts) or (_HOST,) * size
        self.command_prefixes = tuple(map(tuple, command_prefixes)) or ((),) * size
        self.raft_timing = raft_timing
        self._replacements = 0
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
        """``"HOST:PORT"`` of every member's client URL."""
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
            f"{name}=http://{host}:{port}"
            for name, host, port in zip(names, self.hosts, peer_ports, strict=True)
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
                host=self.hosts[i],
                command_prefix=self.command_prefixes[i],
                raft_timing=self.raft_timing,
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

    def replace_member(self, member: EtcdMember) -> EtcdMember:
        """Remove ``member`` from the cluster and add a new member on new ports in its
        place, as an operator replaces a failed machine; the new member, once healthy.

        ``member`` is killed; the new one takes its place in :attr:`members` (and so in
        :attr:`endpoints`) and syncs its data from the others.
        """
        if self.directory is None or member not in self.members:
            raise RuntimeError(f"{member!r} is not a member of this running cluster")
        others = [m for m in self.members if m is not member]
        via = next(m for m in others if m.running and not m.paused)
        listed = json.loads(via.etcdctl("member", "list", "--write-out=json"))["members"]
        (member_id,) = (entry["ID"] for entry in listed if entry.get("name") == member.name)
        # Removed while it runs, with every member up for the proposal's quorum.
        _reconfigure(via, "remove", f"{member_id:x}", done_if="not found")
        member.kill()
        client_port, peer_port = _reserve_ports(2)
        self._ports += [client_port, peer_port]
        self._replacements += 1
        name = f"etcd{self.size + self._replacements - 1}"
        peer_url = f"http://{member.host}:{peer_port}"
        _reconfigure(via, "add", name, f"--peer-urls={peer_url}", done_if="exists")
        replacement = EtcdMember(
            name,
            binary=self.binary,
            data_dir=os.path.join(self.directory, f"{name}.data"),
            log_path=os.path.join(self.directory, f"{name}.log"),
            client_port=client_port,
            peer_port=peer_port,
            initial_cluster=",".join(
                [f"{m.name}={m.peer_url}" for m in others] + [f"{name}={peer_url}"]
            ),
            cluster_token=member.cluster_token,
            tls=self.tls_files,
            extra_args=self.extra_args,
            start_timeout=self.start_timeout,
            host=member.host,
            command_prefix=member.command_prefix,
            raft_timing=self.raft_timing,
            initial_cluster_state="existing",
        )
        replacement.start()
        self.members[self.members.index(member)] = replacement
        return replacement

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

    def compact(self, revision: int | None = None) -> int:
        """Compact history up to ``revision`` (the current one by default) and wait until
        every member dropped it from disk; returns the revision compacted to.

        The current revision is read linearizably: a member's status answers from its
        own state, which may trail (a chaos run's leader, just restarted, named one
        below a compaction already made). History compacted that far already is done.
        """
        if revision is not None:
            self.etcdctl("compact", "--physical", str(revision))
            return revision
        probe = self.etcdctl("get", "--write-out=json", "--keys-only", "compact-probe")
        current = int(json.loads(probe)["header"]["revision"])
        try:
            self.etcdctl("compact", "--physical", str(current))
        except EtcdctlError as exc:
            if "required revision has been compacted" not in exc.stderr:
                raise
        return current

    def alarms(self) -> list[str]:
        """The raised alarms, one ``"<member id hex>:<alarm>"`` each (e.g. ``NOSPACE``)."""
        lines = self.etcdctl("alarm", "list").split()  # memberID:123 alarm:NOSPACE
        return [
            f"{int(member.removeprefix('memberID:')):x}:{alarm.removeprefix('alarm:')}"
            for member, alarm in zip(lines[::2], lines[1::2], strict=True)
        ]

    def disarm_alarms(self) -> None:
        """Disarm every alarm (once its cause is gone, or etcd raises it again)."""
        self.etcdctl("alarm", "disarm")

    def move_leader(self, to: EtcdMember) -> None:
        """Hand the leadership to ``to`` (etcd's MoveLeader, sent to the current leader)."""
        self.leader().etcdctl("move-leader", f"{to.member_id():x}")

    def __repr__(self) -> str:
        return f"<EtcdCluster size={self.size} {self.binary} members={self.members!r}>"


# What etcd answers a reconfiguration it may accept a moment later.
_RECONFIGURE_TRANSIENT = ("unhealthy cluster", "deadline exceeded", "timed out", "leader")


def _reconfigure(via: EtcdMember, *args: str, done_if: str, timeout: float = 30.0) -> None:
    """``etcdctl member ARGS`` through ``via``, again while etcd refuses it for an
    "unhealthy cluster" (it wants every remaining member connected for 5 s first),
    times out or elects a leader; a retry that finds it done (``done_if``) is done."""
    deadline = time.monotonic() + timeout
    retried = False
    while True:
        try:
            via.etcdctl("member", *args)
            return
        except EtcdctlError as exc:
            text = str(exc)
            if retried and done_if in text:
                return
            transient = any(word in text for word in _RECONFIGURE_TRANSIENT)
            if not transient or time.monotonic() > deadline:
                raise
        retried = True
        time.sleep(0.5)
