"""Options every command shares: etcdctl's connection flags and variables, durations.

Flags win over variables: ``--endpoints`` / ``ETCDCTL_ENDPOINTS``, ``--cacert`` /
``ETCDCTL_CACERT``, ``--cert`` / ``ETCDCTL_CERT``, ``--key`` / ``ETCDCTL_KEY``,
``--user name:password`` / ``ETCDCTL_USER``, ``--command-timeout`` /
``ETCDCTL_COMMAND_TIMEOUT`` and ``--prefix`` / ``ETCD_LEASES_PREFIX``. Everything is
checked before anything connects, so a malformed endpoint fails at once.
"""

from __future__ import annotations

import argparse
import os
import re

from etcd_leases.cli.exits import UsageError
from etcd_leases.etcd.provider import DEFAULT_PREFIX
from etcd_leases.providers import EtcdLeaseProvider

DEFAULT_ENDPOINTS = "127.0.0.1:2379"  # etcdctl's default
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class Commands:
    """Where command modules add their subcommands, each given the shared flags.

    The shared flags go before or after the command name, as etcdctl's do.
    """

    def __init__(
        self,
        commands: argparse._SubParsersAction[argparse.ArgumentParser],
        common: argparse.ArgumentParser,
    ) -> None:
        self._commands = commands
        self._common = common

    def add_parser(self, name: str, *, help: str) -> argparse.ArgumentParser:
        return self._commands.add_parser(name, help=help, description=help, parents=[self._common])


def shared_flags(*, in_command: bool) -> argparse.ArgumentParser:
    """The flags of every command: connection, ``--json``, ``--log-level``.

    Given both before the command name and after it; after it, a flag left out must
    not reset what was given before, hence no defaults there.
    """

    def default(value: object) -> object:
        return argparse.SUPPRESS if in_command else value

    parser = argparse.ArgumentParser(add_help=False, argument_default=default(None))
    group = parser.add_argument_group("connection (etcdctl's flags and ETCDCTL_* variables)")
    group.add_argument(
        "--endpoints", help=f"comma-separated host:port (default {DEFAULT_ENDPOINTS})"
    )
    group.add_argument("--cacert", dest="tls_cacert", help="CA of the etcd servers (PEM)")
    group.add_argument("--cert", dest="tls_cert", help="client certificate (PEM)")
    group.add_argument("--key", dest="tls_key", help="client key (PEM)")
    group.add_argument("--user", help="etcd user as name:password")
    group.add_argument("--prefix", help=f"where the lease keys live (default {DEFAULT_PREFIX})")
    group.add_argument(
        "--command-timeout", type=duration, help="time per etcd call, retries included (5s)"
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
    match = _DURATION.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 15s, 500ms or 2m")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2) or "s"]


def ttl_ms(text: str) -> int:
    """A TTL flag in whole milliseconds (at least 1)."""
    return max(1, round(duration(text) * 1000))


def endpoints_given(args: argparse.Namespace) -> bool:
    return args.endpoints is not None or "ETCDCTL_ENDPOINTS" in os.environ


def _setting(args: argparse.Namespace, flag: str, variable: str) -> str | None:
    value: str | None = getattr(args, flag)
    return value if value is not None else os.environ.get(variable)


def connection_env(args: argparse.Namespace) -> dict[str, str]:
    """The connection as etcdctl's variables, for commands run on our behalf.

    Endpoints, prefix and TLS files; not the password (pass ``ETCDCTL_USER`` in the
    environment if the command needs it: it inherits ours). Read after
    :func:`open_provider`, which refused what was malformed.
    """
    endpoints = _setting(args, "endpoints", "ETCDCTL_ENDPOINTS") or DEFAULT_ENDPOINTS
    env = {"ETCDCTL_ENDPOINTS": ",".join(filter(None, map(str.strip, endpoints.split(","))))}
    prefix = _setting(args, "prefix", "ETCD_LEASES_PREFIX")
    env["ETCD_LEASES_PREFIX"] = DEFAULT_PREFIX if prefix is None else prefix
    for flag, variable in (("tls_cacert", "CACERT"), ("tls_cert", "CERT"), ("tls_key", "KEY")):
        if (value := _setting(args, flag, f"ETCDCTL_{variable}")) is not None:
            env[f"ETCDCTL_{variable}"] = value
    return env


def open_provider(args: argparse.Namespace, **overrides: str) -> EtcdLeaseProvider:
    """The provider the flags and variables describe (it connects on first use).

    The library reads the variables and checks the endpoints (``from_env``); flags
    win over variables, and ``overrides`` (``prefix``) over both.
    """
    flags = {
        "endpoints": args.endpoints,
        "prefix": args.prefix,
        "ca_cert": args.tls_cacert,
        "cert": args.tls_cert,
        "key": args.tls_key,
    }
    options: dict[str, object] = {name: value for name, value in flags.items() if value is not None}
    if args.user is not None:
        username, sep, password = args.user.partition(":")
        if not sep:
            raise UsageError("--user must be name:password")
        options["username"], options["password"] = username, password
    options["timeout"] = _command_timeout(args)
    options.update(overrides)
    return EtcdLeaseProvider.from_env(**options)


def _command_timeout(args: argparse.Namespace) -> float:
    """``--command-timeout`` or ``ETCDCTL_COMMAND_TIMEOUT`` (etcdctl's), else 5 s."""
    timeout: float | None = args.command_timeout
    if timeout is None and "ETCDCTL_COMMAND_TIMEOUT" in os.environ:
        try:
            timeout = duration(os.environ["ETCDCTL_COMMAND_TIMEOUT"])
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"ETCDCTL_COMMAND_TIMEOUT: {exc}") from None
    if timeout is not None and timeout <= 0:
        raise UsageError("--command-timeout must be more than 0")
    return 5.0 if timeout is None else timeout
