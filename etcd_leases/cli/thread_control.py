"""``send``, ``wake``, ``abort``, ``cancel-pending``: a thread's delivery modes from a shell."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable

from etcd_leases.cli import exits
from etcd_leases.cli.connection import open_provider
from etcd_leases.cli.dead_letters import never_runs
from etcd_leases.cli.options import Commands
from etcd_leases.cli.output import Output, escape
from etcd_leases.threads import Threads

Handler = Callable[[argparse.Namespace, Output], Awaitable[int]]


def add_commands(commands: Commands) -> None:
    send = commands.add_parser("send", help="store a message in a thread's inbox")
    send.add_argument("thread", help="the thread's name")
    send.add_argument("payload", help="the message (UTF-8 text)")
    send.add_argument(
        "--no-wake",
        dest="wake",
        action="store_false",
        help="start no run: for a run active now, or the next one that starts",
    )
    send.add_argument("--send-id", help="an id that makes a repeat of this send store nothing")
    send.set_defaults(handler=_send)
    for name, handler, text in (
        ("wake", _wake, "have a serving worker run a thread whose messages wait"),
        ("abort", _abort, "cancel the handler of the run holding a thread, wherever it runs"),
        ("cancel-pending", _cancel_pending, "drop the messages waiting in a thread's inbox"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("thread", help="the thread's name")
        command.set_defaults(handler=handler)


async def _send(args: argparse.Namespace, out: Output) -> int:
    async with open_provider(args) as provider:
        threads = Threads(provider, never_runs)
        message = await threads.send(
            args.thread, args.payload, send_id=args.send_id, wake=args.wake
        )
    stored = f"already stored as {message.seq}" if message.duplicate else f"stored as {message.seq}"
    out.result(
        f"{escape(args.thread)}: {stored}",
        thread=args.thread,
        seq=message.seq,
        duplicate=message.duplicate,
    )
    return exits.OK


def _yes_or_no(
    call: Callable[[Threads, str], Awaitable[bool]], field: str, yes: str, no: str
) -> Handler:
    """A command calling ``call(threads, thread)``: exit 0 when it says yes, else 1."""

    async def command(args: argparse.Namespace, out: Output) -> int:
        async with open_provider(args) as provider:
            done = await call(Threads(provider, never_runs), args.thread)
        text = f"{escape(args.thread)}: {yes if done else no}"
        out.result(text, thread=args.thread, **{field: done})
        return exits.OK if done else exits.NO

    return command


_wake = _yes_or_no(Threads.wake, "woken", "woken", "nothing waiting; not woken")
_abort = _yes_or_no(Threads.abort, "aborted", "its run aborted", "no run holds it; nothing aborted")


async def _cancel_pending(args: argparse.Namespace, out: Output) -> int:
    async with open_provider(args) as provider:
        cancelled = await Threads(provider, never_runs).cancel_pending(args.thread)
    out.result(
        f"{escape(args.thread)}: {cancelled} cancelled", thread=args.thread, cancelled=cancelled
    )
    return exits.OK
