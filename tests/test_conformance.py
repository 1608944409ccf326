"""Every row of the contract table, on the reference model and on every etcd found."""

from __future__ import annotations

import asyncio

from etcd_leases import AcquireResult
from tests.conftest import Backend

TTL = 2000
SHORT = 1000  # the test etcd members accept 1 s leases


async def test_acquire_free_key(backend: Backend) -> None:
    result = await backend.provider.acquire_lease("free", "alice", TTL)
    assert result.acquired and result.owner == "alice"
    assert isinstance(result.token, int) and result.token > 0
    assert result.ttl_ms is not None and result.ttl_ms >= TTL
    assert await backend.provider.get_lease_owner("free") == "alice"


async def test_acquire_expired_key(backend: Backend) -> None:
    first = await backend.provider.acquire_lease("exp", "alice", SHORT)
    await backend.expire("exp", SHORT)
    second = await backend.provider.acquire_lease("exp", "bob", TTL)
    assert second.acquired and second.owner == "bob"
    assert first.token is not None and second.token is not None
    assert second.token > first.token


async def test_reacquire_by_owner_keeps_tenure_and_resets_ttl(backend: Backend) -> None:
    first = await backend.provider.acquire_lease("re", "alice", TTL)
    await backend.sleep(1.3)
    again = await backend.provider.acquire_lease("re", "alice", TTL)
    assert again == AcquireResult(True, "alice", first.token, first.ttl_ms)
    await backend.sleep(1.3)  # past the first deadline, within the reset one
    assert await backend.provider.get_lease_owner("re") == "alice"


async def test_reacquire_with_another_ttl_never_moves_token_back(backend: Backend) -> None:
    first = await backend.provider.acquire_lease("rt", "alice", TTL)
    longer = await backend.provider.acquire_lease("rt", "alice", 5000)
    assert longer.acquired and longer.ttl_ms is not None and longer.ttl_ms >= 5000
    assert first.token is not None and longer.token is not None
    assert longer.token >= first.token


async def test_acquire_held_key_reports_holder_and_changes_nothing(backend: Backend) -> None:
    held = await backend.provider.acquire_lease("held", "alice", TTL)
    lost = await backend.provider.acquire_lease("held", "bob", TTL)
    assert lost == AcquireResult(False, "alice", None, None)
    again = await backend.provider.acquire_lease("held", "alice", TTL)
    assert again.token == held.token


async def test_concurrent_acquires_have_one_winner_and_losers_see_it(backend: Backend) -> None:
    contenders = [(backend.another_provider(), f"worker-{i}") for i in range(40)]
    results = await asyncio.gather(
        *(provider.acquire_lease("race", owner, TTL) for provider, owner in contenders)
    )
    winners = [r for r in results if r.acquired]
    assert len(winners) == 1
    winner = winners[0].owner
    assert all(r.owner == winner for r in results)
    assert await backend.provider.get_lease_owner("race") == winner


async def test_get_lease_owner(backend: Backend) -> None:
    assert await backend.provider.get_lease_owner("never") is None
    await backend.provider.acquire_lease("owned", "alice", SHORT)
    assert await backend.provider.get_lease_owner("owned") == "alice"
    await backend.expire("owned", SHORT)
    assert await backend.provider.get_lease_owner("owned") is None


async def test_release_by_owner_frees_at_once(backend: Backend) -> None:
    await backend.provider.acquire_lease("rel", "alice", TTL)
    await backend.provider.release_lease("rel", "alice")
    assert await backend.provider.get_lease_owner("rel") is None
    assert (await backend.provider.acquire_lease("rel", "bob", TTL)).acquired


async def test_release_by_other_or_of_free_key_is_noop(backend: Backend) -> None:
    await backend.provider.release_lease("nothing", "alice")
    held = await backend.provider.acquire_lease("rel2", "alice", TTL)
    await backend.provider.release_lease("rel2", "bob")
    assert await backend.provider.get_lease_owner("rel2") == "alice"
    assert (await backend.provider.acquire_lease("rel2", "alice", TTL)).token == held.token


async def test_release_after_takeover_keeps_new_owner(backend: Backend) -> None:
    await backend.provider.acquire_lease("rel3", "alice", SHORT)
    await backend.expire("rel3", SHORT)
    await backend.provider.acquire_lease("rel3", "bob", TTL)
    await backend.provider.release_lease("rel3", "alice")
    assert await backend.provider.get_lease_owner("rel3") == "bob"


async def test_renew_by_owner_resets_ttl(backend: Backend) -> None:
    held = await backend.provider.acquire_lease("ren", "alice", TTL)
    await backend.sleep(1.3)
    assert await backend.provider.renew_lease("ren", "alice", TTL) is True
    await backend.sleep(1.3)
    assert await backend.provider.get_lease_owner("ren") == "alice"
    again = await backend.provider.acquire_lease("ren", "alice", TTL)
    assert again.token == held.token


async def test_renew_after_expiry_is_false(backend: Backend) -> None:
    await backend.provider.acquire_lease("ren2", "alice", SHORT)
    await backend.expire("ren2", SHORT)
    assert await backend.provider.renew_lease("ren2", "alice", TTL) is False
    assert await backend.provider.get_lease_owner("ren2") is None


async def test_renew_by_non_owner_is_false(backend: Backend) -> None:
    await backend.provider.acquire_lease("ren3", "alice", TTL)
    assert await backend.provider.renew_lease("ren3", "bob", TTL) is False
    assert await backend.provider.renew_lease("free-ren", "bob", TTL) is False
    assert await backend.provider.get_lease_owner("ren3") == "alice"


async def test_renew_after_takeover_is_false(backend: Backend) -> None:
    await backend.provider.acquire_lease("ren4", "alice", TTL)
    assert await backend.provider.transfer_lease("ren4", "alice", "bob", TTL)
    assert await backend.provider.renew_lease("ren4", "alice", TTL) is False
    assert await backend.provider.get_lease_owner("ren4") == "bob"


async def test_transfer_while_holding(backend: Backend) -> None:
    held = await backend.provider.acquire_lease("tr", "alice", SHORT)
    assert await backend.provider.transfer_lease("tr", "alice", "bob", TTL) is True
    assert await backend.provider.get_lease_owner("tr") == "bob"
    await backend.sleep(1.3)  # past alice's TTL: bob has a fresh one
    assert await backend.provider.get_lease_owner("tr") == "bob"
    bob = await backend.provider.acquire_lease("tr", "bob", TTL)
    assert held.token is not None and bob.token is not None and bob.token > held.token
    assert (await backend.provider.acquire_lease("tr", "alice", TTL)).owner == "bob"


async def test_transfer_when_not_holding_changes_nothing(backend: Backend) -> None:
    assert await backend.provider.transfer_lease("tr-free", "alice", "bob", TTL) is False
    assert await backend.provider.get_lease_owner("tr-free") is None
    held = await backend.provider.acquire_lease("tr2", "carol", TTL)
    assert await backend.provider.transfer_lease("tr2", "alice", "bob", TTL) is False
    assert await backend.provider.get_lease_owner("tr2") == "carol"
    assert (await backend.provider.acquire_lease("tr2", "carol", TTL)).token == held.token


async def test_tokens_strictly_increase_across_owners(backend: Backend) -> None:
    p = backend.provider
    tokens = [(await p.acquire_lease("fence", "a", SHORT)).token]
    await p.release_lease("fence", "a")
    tokens.append((await p.acquire_lease("fence", "b", SHORT)).token)
    assert await p.transfer_lease("fence", "b", "c", SHORT)
    tokens.append((await p.acquire_lease("fence", "c", SHORT)).token)
    await backend.expire("fence", SHORT)
    tokens.append((await p.acquire_lease("fence", "d", TTL)).token)
    numbers = [t for t in tokens if t is not None]
    assert len(numbers) == 4 and numbers == sorted(set(numbers)), tokens


async def test_awkward_keys_and_owners(backend: Backend) -> None:
    keys = ["resource\0thread", "ключ/δ/🔑", "with space\n\ttab", "/", "a" * 4096]
    for i, key in enumerate(keys):
        owner = f"ówner-{i}\0x"
        result = await backend.provider.acquire_lease(key, owner, TTL)
        assert result.acquired, key
        assert await backend.provider.get_lease_owner(key) == owner
        assert (await backend.provider.acquire_lease(key, "other", TTL)).owner == owner
    # Keys that share a prefix stay distinct.
    assert await backend.provider.get_lease_owner("resource") is None
    assert await backend.provider.get_lease_owner("resource\0") is None


async def test_largest_ttl_is_accepted(backend: Backend) -> None:
    result = await backend.provider.acquire_lease("huge", "alice", 9_000_000_000_000)
    assert result.acquired and result.ttl_ms == 9_000_000_000_000
    await backend.provider.release_lease("huge", "alice")
