"""How soon to try a failing member again: waits that double while attempts keep
failing, up to a ceiling, and start over once one succeeds.

The keep-alive loop and the watch streams reopen their streams at this pace: quick
enough that a member back after a blip serves again within tens of milliseconds, slow
enough that a member that is down costs a request a second, not a tight loop. A call's
attempts (client.py) keep a quicker one of their own, since a caller waits on them.
"""

from __future__ import annotations

__all__ = ["Backoff"]


class Backoff:
    """Waits of ``first_s``, twice that, ... up to ``max_s``, one per failed attempt (by
    default the reconnect pace: 50 ms up to 1 s)."""

    def __init__(self, first_s: float = 0.05, max_s: float = 1.0) -> None:
        self._first_s = first_s
        self._max_s = max_s
        self._next_s = first_s

    def failed(self) -> float:
        """One more attempt failed: the wait before the next."""
        wait = self._next_s
        self._next_s = min(2 * wait, self._max_s)
        return wait

    def reset(self) -> None:
        """An attempt succeeded: the next failure waits ``first_s`` again."""
        self._next_s = self._first_s
