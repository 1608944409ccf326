"""``doctor``: each etcd endpoint's version and state, and its known bugs.

Short commands do not repeat the known-bug warning (long-lived ones log it once);
this is where a user looks it up. Exit 0 when every endpoint answered, 3 if any did
not.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict, dataclass, field

from etcd_leases.cli import exits
from etcd_leases.cli.connection import open_provider, provider_of, within_command_timeout
from etcd_leases.cli.options import Commands
from etcd_leases.cli.output import Output
from etcd_leases.errors import LeaseError
from etcd_leases.etcd.version import known_bugs
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb


def add_commands(commands: Commands) -> None:
    doctor = commands.add_parser(
        "doctor", help="show each endpoint's etcd version, leader and known bugs"
    )
    doctor.set_defaults(handler=_doctor)


@dataclass
class Examined:
    """What one endpoint said of itself; ``error`` if it did not answer."""

    endpoint: str
    error: str | None = None
    version: str | None = None
    is_leader: bool = False
    db_size: int = 0
    known_bugs: list[str] = field(default_factory=list)


async def _doctor(args: argparse.Namespace, out: Output) -> int:
    endpoints = provider_of(args).client.endpoints  # checked, as every command's
    reports = await asyncio.gather(*(_examine(args, endpoint) for endpoint in endpoints))
    lines = []
    for report in reports:
        if report.error is not None:
            lines.append(f"{report.endpoint}: not answering: {report.error}")
            continue
        role = "raft leader" if report.is_leader else "follower"
        lines.append(
            f"{report.endpoint}: etcd {report.version}, {role}, db {report.db_size / 1024:.0f} KiB"
        )
        lines += [f"  known bug: {bug}" for bug in report.known_bugs]
    out.result("\n".join(lines), endpoints=[asdict(report) for report in reports])
    answered = all(report.error is None for report in reports)
    return exits.OK if answered else exits.UNAVAILABLE


async def _examine(args: argparse.Namespace, endpoint: str) -> Examined:
    """One endpoint's status, asked of it alone."""
    try:
        async with (
            open_provider(args, endpoints=endpoint) as one,
            within_command_timeout(one, args),
        ):
            status = await one.client.call(
                "/etcdserverpb.Maintenance/Status", pb.StatusRequest(), pb.StatusResponse
            )
    except LeaseError as exc:
        return Examined(endpoint, error=exits.describe(exc))
    return Examined(
        endpoint,
        version=status.version,
        is_leader=status.leader == status.header.member_id,
        db_size=status.dbSize,
        known_bugs=known_bugs(status.version),
    )
