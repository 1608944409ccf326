"""One change of a key at a time in this process, for changes that read, then act.

``hold``'s take of a key and the settlement of an interrupted take both decide from
what they read whether the key's tenure is held here. Run side by side, a settlement
could read a tenure a take had put but not yet registered, and delete it under the
take that then returned it (a chaos run saw it, etcd stalling); see
:mod:`etcd_leases.etcd.kept`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class _Turns:
    __slots__ = ("lock", "waiting")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.waiting = 0  # holders and waiters: the entry goes with the last


class KeyLocks:
    """A lock per key, kept only while someone holds or waits for it (100,000 held
    keys leave none behind)."""

    def __init__(self) -> None:
        self._turns: dict[bytes, _Turns] = {}

    @contextlib.asynccontextmanager
    async def lock(self, key: bytes) -> AsyncIterator[None]:
        turns = self._turns.get(key)
        if turns is None:
            turns = self._turns[key] = _Turns()
        turns.waiting += 1
        try:
            async with turns.lock:
                yield
        finally:
            turns.waiting -= 1
            if not turns.waiting:
                del self._turns[key]

    def __len__(self) -> int:
        return len(self._turns)
