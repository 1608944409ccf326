"""``list`` and ``watch``: who holds what under the prefix, now and as it changes."""

from __future__ import annotations

import argparse
from contextlib import aclosing

from etcd_leases.cli import exits
from etcd_leases.cli.connection import open_provider, within_command_timeout
from etcd_leases.cli.options import Commands
from etcd_leases.cli.output import Output, escape
from etcd_leases.etcd.prefix import list_owners, watch_owners


def add_commands(commands: Commands) -> None:
    listing = commands.add_parser("list", help="keys held, with owner, token and TTL left")
    listing.add_argument("key_prefix", nargs="?", default="", help="only keys starting so")
    listing.set_defaults(handler=_list)

    watch = commands.add_parser("watch", help="print the owners, then each change as it happens")
    watch.add_argument("key_prefix", nargs="?", default="", help="only keys starting so")
    watch.set_defaults(handler=_watch, long_lived=True)


async def _list(args: argparse.Namespace, out: Output) -> int:
    async with open_provider(args) as provider, within_command_timeout(provider, args):
        owners = await list_owners(provider.client, provider.etcd_key(""), args.key_prefix.encode())
    rows = [
        [
            escape(o.key),
            escape(o.owner or ""),
            str(o.token),
            "-" if o.ttl_s is None else "expired" if o.ttl_s < 0 else f"{o.ttl_s}s",
        ]
        for o in owners
    ]
    records = [{"key": o.key, "owner": o.owner, "token": o.token, "ttl_s": o.ttl_s} for o in owners]
    out.table(["KEY", "OWNER", "TOKEN", "TTL"], rows, records)
    return exits.OK


async def _watch(args: argparse.Namespace, out: Output) -> int:
    async with open_provider(args) as provider:
        out.note(f"watching {escape(provider.prefix + args.key_prefix)}* (Ctrl-C to stop)")
        changes = watch_owners(provider.client, provider.etcd_key(""), args.key_prefix.encode())
        async with aclosing(changes):
            async for change in changes:
                key = escape(change.key)
                text = (
                    f"{key}: free"
                    if change.owner is None
                    else f"{key}: {escape(change.owner)} (token {change.token})"
                )
                out.event("owner", text, key=change.key, owner=change.owner, token=change.token)
    return exits.OK
