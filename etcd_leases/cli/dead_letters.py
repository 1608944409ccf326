"""``dead-letters``: a thread's messages that failed every delivery; list, retry, drop."""

from __future__ import annotations

import argparse

from etcd_leases.cli import exits
from etcd_leases.cli.connection import open_provider
from etcd_leases.cli.options import Commands
from etcd_leases.cli.output import Output, escape
from etcd_leases.hold import HeldLease
from etcd_leases.threads import ThreadMessages, Threads

_PREVIEW = 60  # payload characters shown in the listing


def add_commands(commands: Commands) -> None:
    dead = commands.add_parser(
        "dead-letters", help="a thread's dead letters: list them, retry or drop some"
    )
    dead.add_argument("thread", help="the thread's name")
    dead.add_argument("action", nargs="?", choices=["list", "retry", "drop"], default="list")
    dead.add_argument("seqs", nargs="*", type=int, metavar="SEQ", help="default: every one")
    dead.set_defaults(handler=_dead_letters)


async def never_runs(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
    """The handler of commands that only send: they never run a thread."""
    raise AssertionError("the command only sends")


async def _dead_letters(args: argparse.Namespace, out: Output) -> int:
    async with open_provider(args) as provider:
        threads = Threads(provider, never_runs)
        letters = await threads.dead_letters(args.thread)
        if args.action == "list":
            rows = [
                [str(d.seq), str(d.attempts), escape(d.payload.decode("utf-8", "replace"))]
                for d in letters
            ]
            rows = [[seq, attempts, text[:_PREVIEW]] for seq, attempts, text in rows]
            records = [
                {
                    "seq": d.seq,
                    "attempts": d.attempts,
                    "payload": d.payload.decode("utf-8", "replace"),
                }
                for d in letters
            ]
            out.table(["SEQ", "ATTEMPTS", "PAYLOAD"], rows, records)
            return exits.OK
        chosen = [d for d in letters if not args.seqs or d.seq in args.seqs]
        missing = sorted(set(args.seqs) - {d.seq for d in letters})
        for letter in chosen:
            if args.action == "retry":
                message = await threads.retry_dead_letter(letter)
                text = f"{letter.seq}: sent again as {message.seq}"
                out.result(text, seq=letter.seq, action="retried", new_seq=message.seq)
            else:
                await threads.drop_dead_letter(letter)
                out.result(f"{letter.seq}: dropped", seq=letter.seq, action="dropped")
        for seq in missing:
            out.result(f"{seq}: no such dead letter", seq=seq, action="missing")
    return exits.NO if missing else exits.OK
