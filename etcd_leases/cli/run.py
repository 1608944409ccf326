"""``run KEY -- CMD``: run a command while holding a lease.

The command starts once the lease is held (``--wait``: as soon as the key comes
free), with the fencing token in its environment. If the lease is lost, the command
gets SIGTERM, then SIGKILL after ``--grace``. When the command ends, or
``etcd-leases`` gets SIGTERM/SIGINT (passed on to the command), the lease is released.
The exit code is the command's, or 75 (``exits.LEASE_LOST``) if the lease was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from contextlib import AsyncExitStack

from etcd_leases.cli import exits, supervise
from etcd_leases.cli.connection import connection_env, open_provider, within_command_timeout
from etcd_leases.cli.options import Commands, duration, ttl_ms
from etcd_leases.cli.output import Output, escape
from etcd_leases.errors import LeaseHeld
from etcd_leases.hold import HeldLease, hold


def add_commands(commands: Commands) -> None:
    run = commands.add_parser("run", help="run CMD while holding KEY; stop it if the lease is lost")
    run.add_argument("key")
    run.add_argument("--owner", help="owner id (default: host-pid)")
    run.add_argument("--ttl", type=ttl_ms, default=15_000, help="lease TTL (15s)")
    run.add_argument(
        "--wait",
        nargs="?",
        type=duration,
        const=-1.0,
        default=0.0,
        help="wait for the key if it is held (for ever, or this long)",
    )
    supervise.add_supervision_flags(run)
    run.set_defaults(handler=_run, long_lived=True, takes_command=True)


async def _run(args: argparse.Namespace, out: Output) -> int:
    command = supervise.command_of(args)
    owner = args.owner or supervise.default_owner()
    with supervise.StopSignals() as stop:
        async with AsyncExitStack() as stack:
            provider = await stack.enter_async_context(open_provider(args))
            holding, health = await stack.enter_async_context(
                supervise.metered(provider, args, args.key)
            )
            if args.wait != 0 and (holder := await provider.get_lease_owner(args.key)):
                out.note(f"waiting for {escape(args.key)}, held by {escape(holder)}")
            wait: bool | float = True if args.wait < 0 else args.wait
            held = hold(holding, args.key, owner, args.ttl, wait=wait)
            # Taking the lease is bounded by --command-timeout, unless told to wait.
            bounded = within_command_timeout(provider, args)
            try:
                entering = asyncio.ensure_future(stack.enter_async_context(held))
                waiting = out.waiting(f"waiting for {escape(args.key)}")
                async with waiting if args.wait != 0 else bounded:
                    try:
                        lease = await supervise.until_stopped(stop.event, entering)
                    finally:
                        entering.cancel()  # out of time: not taken after all
            except LeaseHeld as exc:
                text = f"{escape(args.key)}: held by {escape(exc.holder or '?')}"
                out.result(text, key=args.key, acquired=False, owner=exc.holder)
                return exits.NO
            if lease is None:
                return 128 + (stop.signal or signal.SIGTERM)
            if health is not None:
                health.holding(lease)
            text = f"{escape(args.key)} held by {escape(owner)}"
            child = await supervise.start_command(
                command,
                connection_env(args),
                lease,
                out,
                "started",
                text,
                key=args.key,
                owner=owner,
            )
            return await _supervise(child, lease, stop, args.grace, out)


async def _supervise(
    child: supervise.Child,
    lease: HeldLease,
    stop: supervise.StopSignals,
    grace: float,
    out: Output,
) -> int:
    """Wait for the command to end, the lease to be lost or a signal; the exit code."""
    exited = asyncio.ensure_future(child.wait())
    others = [asyncio.ensure_future(lease.lost.wait()), asyncio.ensure_future(stop.event.wait())]
    try:
        await asyncio.wait([exited, *others], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in others:
            task.cancel()
    stopped_for_loss = not exited.done() and lease.lost.is_set()
    if stopped_for_loss:
        reason = lease.lost_reason or "its TTL ran out"
        text = f"lost {escape(lease.key)} ({reason}); stopping the command"
        out.event("lost", text, key=lease.key, reason=reason)
        await child.stop(grace)
    elif not exited.done():
        await child.stop(grace, stop.signal or signal.SIGTERM)
    code = await exited
    out.event("exited", f"the command exited with {code}", code=code)
    # Not the command's code after a loss: a supervisor must tell a lost lease from a
    # failed command.
    return exits.LEASE_LOST if stopped_for_loss else code
