"""The etcd connection a command describes: flags and etcdctl's variables, checked.

Flags win over variables: ``--endpoints`` / ``ETCDCTL_ENDPOINTS``, ``--cacert`` /
``ETCDCTL_CACERT``, ``--cert`` / ``ETCDCTL_CERT``, ``--key`` / ``ETCDCTL_KEY``,
``--user`` / ``ETCDCTL_USER``, ``--password`` / ``ETCDCTL_PASSWORD``,
``--command-timeout`` / ``ETCDCTL_COMMAND_TIMEOUT``, ``--dial-timeout`` /
``ETCDCTL_DIAL_TIMEOUT`` and ``--prefix`` / ``ETCD_LEASES_PREFIX``. Everything is
checked before anything connects, so a malformed value fails at once, named.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from etcd_leases.cli.exits import UsageError
from etcd_leases.cli.options import duration
from etcd_leases.errors import BackendUnavailable
from etcd_leases.etcd.provider import DEFAULT_PREFIX
from etcd_leases.providers import EtcdLeaseProvider

DEFAULT_ENDPOINTS = "127.0.0.1:2379"  # etcdctl's default
DEFAULT_COMMAND_TIMEOUT_S = 5.0  # etcdctl's default
# A host name or IPv4 address, or an IPv6 address in brackets; gRPC would only find
# out when resolving, after the command timeout.
_HOST = re.compile(r"^(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.%A-Za-z]+\])$")
_PEM_MARKERS = {
    "tls_cacert": ("--cacert", "-----BEGIN CERTIFICATE-----"),
    "tls_cert": ("--cert", "-----BEGIN CERTIFICATE-----"),
    "tls_key": ("--key", "PRIVATE KEY-----"),
}


def setting(args: argparse.Namespace, flag: str, variable: str) -> str | None:
    """The flag's value, else the variable's, else ``None``."""
    value: str | None = getattr(args, flag)
    return value if value is not None else os.environ.get(variable)


def endpoints_given(args: argparse.Namespace) -> bool:
    return args.endpoints is not None or "ETCDCTL_ENDPOINTS" in os.environ


def _endpoints(args: argparse.Namespace) -> str:
    source = "--endpoints" if args.endpoints is not None else "ETCDCTL_ENDPOINTS"
    endpoints = setting(args, "endpoints", "ETCDCTL_ENDPOINTS") or DEFAULT_ENDPOINTS
    for endpoint in filter(None, map(str.strip, endpoints.split(","))):
        host = endpoint.partition("://")[2] or endpoint
        host = host.rsplit(":", 1)[0] if ":" in host else host
        if not _HOST.match(host):
            raise UsageError(f"{source}: {endpoint!r}: {host!r} is not a host name or address")
    return endpoints


def _tls_file(args: argparse.Namespace, flag: str, variable: str) -> str | None:
    """A TLS file's path, refused unless it holds PEM (gRPC would say so only on connect)."""
    path = setting(args, flag, variable)
    if path is None:
        return None
    name, marker = _PEM_MARKERS[flag]
    name = name if getattr(args, flag) is not None else variable
    if marker not in Path(path).read_text(errors="replace"):  # a missing file: OSError, exit 2
        kind = "private key" if flag == "tls_key" else "certificate"
        raise UsageError(f"{name} {path}: not a PEM {kind} (no {marker!r} line)")
    return path


def _credentials(args: argparse.Namespace) -> tuple[str, str] | None:
    """etcdctl's rules: ``--user name:password``, or ``--user name`` with ``--password``
    (kept out of ``ps``); the variables likewise."""
    user = setting(args, "user", "ETCDCTL_USER")
    password = setting(args, "password", "ETCDCTL_PASSWORD")
    source = "--user" if args.user is not None else "ETCDCTL_USER"
    if user is None:
        if password is not None:
            raise UsageError("a password needs a user name: give --user NAME too")
        return None
    if password is None:
        username, sep, password = user.partition(":")
        if not sep:
            raise UsageError(f"{source} must be name:password, or give --password")
        user = username
    if not user:
        raise UsageError(f"{source}: username must not be empty")
    return user, password


def command_timeout(args: argparse.Namespace) -> float:
    """``--command-timeout`` or ``ETCDCTL_COMMAND_TIMEOUT`` (etcdctl's), else 5 s."""
    return _timeout(args, "command_timeout", "ETCDCTL_COMMAND_TIMEOUT") or DEFAULT_COMMAND_TIMEOUT_S


def _timeout(args: argparse.Namespace, flag: str, variable: str) -> float | None:
    timeout: float | None = getattr(args, flag)
    name = "--" + flag.replace("_", "-")
    if timeout is None and variable in os.environ:
        name = variable
        try:
            timeout = duration(os.environ[variable])
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"{variable}: {exc}") from None
    if timeout is not None and timeout <= 0:
        raise UsageError(f"{name} must be more than 0")
    return timeout


def provider_of(args: argparse.Namespace, **overrides: str) -> EtcdLeaseProvider:
    """The provider the flags and variables describe (it connects on first use);
    ``overrides`` (``prefix``) win over both."""
    prefix = setting(args, "prefix", "ETCD_LEASES_PREFIX")
    options: dict[str, object] = {
        "endpoints": _endpoints(args),
        "prefix": DEFAULT_PREFIX if prefix is None else prefix,
        "ca_cert": _tls_file(args, "tls_cacert", "ETCDCTL_CACERT"),
        "cert": _tls_file(args, "tls_cert", "ETCDCTL_CERT"),
        "key": _tls_file(args, "tls_key", "ETCDCTL_KEY"),
        "timeout": command_timeout(args),
    }
    if (credentials := _credentials(args)) is not None:
        options["username"], options["password"] = credentials
    options.update(overrides)
    return EtcdLeaseProvider(**options)  # type: ignore[arg-type]


@asynccontextmanager
async def open_provider(
    args: argparse.Namespace, **overrides: str
) -> AsyncIterator[EtcdLeaseProvider]:
    """:func:`provider_of`, connected within ``--dial-timeout`` when one is given
    (etcdctl's), and closed after the block."""
    dial_timeout = _timeout(args, "dial_timeout", "ETCDCTL_DIAL_TIMEOUT")
    async with provider_of(args, **overrides) as provider:
        if dial_timeout is not None:
            await _dial(provider, dial_timeout)
        yield provider


async def _dial(provider: EtcdLeaseProvider, timeout: float) -> None:
    """Return once any endpoint accepted a connection; BackendUnavailable after ``timeout``."""
    client = provider.client
    ready = [
        asyncio.ensure_future(client.members.channel(index).channel_ready())
        for index in range(len(client.endpoints))
    ]
    done, pending = await asyncio.wait(ready, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for attempt in pending:
        attempt.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if not done:
        endpoints = ", ".join(client.endpoints)
        raise BackendUnavailable(
            f"etcd: UNAVAILABLE: could not connect to {endpoints} "
            f"within --dial-timeout {timeout:g} s"
        )


@asynccontextmanager
async def within_command_timeout(
    provider: EtcdLeaseProvider, args: argparse.Namespace
) -> AsyncIterator[None]:
    """Bound a block of ``provider``'s calls by ``--command-timeout``, as its help says.

    The client's own limit is per call, and a command makes several (the server's
    version, a lease grant, the transaction), and would tidy up after a cancelled
    one with more. Out of time, the connection is closed, so nothing more is asked of
    etcd: what was granted expires with its TTL.
    """
    timeout = command_timeout(args)
    limit = asyncio.timeout(timeout)
    try:
        async with limit:
            yield
    except TimeoutError:
        if not limit.expired():
            raise
        await provider.client.close()
        endpoints = ", ".join(provider.client.endpoints)
        raise BackendUnavailable(
            f"etcd: UNAVAILABLE: no answer from {endpoints} within --command-timeout {timeout:g} s"
        ) from None


def connection_env(args: argparse.Namespace) -> dict[str, str]:
    """The connection as etcdctl's variables, for commands run on our behalf.

    Endpoints, prefix and TLS files; not the password (pass ``ETCDCTL_USER`` in the
    environment if the command needs it: it inherits ours). Read after
    :func:`open_provider`, which refused what was malformed.
    """
    endpoints = setting(args, "endpoints", "ETCDCTL_ENDPOINTS") or DEFAULT_ENDPOINTS
    env = {"ETCDCTL_ENDPOINTS": ",".join(filter(None, map(str.strip, endpoints.split(","))))}
    prefix = setting(args, "prefix", "ETCD_LEASES_PREFIX")
    env["ETCD_LEASES_PREFIX"] = DEFAULT_PREFIX if prefix is None else prefix
    for flag, variable in (("tls_cacert", "CACERT"), ("tls_cert", "CERT"), ("tls_key", "KEY")):
        if (value := setting(args, flag, f"ETCDCTL_{variable}")) is not None:
            env[f"ETCDCTL_{variable}"] = value
    return env
