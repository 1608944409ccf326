"""Dead letters: a thread's messages that failed ``max_attempts`` deliveries.

A message whose handler keeps failing (raising, returning without acknowledging it,
running past the run deadline, or crashing its process) would otherwise block its
thread for good. Once it has been delivered ``max_attempts`` times it is moved, in
one fenced step, from the thread's inbox to the thread's dead letters, where it waits
for someone to look: list them, retry one (sent again, at the end of the inbox) or
drop it.
"""

from __future__ import annotations

from dataclasses import dataclass

from etcd_leases.errors import LeaseValueError


@dataclass(frozen=True)
class DeadLetter:
    """A message moved out of ``thread``'s inbox after ``attempts`` failed deliveries.

    ``seq`` is the seq it had in the inbox; ``id`` names the dead letter (to retry or
    drop it).
    """

    thread: str
    seq: int
    payload: bytes
    id: str
    attempts: int

    @property
    def text(self) -> str:
        return self.payload.decode("utf-8")


def encode(attempts: int, payload: bytes) -> bytes:
    """A dead letter's stored value: its attempts on a first line, then the payload."""
    return b"%d\n" % attempts + payload


def decode(value: bytes) -> tuple[int, bytes]:
    attempts, _, payload = value.partition(b"\n")
    return int(attempts), payload


def check_max_attempts(max_attempts: object) -> None:
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int):
        raise LeaseValueError(f"max_attempts must be an int, not {type(max_attempts).__name__}")
    if max_attempts < 1:
        raise LeaseValueError(f"max_attempts must be at least 1, got {max_attempts}")
