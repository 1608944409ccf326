"""Histories of the real provider on a quiet etcd, checked for linearizability.

Several providers (as several processes would be) drive random calls of the five
methods over the same keys; every call is recorded and the history checked against
the contract's model. A provider that answers reads from a 300 ms cache must fail.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

import pytest

from etcd_leases import AcquireResult, EtcdLeaseProvider, LeaseProvider
from etcd_leases.testing import EtcdCluster
from tests.conftest import unique_prefix
from tests.linearizability.checker import CheckResult, check
from tests.linearizability.history import History, show_answer
from tests.linearizability.report import explain
from tests.linearizability.workload import Task, drive, standard_tasks

PROVIDERS = 3
# Owner ids of each provider's own: none is used from two providers.
OWN_OWNERS = [[f"p{index}-o{number}" for number in range(3)] for index in range(PROVIDERS)]


def clients(
    providers: Sequence[LeaseProvider], owners: Sequence[Sequence[str]]
) -> dict[str, tuple[LeaseProvider, list[Task]]]:
    """Provider ``i`` is client ``p<i>``, calling as ``owners[i]``."""
    return {f"p{i}": (p, standard_tasks(owners[i], i)) for i, p in enumerate(providers)}


@pytest.fixture
async def providers(etcd: EtcdCluster) -> AsyncIterator[list[EtcdLeaseProvider]]:
    prefix = unique_prefix()
    made = [EtcdLeaseProvider(etcd.endpoints, prefix=prefix) for _ in range(PROVIDERS)]
    yield made
    for provider in made:
        await provider.close()


def checked(history: History) -> CheckResult:
    began = time.monotonic()
    result = check(history, timeout=60)
    took = time.monotonic() - began
    calls = len(history.ops)
    print(f"{calls} calls checked in {took:.2f} s ({calls / took:,.0f} calls/s)")
    print(explain(result, origin=min(op.start for op in history.ops)))
    return result


async def test_the_history_of_several_providers_is_linearizable(
    providers: list[EtcdLeaseProvider],
) -> None:
    """Each provider's tasks share owner ids; no owner id is used from two providers
    (the test below shares them across providers)."""
    history = await drive(clients(providers, OWN_OWNERS), time.monotonic() + 6, seed=1)
    assert checked(history).ok is True
    outcomes = {f"{op.call.name} {show_answer(op).split(',')[0]}" for op in history.ops}
    assert {"acquire acquired", "acquire refused", "transfer True", "renew True"} <= outcomes


async def test_the_same_owner_ids_from_several_providers_is_linearizable(
    providers: list[EtcdLeaseProvider],
) -> None:
    owners = ["o0", "o1", "o2"]  # used by every provider
    history = await drive(clients(providers, [owners] * PROVIDERS), time.monotonic() + 5, seed=2)
    assert checked(history).ok is True


class CachedReads:
    """A wrong provider: ``get_lease_owner`` answers from a cache up to 300 ms old."""

    def __init__(self, inner: LeaseProvider) -> None:
        self.inner = inner
        self.cache: dict[str, tuple[float, str | None]] = {}

    async def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> AcquireResult:
        return await self.inner.acquire_lease(key, owner, ttl_ms)

    async def get_lease_owner(self, key: str) -> str | None:
        cached = self.cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < 0.3:
            return cached[1]
        owner = await self.inner.get_lease_owner(key)
        self.cache[key] = (time.monotonic(), owner)
        return owner

    async def release_lease(self, key: str, owner: str) -> None:
        await self.inner.release_lease(key, owner)

    async def renew_lease(self, key: str, owner: str, ttl_ms: int) -> bool:
        return await self.inner.renew_lease(key, owner, ttl_ms)

    async def transfer_lease(self, key: str, from_owner: str, to_owner: str, ttl_ms: int) -> bool:
        return await self.inner.transfer_lease(key, from_owner, to_owner, ttl_ms)


async def test_a_provider_with_cached_reads_is_caught(
    providers: list[EtcdLeaseProvider],
) -> None:
    wrong: list[LeaseProvider] = [CachedReads(provider) for provider in providers]
    history = await drive(clients(wrong, OWN_OWNERS), time.monotonic() + 3)
    result = checked(history)
    assert result.ok is False
    assert "get_lease_owner()" in explain(result).split("Calls that cannot follow it:")[1]
