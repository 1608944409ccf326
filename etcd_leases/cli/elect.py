"""``elect NAME -- CMD``: run a command only while this process leads the election.

The singleton pattern for a Kubernetes Deployment: every replica campaigns; the
leader runs the command with its fencing token in the environment. If leadership is
lost, the command gets SIGTERM (then SIGKILL after ``--grace``) and the replica
campaigns again. On SIGTERM or SIGINT the leader stops its command and resigns at
once, so a successor takes over without waiting for the TTL. ``elect`` exits with
the command's code if the command ends on its own, else 128+N after signal N (130
on Ctrl-C, 143 on SIGTERM), as the table in :mod:`exits` says.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from etcd_leases.cli import supervise
from etcd_leases.cli.connection import connection_env, open_provider
from etcd_leases.cli.options import Commands, ttl_ms
from etcd_leases.cli.output import Output, escape
from etcd_leases.election import Election
from etcd_leases.hold import HeldLease


def add_commands(commands: Commands) -> None:
    elect = commands.add_parser("elect", help="run CMD only while leading the election NAME")
    elect.add_argument("name")
    elect.add_argument(
        "--id", help="this candidate's id (default: host-pid; in Kubernetes the pod name)"
    )
    elect.add_argument("--ttl", type=ttl_ms, default=15_000, help="leadership lease TTL (15s)")
    supervise.add_supervision_flags(elect)
    elect.set_defaults(handler=_elect, long_lived=True, takes_command=True)


async def _elect(args: argparse.Namespace, out: Output) -> int:
    command = supervise.command_of(args)
    candidate = args.id or supervise.default_owner()
    exit_code: int | None = None  # the command's, if it ends on its own
    with supervise.StopSignals() as stop:
        async with (
            open_provider(args) as provider,
            supervise.metered(provider, args, args.name) as (holding, health),
        ):
            election = Election(holding, args.name, candidate, args.ttl)

            def set_leading(lease: HeldLease | None) -> None:
                if health is not None:
                    health.metered.metrics.set_leading(args.name, lease is not None)
                    health.holding(lease)

            async def lead(lease: HeldLease) -> None:
                nonlocal exit_code
                set_leading(lease)
                text = f"{escape(candidate)} leads {escape(args.name)}"
                child = await supervise.start_command(
                    command,
                    connection_env(args),
                    lease,
                    out,
                    "leading",
                    text,
                    election=args.name,
                    leader=candidate,
                )
                try:
                    exit_code = await child.wait()
                    out.event("exited", f"the command exited with {exit_code}", code=exit_code)
                except asyncio.CancelledError:
                    # Leadership lost, or we were told to stop: the command goes first.
                    code = await asyncio.shield(child.stop(args.grace))
                    out.event("stopped", f"stopped the command (exit {code})", code=code)
                    raise

            def stopped_leading() -> None:
                set_leading(None)

            def new_leader(leader: str | None) -> None:
                text = "the seat is empty" if leader is None else f"leader: {escape(leader)}"
                out.event("leader", text, election=args.name, leader=leader)

            set_leading(None)
            out.note(f"{escape(candidate)} campaigns for {escape(args.name)}")
            await election.run(lead, stopped_leading, new_leader, stop=stop.event)
    # Otherwise run returned because a signal set the stop event.
    return exit_code if exit_code is not None else 128 + (stop.signal or signal.SIGTERM)
