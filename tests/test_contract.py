"""Bad input, capability detection and the no-op provider."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from etcd_leases import (
    AcquireResult,
    EtcdLeaseProvider,
    InMemoryLeaseProvider,
    LeaseError,
    LeaseProvider,
    NoopLeaseProvider,
    is_lease_provider,
    lease_provider_for,
)
from tests.conftest import Backend

BAD_TEXT: list[tuple[object, type[Exception], str]] = [
    (None, TypeError, "must be a str"),
    (b"bytes", TypeError, "must be a str"),
    (42, TypeError, "must be a str"),
    ("", ValueError, "must not be empty"),
    ("bad\udc80surrogate", ValueError, "not encodable as UTF-8"),
]
BAD_TTL: list[tuple[object, type[Exception], str]] = [
    (True, TypeError, "must be an int"),
    (1.5, TypeError, "must be an int"),
    (1000.0, TypeError, "must be an int"),
    (float("nan"), TypeError, "must be an int"),
    (float("inf"), TypeError, "must be an int"),
    ("1000", TypeError, "must be an int"),
    (None, TypeError, "must be an int"),
    (0, ValueError, "1 ..= 9000000000000"),
    (-5, ValueError, "1 ..= 9000000000000"),
    (9_000_000_000_001, ValueError, "1 ..= 9000000000000"),
]

Call = Callable[[LeaseProvider, Any], Awaitable[object]]

KEY_CALLS: list[Call] = [
    lambda p, k: p.acquire_lease(k, "o", 1000),
    lambda p, k: p.get_lease_owner(k),
    lambda p, k: p.release_lease(k, "o"),
    lambda p, k: p.renew_lease(k, "o", 1000),
    lambda p, k: p.transfer_lease(k, "o", "p", 1000),
]
OWNER_CALLS: list[tuple[str, Call]] = [
    ("owner", lambda p, o: p.acquire_lease("k", o, 1000)),
    ("owner", lambda p, o: p.release_lease("k", o)),
    ("owner", lambda p, o: p.renew_lease("k", o, 1000)),
    ("from_owner", lambda p, o: p.transfer_lease("k", o, "p", 1000)),
    ("to_owner", lambda p, o: p.transfer_lease("k", "o", o, 1000)),
]
TTL_CALLS: list[Call] = [
    lambda p, t: p.acquire_lease("k", "o", t),
    lambda p, t: p.renew_lease("k", "o", t),
    lambda p, t: p.transfer_lease("k", "o", "p", t),
]


async def expect_rejected(
    provider: LeaseProvider, call: Call, arg: object, error: type[Exception], words: str, name: str
) -> None:
    with pytest.raises(error) as caught:
        await call(provider, arg)
    assert isinstance(caught.value, LeaseError)
    assert name in str(caught.value) and words in str(caught.value)


async def nothing_written(backend: Backend, leases_before: set[int]) -> None:
    if isinstance(backend.provider, EtcdLeaseProvider):
        client = backend.provider.client
        assert await client.range_prefix(backend.provider.etcd_key("")) == []
        assert set(await client.leases()) - leases_before == set()


async def leases_now(backend: Backend) -> set[int]:
    if isinstance(backend.provider, EtcdLeaseProvider):
        return set(await backend.provider.client.leases())
    return set()


async def test_bad_input_is_rejected_with_nothing_written(backend: Backend) -> None:
    before = await leases_now(backend)
    for call in KEY_CALLS:
        for value, error, words in BAD_TEXT:
            await expect_rejected(backend.provider, call, value, error, words, "key")
        too_long = "é" * 2049  # 4098 UTF-8 bytes
        await expect_rejected(backend.provider, call, too_long, ValueError, "4098", "key")
    for name, call in OWNER_CALLS:
        for value, error, words in BAD_TEXT:
            await expect_rejected(backend.provider, call, value, error, words, name)
        await expect_rejected(backend.provider, call, "o" * 1025, ValueError, "1025", name)
    for call in TTL_CALLS:
        for value, error, words in BAD_TTL:
            await expect_rejected(backend.provider, call, value, error, words, "ttl_ms")
    await nothing_written(backend, before)


async def test_limits_are_inclusive(backend: Backend) -> None:
    key, owner = "k" * 4096, "o" * 1024
    assert (await backend.provider.acquire_lease(key, owner, 1)).acquired
    await backend.provider.release_lease(key, owner)


async def test_noop_provider() -> None:
    noop = NoopLeaseProvider()
    assert await noop.acquire_lease("k", "a", 1000) == AcquireResult(True, "a", None, 1000)
    assert await noop.acquire_lease("k", "b", 1000) == AcquireResult(True, "b", None, 1000)
    assert await noop.get_lease_owner("k") is None
    await noop.release_lease("k", "a")
    assert await noop.renew_lease("k", "nobody", 1000) is True
    assert await noop.transfer_lease("k", "x", "y", 1000) is True
    with pytest.raises(ValueError):
        await noop.acquire_lease("", "a", 1000)


class Duck:
    """A provider from another package: five callables, no relation to our classes."""

    async def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> AcquireResult:
        return AcquireResult(True, owner)

    async def get_lease_owner(self, key: str) -> str | None:
        return None

    async def release_lease(self, key: str, owner: str) -> None:
        return None

    async def renew_lease(self, key: str, owner: str, ttl_ms: int) -> bool:
        return True

    async def transfer_lease(self, key: str, from_owner: str, to_owner: str, ttl_ms: int) -> bool:
        return True


class HalfDuck:
    async def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> AcquireResult:
        return AcquireResult(True, owner)

    get_lease_owner = "not callable"


def test_is_lease_provider() -> None:
    assert is_lease_provider(Duck())
    assert is_lease_provider(InMemoryLeaseProvider())
    assert is_lease_provider(NoopLeaseProvider())
    assert is_lease_provider(EtcdLeaseProvider())  # structural: no connection made
    assert not is_lease_provider(None)
    assert not is_lease_provider(HalfDuck())
    assert not is_lease_provider(object())
    assert isinstance(Duck(), LeaseProvider)


def test_lease_provider_for() -> None:
    duck = Duck()

    class Storage:
        def __init__(self, provider: object) -> None:
            self.provider = provider

        def get_lease_provider(self) -> object:
            return self.provider

    assert lease_provider_for(Storage(duck)) is duck
    assert isinstance(lease_provider_for(Storage(None)), NoopLeaseProvider)
    assert lease_provider_for(duck) is duck
    assert isinstance(lease_provider_for(object()), NoopLeaseProvider)
    assert isinstance(lease_provider_for(None), NoopLeaseProvider)
