"""What ``run`` and ``elect`` share: the command they supervise, signals, metrics.

The command runs as a child process with the tenure in its environment
(``ETCD_LEASES_KEY``, ``ETCD_LEASES_OWNER``, ``ETCD_LEASES_TOKEN``,
``ETCD_LEASES_TTL_MS``, plus the connection as etcdctl's variables, so it can fence
its own writes). It is stopped with SIGTERM, then SIGKILL after ``--grace``.
SIGTERM and SIGINT to ``etcd-leases`` itself do not kill it: they set a stop event,
so the lease is given back once the command is down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Self, TypeVar

from etcd_leases.cli.exits import UsageError, signal_code
from etcd_leases.cli.options import duration, port
from etcd_leases.cli.output import Output
from etcd_leases.contract import HoldingProvider
from etcd_leases.hold import HeldLease
from etcd_leases.providers import EtcdLeaseProvider

if TYPE_CHECKING:
    from etcd_leases.cli.health import Health

T = TypeVar("T")


def add_supervision_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--grace", type=duration, default=10.0, help="SIGTERM to SIGKILL, when stopping CMD (10s)"
    )
    parser.add_argument(
        "--metrics-port",
        type=port,
        help="serve /metrics, /healthz (liveness) and /readyz (etcd answers) on this port",
    )
    parser.add_argument(
        "--metrics-address", default="127.0.0.1", help="address to serve metrics on (127.0.0.1)"
    )
    parser.add_argument(
        "--liveness-timeout",
        type=duration,
        default=20.0,
        help="/healthz fails once the lease has been lost this long while still held (20s)",
    )
    parser.epilog = "The command to run follows the options, after --: ... -- CMD [ARG...]"


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """``run``/``elect`` flags, and the command after the first ``--``."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


def command_of(args: argparse.Namespace) -> list[str]:
    command: list[str] = args.command
    if not command:
        raise UsageError("give the command to run after --, e.g. -- sleep 60")
    if shutil.which(command[0]) is None:
        raise UsageError(f"command not found: {command[0]}")
    return command


def default_owner() -> str:
    """``host-pid``: unique per process, and says where to look."""
    return f"{socket.gethostname()}-{os.getpid()}"


@asynccontextmanager
async def metered(
    provider: EtcdLeaseProvider, args: argparse.Namespace, key: str
) -> AsyncIterator[tuple[HoldingProvider, Health | None]]:
    """``provider``, counted, with metrics and probes served over HTTP (see
    :mod:`~etcd_leases.cli.health`) when ``--metrics-port`` is given; ``key`` is
    read to check etcd. With the probes' state, or ``None`` without ``--metrics-port``.
    """
    if args.metrics_port is None:
        yield provider, None
        return
    try:
        from etcd_leases.cli.health import Health
        from etcd_leases.metrics import MeteredProvider
    except ImportError:
        raise UsageError(
            "--metrics-port needs prometheus-client: pip install 'etcd-leases[metrics]'"
        ) from None
    wrapped = MeteredProvider(provider)
    async with contextlib.aclosing(Health(wrapped, key, args.liveness_timeout)) as health:
        try:
            await health.serve(args.metrics_address, args.metrics_port)
        except OSError as exc:  # in use, or an address not of this host
            where = f"{args.metrics_address}:{args.metrics_port}"
            raise UsageError(
                f"--metrics-port {args.metrics_port}: cannot serve on {where}: "
                f"{exc.strerror or exc}"
            ) from None
        yield wrapped, health


async def start_command(
    command: list[str],
    connection: dict[str, str],
    lease: HeldLease,
    out: Output,
    event: str,
    text: str,
    **data: object,
) -> Child:
    """Start the command for ``lease`` and say so: ``text``, then what was started.

    Its environment is ours, plus ``connection`` (see ``connection_env``) and the tenure.
    """
    child = await Child.start(command, _lease_env(connection, lease))
    out.event(
        event,
        f"{text} (token {lease.token}); started {command[0]} (pid {child.pid})",
        token=lease.token,
        pid=child.pid,
        **data,
    )
    return child


def _lease_env(connection: dict[str, str], lease: HeldLease) -> dict[str, str]:
    return {
        **os.environ,
        **connection,
        "ETCD_LEASES_KEY": lease.key,
        "ETCD_LEASES_OWNER": lease.owner,
        "ETCD_LEASES_TOKEN": str(lease.token),
        "ETCD_LEASES_TTL_MS": str(lease.ttl_ms),
    }


class StopSignals:
    """Within ``with``, SIGTERM and SIGINT set ``event`` (and ``signal``) instead of killing us."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.signal: int | None = None

    def __enter__(self) -> Self:
        loop = asyncio.get_running_loop()
        # Put back on exit: remove_signal_handler would leave the default (death).
        self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in self._previous:
            loop.add_signal_handler(sig, self._received, sig)
        return self

    def __exit__(self, *exc_info: object) -> None:
        loop = asyncio.get_running_loop()
        for sig, previous in self._previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, previous)

    def _received(self, sig: int) -> None:
        if self.signal is None:
            self.signal = sig
        self.event.set()


async def until_stopped(stop: asyncio.Event, awaitable: asyncio.Future[T]) -> T | None:
    """``awaitable``'s result, or ``None`` (it cancelled) if ``stop`` is set first."""
    stopped: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([awaitable, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if awaitable.done():
        return awaitable.result()
    awaitable.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await awaitable
    return None


# Run in front of the command (then replaced by it, same pid) on Linux: the command
# gets SIGKILL if etcd-leases dies, even by SIGKILL, rather than run on without the
# lease while another process starts the same work. Done in a process of its own
# because nothing but exec is safe in a fork of a process running gRPC threads.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(128 + signal.SIGKILL)  # etcd-leases died before prctl took effect
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    print(f"etcd-leases: {sys.argv[2]}: {exc.strerror}", file=sys.stderr)
    sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)
"""


def _wrapped(command: Sequence[str]) -> list[str]:
    if sys.platform != "linux":
        return list(command)
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


class Child:
    """The supervised command."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, command: Sequence[str], env: dict[str, str]) -> Child:
        return cls(await asyncio.create_subprocess_exec(*_wrapped(command), env=env))

    @property
    def pid(self) -> int:
        return self.process.pid

    async def wait(self) -> int:
        """Its exit code, as a shell reports it (128+N when killed by signal N)."""
        return signal_code(await self.process.wait())

    async def stop(self, grace: float, sig: int = signal.SIGTERM) -> int:
        """Send ``sig``, then SIGKILL after ``grace`` seconds; its exit code."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)
            try:
                async with asyncio.timeout(grace):
                    return await self.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
        return await self.wait()
