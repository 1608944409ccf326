"""The contract from the shell: ``acquire``, ``owner``, ``renew``, ``release``, ``transfer``.

Each is one call of the lease contract; the exit code says how it went (0 yes,
1 no), so a script can branch on it::

    if etcd-leases acquire job:42 "$HOSTNAME" --ttl 30s; then ...; fi
"""

from __future__ import annotations

import argparse

from etcd_leases.cli import exits
from etcd_leases.cli.connection import open_provider, within_command_timeout
from etcd_leases.cli.options import Commands, ttl_ms
from etcd_leases.cli.output import Output, escape


def add_commands(commands: Commands) -> None:
    for name, handler, positionals, help in (
        ("acquire", _acquire, ("key", "owner"), "take KEY for OWNER if it is free (exit 1: held)"),
        ("owner", _owner, ("key",), "print who holds KEY (exit 1: nobody)"),
        ("renew", _renew, ("key", "owner"), "reset KEY's TTL if OWNER holds it (exit 1: not)"),
        ("release", _release, ("key", "owner"), "free KEY if OWNER holds it (says if it did)"),
        (
            "transfer",
            _transfer,
            ("key", "from_owner", "to_owner"),
            "hand KEY from FROM_OWNER to TO_OWNER atomically (exit 1: FROM_OWNER does not hold it)",
        ),
    ):
        parser = commands.add_parser(name, help=help)
        for positional in positionals:
            parser.add_argument(positional)
        if name in ("acquire", "renew", "transfer"):
            parser.add_argument("--ttl", type=ttl_ms, default=15_000, help="lease TTL (15s)")
        parser.set_defaults(handler=handler)


async def _acquire(args: argparse.Namespace, out: Output) -> int:
    async with open_provider(args) as provider, within_command_timeout(provider, args):
        result = await provider.acquire_lease(args.key, args.owner, args.ttl)
    key = escape(args.key)
    if result.acquired:
        text = (
            f"{key}: acquired by {escape(args.owner)}, token {result.token}, ttl {result.ttl_ms} ms"
        )
    else:
        text = f"{key}: held by {escape(result.owner or '?')}"
    out.result(
        text,
        key=args.key,
        acquired=result.acquired,
        owner=result.owner,
        token=result.token,
        ttl_ms=result.ttl_ms,
    )
    return exits.OK if result.acquired else exits.NO


async def _owner(args: argparse.Namespace, out: Output) -> int:
    async with open_provider(args) as provider, within_command_timeout(provider, args):
        owner = await provider.get_lease_owner(args.key)
    if owner is None and not out.as_json:
        out.note(f"{escape(args.key)}: nobody holds it")
    else:
        out.result(escape(owner or ""), key=args.key, owner=owner)
    return exits.OK if owner is not None else exits.NO


async def _renew(args: argparse.Namespace, out: Output) -> int:
    async with open_provider(args) as provider, within_command_timeout(provider, args):
        renewed = await provider.renew_lease(args.key, args.owner, args.ttl)
    text = f"{escape(args.key)}: " + ("renewed" if renewed else f"not held by {escape(args.owner)}")
    out.result(text, key=args.key, owner=args.owner, renewed=renewed)
    return exits.OK if renewed else exits.NO


async def _release(args: argparse.Namespace, out: Output) -> int:
    async with open_provider(args) as provider, within_command_timeout(provider, args):
        # The contract's release is silent, so ask first: for anyone but the owner it
        # would be a no-op anyway. Between the two calls the tenure can only end.
        released = await provider.get_lease_owner(args.key) == args.owner
        if released:
            await provider.release_lease(args.key, args.owner)
    key, owner = escape(args.key), escape(args.owner)
    text = (
        f"{key}: released by {owner}"
        if released
        else f"{key}: not held by {owner}; nothing to release"
    )
    out.result(text, key=args.key, owner=args.owner, released=released)
    return exits.OK


async def _transfer(args: argparse.Namespace, out: Output) -> int:
    async with open_provider(args) as provider, within_command_timeout(provider, args):
        moved = await provider.transfer_lease(args.key, args.from_owner, args.to_owner, args.ttl)
    key, to_owner = escape(args.key), escape(args.to_owner)
    text = (
        f"{key}: now held by {to_owner}"
        if moved
        else f"{key}: not held by {escape(args.from_owner)}"
    )
    out.result(text, key=args.key, transferred=moved, owner=args.to_owner if moved else None)
    return exits.OK if moved else exits.NO
