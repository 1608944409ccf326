"""The exit codes of the ``etcd-leases`` command, and the one-line error it prints.

| code | meaning |
| --- | --- |
| 0 | done: acquired, renewed, transferred, released, the key has an owner |
| 1 | no: held by someone else, not the owner, the key is free, a wait ran out |
| 2 | bad usage or input: a flag, an endpoint, a key, a TTL, a certificate file |
| 3 | etcd unavailable: no endpoint answered in time, or none had a leader |
| 4 | permission denied by etcd (credentials or role) |
| 5 | any other error from etcd or from etcd-leases itself |
| 75 | ``run``: the lease was lost, so the command was stopped (sysexits' EX_TEMPFAIL) |
| 128+N | interrupted by signal N (130: Ctrl-C, 143: SIGTERM) |

``run`` and ``elect`` exit with their command's code when it ended on its own (128+N
when it died of signal N, as shells report it).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from etcd_leases.errors import (
    BackendUnavailable,
    LeaseError,
    LeaseTypeError,
    LeaseValueError,
    PermissionDenied,
)

OK = 0
NO = 1
USAGE = 2
UNAVAILABLE = 3
PERMISSION = 4
FAILED = 5
LEASE_LOST = 75


class UsageError(Exception):
    """A command line that cannot work; reported before anything is sent to etcd."""


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line naming what was wrong (not the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def code_for(exc: BaseException) -> int:
    """The exit code that tells a script what kind of failure ``exc`` is."""
    if isinstance(exc, UsageError | LeaseValueError | LeaseTypeError | OSError):
        return USAGE
    if isinstance(exc, BackendUnavailable):
        return UNAVAILABLE
    if isinstance(exc, PermissionDenied):
        return PERMISSION
    return FAILED


def describe(exc: BaseException) -> str:
    """One line saying what went wrong, without a traceback."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror or exc}: {exc.filename}"
    kind = "" if isinstance(exc, UsageError | LeaseError) else f"{type(exc).__name__}: "
    return (kind + str(exc)).splitlines()[0] if str(exc) else type(exc).__name__


def fail(exc: BaseException) -> int:
    """Print ``exc`` as one line on stderr; its exit code."""
    print(f"etcd-leases: {describe(exc)}", file=sys.stderr, flush=True)
    return code_for(exc)


def signal_code(returncode: int) -> int:
    """A child's exit status as a shell reports it: 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode
