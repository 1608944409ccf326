"""Idempotent sends: a caller-chosen id makes a retried send a no-op, for a while.

HTTP handlers and serverless functions retry a send whose answer they did not see. A
send that carries a :class:`SendId` leaves a tombstone naming the message it stored;
a later send to the same thread with the same id, within ``window_s`` seconds, finds
it and is acknowledged as a duplicate, storing nothing, even once the first message
has been handled and acknowledged. Each thread remembers at most ``max_per_thread``
ids: past that, the oldest is forgotten first.
"""

from __future__ import annotations

from dataclasses import dataclass

from etcd_leases.contract import check_key
from etcd_leases.errors import LeaseTypeError, LeaseValueError

#: How long a send id is remembered by default: 5 minutes (as Mastra's tombstones).
DEFAULT_WINDOW_S = 300.0
#: How many send ids a thread remembers by default, and the most it may be set to.
DEFAULT_MAX_PER_THREAD = 1000
MAX_PER_THREAD = 10_000
#: The longest window allowed: a day.
MAX_WINDOW_S = 86_400.0


@dataclass(frozen=True)
class SendId:
    """A send's caller-chosen id and how long (and how many per thread) ids are kept."""

    id: str
    window_s: float = DEFAULT_WINDOW_S
    max_per_thread: int = DEFAULT_MAX_PER_THREAD

    def __post_init__(self) -> None:
        check_key(self.id, "send_id")
        check_send_id_limits(self.window_s, self.max_per_thread)


def check_send_id_limits(window_s: object, max_per_thread: object) -> None:
    if isinstance(window_s, bool) or not isinstance(window_s, int | float):
        raise LeaseTypeError(f"send_id_window_s must be a number, not {type(window_s).__name__}")
    if not 0 < window_s <= MAX_WINDOW_S:
        raise LeaseValueError(f"send_id_window_s must be in (0, {MAX_WINDOW_S:g}], got {window_s}")
    if isinstance(max_per_thread, bool) or not isinstance(max_per_thread, int):
        raise LeaseTypeError(f"max_send_ids must be an int, not {type(max_per_thread).__name__}")
    if not 1 <= max_per_thread <= MAX_PER_THREAD:
        raise LeaseValueError(
            f"max_send_ids must be in 1 ..= {MAX_PER_THREAD}, got {max_per_thread}"
        )
