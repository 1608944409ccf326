"""Flags every command shares (etcdctl's connection flags, output), and their types.

What the connection flags mean, with etcdctl's variables, is :mod:`connection`'s.
"""

from __future__ import annotations

import argparse
import re

from etcd_leases.cli.exits import Parser
from etcd_leases.etcd.provider import DEFAULT_PREFIX

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
#: Flags that take a duration; ``--ttl -5s`` must reach them, not look like a flag.
DURATION_FLAGS = (
    "--ttl",
    "--grace",
    "--wait",
    "--command-timeout",
    "--dial-timeout",
    "--liveness-timeout",
)


class Commands:
    """Where command modules add their subcommands, each given the shared flags.

    The shared flags go before or after the command name, as etcdctl's do.
    """

    def __init__(
        self,
        commands: argparse._SubParsersAction[Parser],
        common: Parser,
    ) -> None:
        self._commands = commands
        self._common = common

    def add_parser(self, name: str, *, help: str) -> argparse.ArgumentParser:
        return self._commands.add_parser(name, help=help, description=help, parents=[self._common])


def shared_flags(*, in_command: bool) -> Parser:
    """The flags of every command: connection, ``--json``, ``--log-level``.

    Given both before the command name and after it; after it, a flag left out must
    not reset what was given before, hence no defaults there.
    """

    def default(value: object) -> object:
        return argparse.SUPPRESS if in_command else value

    parser = Parser(add_help=False, argument_default=default(None))
    group = parser.add_argument_group("connection (etcdctl's flags and ETCDCTL_* variables)")
    group.add_argument("--endpoints", help="comma-separated host:port (default 127.0.0.1:2379)")
    group.add_argument("--cacert", dest="tls_cacert", help="CA of the etcd servers (PEM)")
    group.add_argument("--cert", dest="tls_cert", help="client certificate (PEM)")
    group.add_argument("--key", dest="tls_key", help="client key (PEM)")
    group.add_argument("--user", help="etcd user as name:password, or name with --password")
    group.add_argument("--password", help="etcd password (better: ETCDCTL_PASSWORD, not in ps)")
    group.add_argument("--prefix", help=f"where the lease keys live (default {DEFAULT_PREFIX})")
    group.add_argument(
        "--command-timeout",
        type=duration,
        help="time limit of a command's etcd calls, retries included; per call once run "
        "or elect holds its lease (5s)",
    )
    group.add_argument(
        "--dial-timeout", type=duration, help="time to connect to an endpoint (no separate limit)"
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--json", action="store_true", default=default(False), help="print JSON for scripts"
    )
    output.add_argument(
        "--log-level",
        default=default("warning"),
        choices=["debug", "info", "warning", "error"],
        help="library log messages on stderr (warning)",
    )
    return parser


def duration(text: str) -> float:
    """``"15s"``, ``"500ms"``, ``"2m"``, ``"1h"`` or a number of seconds, in seconds."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r}: a duration cannot be negative")
    match = _DURATION.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 15s, 500ms or 2m")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2) or "s"]


def ttl_ms(text: str) -> int:
    """A TTL flag in whole milliseconds; refused below 1 ms, as the library refuses it."""
    ms = round(duration(text) * 1000)
    if ms < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a TTL must be at least 1ms")
    return ms


def port(text: str) -> int:
    """A TCP port number, 1 to 65535."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1 to 65535)")
    return int(text)
