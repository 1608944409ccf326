"""A copy sent again after a lost answer fails, though the first copy landed (issue 19, B).

The first copy of the transaction is applied and its answer lost; before the copy is
sent again, the same owner, in another process, changes the key. The copy then fails,
and the call answered a definite "no" although its first copy had landed (others
meanwhile routed work to that tenure). What the first copy did is in the key's history:
the call must answer from it, or say that its outcome is unknown.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from google.protobuf.message import Message

from etcd_leases import BackendUnavailable, EtcdLeaseProvider
from etcd_leases.etcd.txn import first_kv
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.testing import EtcdCluster
from tests.conftest import assert_freed, past_one_shot
from tests.test_lost_answers import lease_of, lost_answer
from tests.test_tenure_races import revoked

Meanwhile = Callable[[], Awaitable[object]]


class FirstCopyLost:
    """Arms ``provider``: its next transaction applies, then ``meanwhile`` runs, then
    the answer is lost. ``landed`` is the key as the lost answer showed it."""

    def __init__(self, provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch) -> None:
        self._meanwhile: Meanwhile | None = None
        self.landed: pb.KeyValue | None = None
        original = provider.client._attempt

        async def attempt(
            index: int, path: str, request: Message, response_type: type[Message], deadline: float
        ) -> Message:
            response = await original(index, path, request, response_type, deadline)
            if path.endswith("/Txn") and self._meanwhile is not None:
                meanwhile, self._meanwhile = self._meanwhile, None
                assert isinstance(response, pb.TxnResponse) and response.succeeded
                self.landed = first_kv(response)
                await meanwhile()
                raise lost_answer()
            return response

        monkeypatch.setattr(provider.client, "_attempt", attempt)

    def arm(self, meanwhile: Meanwhile) -> None:
        self._meanwhile = meanwhile


@pytest.fixture
async def elsewhere(
    etcd: EtcdCluster, etcd_provider: EtcdLeaseProvider
) -> AsyncIterator[EtcdLeaseProvider]:
    """Another process's provider on the same keys."""
    async with EtcdLeaseProvider(
        etcd.endpoints, prefix=etcd_provider.prefix, timeout=5
    ) as provider:
        yield provider


async def test_an_acquire_whose_first_copy_landed_says_it_acquired(
    etcd_provider: EtcdLeaseProvider,
    elsewhere: EtcdLeaseProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """o2 gets the key, and before the copy is sent again o2 (elsewhere) hands it on to
    o0: the copy finds o0, and the acquire answered "held by o0"."""
    p = etcd_provider
    lose = FirstCopyLost(p, monkeypatch)
    lose.arm(lambda: elsewhere.transfer_lease("k", "o2", "o0", 5000))
    result = await p.acquire_lease("k", "o2", 5000)
    assert lose.landed is not None
    assert (result.acquired, result.owner) == (True, "o2")
    assert result.token == lose.landed.mod_revision  # the tenure the first copy began
    assert result.ttl_ms == 5000  # ...and the TTL its lease was granted
    assert await p.get_lease_owner("k") == "o0"
    await revoked(p, lose.landed.lease)  # the key left it: not leaked


async def test_an_acquire_whose_first_copy_landed_after_changes_it_had_not_seen_says_so(
    etcd_provider: EtcdLeaseProvider,
    elsewhere: EtcdLeaseProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, on a lease from the pool (granted before): the key was taken and
    released elsewhere since the last revision this process saw, so its history holds
    those changes before the first copy's put. They are not the put: read past them."""
    p = etcd_provider
    await past_one_shot(p)  # from now on, a released lease goes back to the pool
    assert (await p.acquire_lease("warm", "o2", 5000)).acquired
    await p.release_lease("warm", "o2")
    assert p._pool.free_lease_ids()
    assert (await elsewhere.acquire_lease("k", "o9", 5000)).acquired  # unseen here
    await elsewhere.release_lease("k", "o9")
    lose = FirstCopyLost(p, monkeypatch)
    lose.arm(lambda: elsewhere.transfer_lease("k", "o2", "o0", 5000))
    result = await p.acquire_lease("k", "o2", 5000)
    assert lose.landed is not None
    assert (result.acquired, result.owner) == (True, "o2")
    assert result.token == lose.landed.mod_revision
    await revoked(p, lose.landed.lease)


# What the new owner does, elsewhere, before the transfer's copy is sent again.
AFTER_THE_MOVE: dict[str, Callable[[EtcdLeaseProvider], Awaitable[object]]] = {
    "re-acquires with another TTL": lambda other: other.acquire_lease("k", "o1", 8000),
    "releases": lambda other: other.release_lease("k", "o1"),
}


@pytest.mark.parametrize("then", list(AFTER_THE_MOVE))
async def test_a_transfer_whose_first_copy_landed_says_it_transferred(
    etcd_provider: EtcdLeaseProvider,
    elsewhere: EtcdLeaseProvider,
    monkeypatch: pytest.MonkeyPatch,
    then: str,
) -> None:
    """The first copy moved the key from o2 to o1; o1 changed it before the copy was
    sent again: the copy fails, and the transfer answered False."""
    p = etcd_provider
    assert (await p.acquire_lease("k", "o2", 5000)).acquired
    old = await lease_of(p, "k")
    lose = FirstCopyLost(p, monkeypatch)
    lose.arm(lambda: AFTER_THE_MOVE[then](elsewhere))
    assert await p.transfer_lease("k", "o2", "o1", 5000)
    assert lose.landed is not None and lose.landed.value == b"o1"
    await revoked(p, lose.landed.lease)
    await assert_freed(p, old)  # o2's tenure ended with the move: its lease is free


async def test_an_outcome_the_history_no_longer_tells_is_unknown(
    etcd: EtcdCluster,
    etcd_provider: EtcdLeaseProvider,
    elsewhere: EtcdLeaseProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """History compacted past the first copy: neither "yes" nor "no" can be told."""
    p = etcd_provider

    async def transferred_and_compacted() -> None:
        assert await elsewhere.transfer_lease("k", "o2", "o0", 5000)
        revision = (await elsewhere.client.range_at(elsewhere.etcd_key("k")))[1]
        await asyncio.to_thread(etcd.etcdctl, "compact", str(revision))

    lose = FirstCopyLost(p, monkeypatch)
    lose.arm(transferred_and_compacted)
    with pytest.raises(BackendUnavailable):
        await p.acquire_lease("k", "o2", 5000)
    assert lose.landed is not None


async def test_an_outcome_whose_history_is_not_read_in_time_is_unknown(
    etcd_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in the first test, and etcd (one member) freezes once the copy sent again
    has its answer: the history that would tell is not read in the client's timeout,
    so the acquire fails as unknown, saying so; it does not wait on a member that may
    never answer again."""
    with EtcdCluster(1, binary=etcd_binary) as cluster:
        member = cluster.members[0]
        async with (
            EtcdLeaseProvider(cluster.endpoints, timeout=1.0) as p,
            EtcdLeaseProvider(cluster.endpoints, prefix=p.prefix) as elsewhere,
        ):
            original = p.client._attempt
            answered: list[pb.TxnResponse] = []

            async def attempt(
                index: int,
                path: str,
                request: Message,
                response_type: type[Message],
                deadline: float,
            ) -> Message:
                response = await original(index, path, request, response_type, deadline)
                if isinstance(response, pb.TxnResponse):
                    answered.append(response)
                    if len(answered) == 1:  # the first copy landed; o2 hands the key on
                        assert await elsewhere.transfer_lease("k", "o2", "o0", 5000)
                        raise lost_answer()
                    if len(answered) == 2:  # the copy sent again found o0
                        member.pause()
                return response

            monkeypatch.setattr(p.client, "_attempt", attempt)
            try:
                async with asyncio.timeout(20):  # bounds a wait for the history
                    with pytest.raises(BackendUnavailable, match="was not read in time"):
                        await p.acquire_lease("k", "o2", 5000)
            finally:
                member.resume()
            assert [response.succeeded for response in answered] == [True, False]
