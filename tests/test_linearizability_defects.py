"""A defect the partition runs found, its steps forced (not hoped for), checked by the
linearizability checker: it failed every run before the fix.

``acquire_lease`` on a lease taken from the pool (granted ahead, so renewed alongside
the put) whose renewal is answered only after the lease ran out (a keep-alive held up
by a cut-off member: in the partition run the call took 0.76 s) takes its landed put
for a tenure that "never began" (``EtcdLeaseProvider._attach``: not ``alive``), tries
again and answers "refused, held by o1", although o0 held the key meanwhile, as
another provider using the same owner id was told (and it handed the key to o1). The
contract's answers are "acquired" (the put landed) or the outcome-unknown error, never
a "no". The acquire now reports the outcome unknown (``BackendUnavailable``). With
the renewal answered in time the same steps answer "acquired".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from etcd_leases import BackendUnavailable, EtcdLeaseProvider, LeaseError
from etcd_leases.etcd.keepalive import Renewal
from etcd_leases.etcd.session import Session
from etcd_leases.testing import EtcdCluster
from tests.conftest import eventually, past_one_shot, unique_prefix
from tests.linearizability.checker import check
from tests.linearizability.history import History
from tests.linearizability.recorder import RecordingProvider
from tests.linearizability.report import explain

TTL_MS = 1000


async def test_an_acquire_whose_lease_ran_out_under_its_put_does_not_answer_no(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix, history = unique_prefix(), History()
    async with (
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as late,
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as other,
    ):
        first, second = (
            RecordingProvider(late, history, "late"),
            RecordingProvider(other, history, "other"),
        )
        # A lease granted ahead for the TTL, so the acquire below renews it alongside.
        await past_one_shot(late)
        await late.acquire_lease("warm-up", "x", TTL_MS)
        await late.release_lease("warm-up", "x")
        await eventually(lambda: bool(late._pool.free_lease_ids()), "a lease granted ahead")
        renewals = late._renewals
        original = renewals.request_renewal
        delayed: list[int] = []

        def renewal_that_arrives_late(lease_id: int) -> asyncio.Future[Renewal]:
            if delayed:  # the first renewal only
                return original(lease_id)
            delayed.append(lease_id)
            later: asyncio.Future[Renewal] = asyncio.get_running_loop().create_future()

            async def after_the_others() -> None:
                # Meanwhile the other provider, as the same owner, sees o0 hold the
                # key and hands it to o1; the renewal is answered after the lease ran
                # out (without this wait the acquire answers "acquired": linearizable).
                assert await second.get_lease_owner("k") == "o0"
                assert await second.transfer_lease("k", "o0", "o1", 10_000)
                await asyncio.sleep(TTL_MS / 1000 * 2.5)
                later.set_result(await original(lease_id))

            asyncio.get_running_loop().create_task(after_the_others())
            return later

        monkeypatch.setattr(renewals, "request_renewal", renewal_that_arrives_late)
        with pytest.raises(BackendUnavailable):  # unknown: never a "no"
            await first.acquire_lease("k", "o0", TTL_MS)
        monkeypatch.setattr(renewals, "request_renewal", original)
    assert delayed, "the acquire renewed no lease alongside its put: the steps were not forced"
    result = check(history)
    print(explain(result, origin=history.ops[0].start))
    assert result.ok is True


async def test_a_hold_whose_session_ran_out_under_its_put_does_not_answer_no(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on hold's path: the put lands on the session lease, whose renewal sent
    alongside is answered only after the lease ended (revoked here, as etcd does on
    expiry) and another owner took the key. The put's tenure began and ended: the
    acquire must not answer "refused, held by o1" (it did, in a fault run's election)."""
    prefix = unique_prefix()
    async with (
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as late,
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as other,
    ):
        async with late.hold("warm-up", "x", TTL_MS):  # the session exists already
            pass
        sessions = late._sessions
        original = sessions.renewal
        delayed: list[int] = []

        def renewal_that_arrives_late(session: Session) -> asyncio.Future[Renewal]:
            if delayed:
                return original(session)
            delayed.append(session.lease_id)
            later: asyncio.Future[Renewal] = asyncio.get_running_loop().create_future()

            async def after_the_others() -> None:
                await eventually_async(lambda: other.get_lease_owner("k"), "o0")
                await late.client.revoke(session.lease_id)  # the session lease ends
                assert (await other.acquire_lease("k", "o1", 10_000)).acquired
                try:
                    later.set_result(await original(session))
                except LeaseError as exc:
                    later.set_exception(exc)

            asyncio.get_running_loop().create_task(after_the_others())
            return later

        monkeypatch.setattr(sessions, "renewal", renewal_that_arrives_late)
        with pytest.raises(BackendUnavailable):  # unknown: never a "no"
            await late.acquire_kept("k", "o0", TTL_MS)
        monkeypatch.setattr(sessions, "renewal", original)
    assert delayed, "the put renewed no session alongside: the steps were not forced"


async def eventually_async(read: Callable[[], Awaitable[object]], expected: object) -> None:
    """Wait until ``read()`` answers ``expected`` (every 10 ms, up to 10 s)."""
    for _ in range(1000):
        if await read() == expected:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never read {expected!r}")
