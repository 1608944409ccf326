"""Races of one owner with itself, and with etcd's clock (issue 6, defects 2 and 3).

Every write decided from a read compares what it read; an expired tenure is over
even while etcd has not deleted its key yet.
"""

from __future__ import annotations

import asyncio

from etcd_leases import EtcdLeaseProvider


async def released_after(provider: EtcdLeaseProvider, key: str, trial: int) -> None:
    """alice's release, started a little later each trial (0 to 6 ms): the other call's
    steps (read, grant, move, revoke) then land at every point of the release's."""
    await asyncio.sleep(trial % 30 * 0.0002)
    await provider.release_lease(key, "alice")


async def test_release_racing_a_renewal_with_another_ttl_is_never_lost(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """Renewing with another TTL moves the key to a new lease: a release that revoked
    the lease it had read left the key held (6 of 30 races)."""
    p = etcd_provider
    for trial in range(30):
        key = f"k{trial}"
        assert (await p.acquire_lease(key, "alice", 5000)).acquired
        await asyncio.gather(
            released_after(p, key, trial), p.renew_lease(key, "alice", 7000 + trial % 2 * 1000)
        )
        # Either order ends with the key free: release last frees it; renew last
        # finds it free and returns False.
        assert await p.get_lease_owner(key) is None, f"trial {trial}: release lost"


async def test_release_racing_a_self_transfer_is_never_lost(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    p = etcd_provider
    for trial in range(30):
        key = f"k{trial}"
        assert (await p.acquire_lease(key, "alice", 5000)).acquired
        await asyncio.gather(
            released_after(p, key, trial), p.transfer_lease(key, "alice", "alice", 5000)
        )
        assert await p.get_lease_owner(key) is None, f"trial {trial}: release lost"


async def test_an_expired_tenure_is_not_transferable(etcd_provider: EtcdLeaseProvider) -> None:
    """Between a lease's expiry on etcd's clock and etcd deleting its key (up to its
    500 ms expiry tick), transfer returned True (5 of 8 trials) where the model and
    renew say False."""
    p = etcd_provider
    in_window = 0
    for trial in range(8):
        key = f"k{trial}"
        result = await p.acquire_lease(key, "alice", 1000)
        assert result.acquired and result.ttl_ms == 1000
        # etcd granted the lease before acquire returned: past this, it has expired.
        await asyncio.sleep(1.05)
        if await p.get_lease_owner(key) == "alice":
            in_window += 1  # expired, key not deleted yet: the case in question
        assert not await p.transfer_lease(key, "alice", "bob", 5000), f"trial {trial}"
        assert await p.get_lease_owner(key) is None
    assert in_window > 0, "never caught the window between expiry and deletion"


async def test_release_of_a_tenure_that_moved_on_deletes_only_what_it_read(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    """The compare of a release is on the tenure read: a new owner is never released."""
    p = etcd_provider
    for trial in range(10):
        key = f"k{trial}"
        assert (await p.acquire_lease(key, "alice", 5000)).acquired
        await asyncio.gather(
            released_after(p, key, trial), p.transfer_lease(key, "alice", "bob", 5000)
        )
        # Transfer first: bob holds it and alice's release is a no-op. Release first:
        # the key is free and the transfer fails.
        assert await p.get_lease_owner(key) in (None, "bob")
