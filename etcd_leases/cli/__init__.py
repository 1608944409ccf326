"""The ``etcd-leases`` command: the lease contract, inspection and supervision from a shell.

One module per group of commands (:mod:`contract`, :mod:`listing`, :mod:`doctor`,
:mod:`run`, :mod:`elect`, :mod:`server`, :mod:`demo`, :mod:`dead_letters`,
:mod:`thread_control`);
:mod:`options` holds the shared flags, :mod:`connection` what they say about etcd,
:mod:`output` the text and ``--json`` output, :mod:`exits` the exit codes.
"""

from __future__ import annotations

import os

# Before anything imports grpc: its C core would log every refused TLS handshake or
# connection attempt to stderr, lines per second; the command reports failures in one
# line of its own. A user who sets GRPC_VERBOSITY gets gRPC's logs as asked.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import etcd_leases
from etcd_leases.cli import (
    contract,
    dead_letters,
    demo,
    doctor,
    elect,
    exits,
    listing,
    run,
    server,
    thread_control,
)
from etcd_leases.cli.options import DURATION_FLAGS, Commands, shared_flags
from etcd_leases.cli.output import Output
from etcd_leases.cli.supervise import split_command
from etcd_leases.etcd import version

_EPILOG = """exit codes: 0 yes/done, 1 no (held, not the owner, free), 2 usage,
3 etcd unavailable, 4 permission denied, 5 other error, 75 run: the lease was lost,
128+N signal N; run and elect: the command's if it ended on its own.
Connection flags may also be given as ETCDCTL_ENDPOINTS, ETCDCTL_CACERT, ETCDCTL_CERT,
ETCDCTL_KEY, ETCDCTL_USER, ETCDCTL_PASSWORD, ETCDCTL_COMMAND_TIMEOUT,
ETCDCTL_DIAL_TIMEOUT and ETCD_LEASES_PREFIX."""


def parser() -> argparse.ArgumentParser:
    top = exits.Parser(
        prog="etcd-leases",
        description="One owner per key, on etcd: leases, fencing tokens, leader election.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[shared_flags(in_command=False)],
    )
    top.add_argument("--version", action="version", version=f"%(prog)s {etcd_leases.__version__}")
    commands = top.add_subparsers(metavar="COMMAND", required=True)
    groups = (contract, listing, doctor, run, elect, server, demo, dead_letters, thread_control)
    for group in groups:
        group.add_commands(Commands(commands, shared_flags(in_command=True)))
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv``; the exit code (see :mod:`etcd_leases.cli.exits`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if {"run", "elect"} & set(argv[: argv.index("--") if "--" in argv else None]):
        # Everything after "--" is the command, even words that look like our flags.
        argv, command = split_command(argv)
    top = parser()
    args, unexpected = top.parse_known_args(_negative_durations(argv))
    if unexpected:
        if getattr(args, "takes_command", False):
            top.error(
                f"unexpected {' '.join(unexpected)!r}: the command to run goes after --, "
                f"e.g. etcd-leases run KEY -- CMD ARG..."
            )
        top.error(f"unrecognized arguments: {' '.join(unexpected)}")
    args.command = command
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if not getattr(args, "long_lived", False):
        # Known etcd bugs are for the log of a process that runs for a while, once;
        # repeated by every short command they are noise. `doctor` shows them.
        logging.getLogger(version.__name__).setLevel(logging.ERROR)
    # SIGTERM unwinds like Ctrl-C, so what a command started (etcd members, leases) is
    # cleaned up; run, elect and server handle both signals themselves.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code: int = asyncio.run(args.handler(args, Output(args.json)))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (``etcd-leases watch | head -1``): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exits.OK
    except Exception as exc:
        return exits.fail(exc)
    return code


def _negative_durations(argv: list[str]) -> list[str]:
    """``--ttl -5s`` as ``--ttl=-5s``: argparse would take ``-5s`` for a flag, and
    say only that ``--ttl`` wants a value, rather than that this one is negative."""
    joined: list[str] = []
    for word in argv:
        if joined and joined[-1] in DURATION_FLAGS and word[:1] == "-" and word[1:2].isdigit():
            joined[-1] = f"{joined[-1]}={word}"
        else:
            joined.append(word)
    return joined


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def entry_point() -> None:
    sys.exit(main())
