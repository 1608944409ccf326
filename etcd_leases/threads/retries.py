"""How a thread retries a message its handler did not acknowledge.

A message is *delivered* each time a run starts with it first in line: it is counted
(in the backend, so the count survives takeovers and crashed workers), the run waits
``backoff`` before handing it over again, and past ``max_attempts`` deliveries it goes
to the thread's dead letters instead (:mod:`etcd_leases.dead_letters`). Order stays
per thread: a message being retried is first in line, so the ones after it wait.
"""

from __future__ import annotations

from dataclasses import dataclass

from etcd_leases.dead_letters import check_max_attempts
from etcd_leases.errors import LeaseValueError


@dataclass(frozen=True)
class Retries:
    """``max_attempts`` deliveries (``None``: deliveries are neither counted nor
    limited, saving a write per run), ``backoff_s`` before the second, doubling up
    to ``max_backoff_s``; a handler still running ``run_deadline_s`` after its run
    started is cancelled (``None``: never)."""

    max_attempts: int | None = 5
    backoff_s: float = 0.1
    max_backoff_s: float = 30.0
    run_deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_attempts is not None:
            check_max_attempts(self.max_attempts)
        if not 0 <= self.backoff_s <= self.max_backoff_s < float("inf"):
            raise LeaseValueError("backoff must satisfy 0 <= backoff_s <= max_backoff_s")
        if self.run_deadline_s is not None and not 0 < self.run_deadline_s < float("inf"):
            raise LeaseValueError(f"run_deadline_s must be > 0, got {self.run_deadline_s}")

    def backoff(self, attempt: int) -> float:
        """How long to wait before delivering a message for the ``attempt``-th time."""
        if attempt < 2:
            return 0.0
        return min(self.backoff_s * 2.0 ** (attempt - 2), self.max_backoff_s)
