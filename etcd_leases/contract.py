"""The lease contract: five async calls that give one owner per key.

A port of the ``LeaseProvider`` contract of the Mastra agent framework. The meaning
of each call is written down in :class:`LeaseProvider`; :mod:`etcd_leases.memory`
is its executable reference model. Argument checks live here so every backend
rejects the same inputs with the same errors, before anything is sent.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol, TypeGuard, runtime_checkable

from etcd_leases.errors import LeaseTypeError, LeaseValueError

MAX_KEY_BYTES = 4096
MAX_OWNER_BYTES = 1024
MAX_TTL_MS = 9_000_000_000_000

LEASE_PROVIDER_METHODS = (
    "acquire_lease",
    "get_lease_owner",
    "release_lease",
    "renew_lease",
    "transfer_lease",
)


@dataclass(frozen=True)
class AcquireResult:
    """What :meth:`LeaseProvider.acquire_lease` decided.

    ``owner`` is the caller when ``acquired``, else the current holder (``None`` only
    if the holder vanished before it could be read). ``token`` is the fencing token
    of the holder's tenure; ``ttl_ms`` the TTL actually granted, when acquired.
    """

    acquired: bool
    owner: str | None
    token: int | None = None
    ttl_ms: int | None = None


@runtime_checkable
class LeaseProvider(Protocol):
    """One owner per key, with a TTL.

    - ``acquire_lease``: take a free or expired key; the current owner re-acquiring
      resets the TTL and keeps its tenure; a key held by another is left alone and
      its holder reported.
    - ``get_lease_owner``: the holder, or ``None``.
    - ``release_lease``: free the key if ``owner`` holds it, else do nothing.
    - ``renew_lease``: reset the TTL if ``owner`` still holds the key.
    - ``transfer_lease``: hand the key from ``from_owner`` to ``to_owner`` in one
      atomic step, with a fresh TTL; ``False`` if ``from_owner`` no longer holds it.
    """

    async def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> AcquireResult: ...

    async def get_lease_owner(self, key: str) -> str | None: ...

    async def release_lease(self, key: str, owner: str) -> None: ...

    async def renew_lease(self, key: str, owner: str, ttl_ms: int) -> bool: ...

    async def transfer_lease(
        self, key: str, from_owner: str, to_owner: str, ttl_ms: int
    ) -> bool: ...


@dataclass(frozen=True)
class OwnerState:
    """Who holds a key, and the token of that tenure; both ``None`` when it is free."""

    owner: str | None
    token: int | None


class Keeper(Protocol):
    """A tenure kept alive in the background (see :meth:`HoldingProvider.keep_lease`)."""

    @property
    def lost(self) -> asyncio.Event:
        """Set, once and for good, when the tenure is over or can no longer be vouched for."""
        ...

    @property
    def lost_reason(self) -> str | None: ...

    def remaining(self) -> float:
        """Seconds the tenure is guaranteed to last, on this process's monotonic clock."""
        ...

    def lose(self, reason: str) -> None:
        """Declare the tenure over (handed on, or its holder done); stops renewing."""
        ...


@runtime_checkable
class HoldingProvider(LeaseProvider, Protocol):
    """What the recipes (hold, election) need beyond the five calls.

    - ``acquire_kept``: ``acquire_lease`` and, when acquired, ``keep_lease`` in one
      step, so a backend can choose how held keys are kept (etcd: on one session
      lease per TTL). The keeper is ``None`` when the key was not acquired.
    - ``watch_owner``: the key's state now, then every change of tenure, with no polling.
    - ``keep_lease``: renew a tenure in the background and notice its loss at once,
      whether it expired, was released, transferred or deleted by anyone.
      ``valid_until`` is when the caller's own clock says the tenure ends (the time its
      acquiring request was sent plus the granted TTL). Raises ``LeaseLost`` if the
      tenure ``token`` names is already over.
    - ``put_fenced`` / ``delete_fenced``: write ``data_key`` only while the tenure
      ``token`` names still holds ``key``, atomically; ``False`` when it does not.
      ``get_value`` reads such data back.
    """

    async def acquire_kept(
        self, key: str, owner: str, ttl_ms: int
    ) -> tuple[AcquireResult, Keeper | None]: ...

    def watch_owner(self, key: str) -> AsyncGenerator[OwnerState, None]: ...

    async def keep_lease(
        self, key: str, owner: str, token: int, ttl_ms: int, valid_until: float
    ) -> Keeper: ...

    async def put_fenced(
        self, key: str, owner: str, token: int, data_key: str, value: bytes
    ) -> bool: ...

    async def delete_fenced(self, key: str, owner: str, token: int, data_key: str) -> bool: ...

    async def get_value(self, data_key: str) -> bytes | None: ...


def is_lease_provider(obj: object) -> TypeGuard[LeaseProvider]:
    """True when ``obj`` exposes the five calls, whatever class or package it comes from."""
    return obj is not None and all(
        callable(getattr(obj, name, None)) for name in LEASE_PROVIDER_METHODS
    )


def _check_text(name: str, value: object, max_bytes: int) -> None:
    if not isinstance(value, str):
        raise LeaseTypeError(f"{name} must be a str, not {type(value).__name__}")
    if not value:
        raise LeaseValueError(f"{name} must not be empty")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise LeaseValueError(f"{name} is not encodable as UTF-8: {exc.reason}") from None
    if size > max_bytes:
        raise LeaseValueError(f"{name} is {size} UTF-8 bytes, more than the {max_bytes} allowed")


def check_key(key: object, name: str = "key") -> None:
    """Reject a key that is not a non-empty, UTF-8 encodable str of at most 4096 bytes."""
    _check_text(name, key, MAX_KEY_BYTES)


def check_owner(owner: object, name: str = "owner") -> None:
    """Reject an owner that is not a non-empty, UTF-8 encodable str of at most 1024 bytes."""
    _check_text(name, owner, MAX_OWNER_BYTES)


def check_lease_call(key: object, owner: object, ttl_ms: object = 1) -> None:
    """The checks of acquire, release and renew (release has no TTL to check)."""
    check_key(key)
    check_owner(owner)
    check_ttl_ms(ttl_ms)


def check_transfer_call(key: object, from_owner: object, to_owner: object, ttl_ms: object) -> None:
    check_key(key)
    check_owner(from_owner, "from_owner")
    check_owner(to_owner, "to_owner")
    check_ttl_ms(ttl_ms)


def check_ttl_ms(ttl_ms: object) -> None:
    """Reject a TTL that is not an int (bools and floats included) in 1 ..= MAX_TTL_MS."""
    if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int):
        if isinstance(ttl_ms, float) and not math.isfinite(ttl_ms):
            raise LeaseTypeError(f"ttl_ms must be an int, not the float {ttl_ms}")
        raise LeaseTypeError(f"ttl_ms must be an int, not {type(ttl_ms).__name__}")
    if not 1 <= ttl_ms <= MAX_TTL_MS:
        raise LeaseValueError(f"ttl_ms must be in 1 ..= {MAX_TTL_MS}, got {ttl_ms}")
