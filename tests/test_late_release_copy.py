"""A release copy applied late never ends a later tenure (found by the chaos run of
2026-12-04, etcd 3.4.23, right after a leader partition healed; its steps forced here).

A release is sent as copies after a lost answer. A copy whose answer was lost may still
be applied later: its proposal was on its way through raft. Each copy compared only
the owner's value, so a late one deleted whatever tenure the same owner had begun
since: a loss the library caused (in the chaos run the holder acted for 9 ms on a key
another worker had taken). Copies now also compare ``mod_revision`` with the highest
revision the client had seen when the release began, and a take that finds the
tenure a release with no answer may still end writes the key again (see
``etcd_leases.etcd.late_releases``). Each test failed on the code before, every run
(see the commit).
"""

from __future__ import annotations

import contextlib

import grpc
import pytest
from google.protobuf.message import Message

from etcd_leases import BackendUnavailable, EtcdLeaseProvider, LeaseError
from etcd_leases.etcd.late_releases import LateReleases
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.testing import EtcdCluster
from tests.conftest import etcd_error, past_one_shot, settled, unique_prefix

Attempt = tuple[int, str, Message, type[Message], float]
TTL_MS = 15_000


def is_release(request: Message) -> bool:
    return (
        isinstance(request, pb.TxnRequest)
        and len(request.success) == 1
        and request.success[0].HasField("request_delete_range")
        and request.compare[0].target == pb.Compare.VALUE
    )


def is_revoke(path: str) -> bool:
    return path.endswith("/LeaseRevoke")


def lose_answers(
    provider: EtcdLeaseProvider,
    monkeypatch: pytest.MonkeyPatch,
    *,
    withheld: list[Attempt],
    every_copy: bool,
) -> None:
    """A release's first request (a Txn copy or a revoke) is kept back, to be applied
    later by the test, and its answer lost; with ``every_copy``, the answers of the
    copies after it are lost too (they are never sent: nothing lands)."""
    client = provider.client
    original = client._attempt

    async def attempt(
        index: int, path: str, request: Message, response_type: type[Message], deadline: float
    ) -> Message:
        release = is_revoke(path) or (path.endswith("/Txn") and is_release(request))
        if release and (every_copy or not withheld):
            if not withheld:
                withheld.append((index, path, request, response_type, deadline))
            raise etcd_error(grpc.StatusCode.DEADLINE_EXCEEDED, "the answer was lost (test)")
        return await original(index, path, request, response_type, deadline)

    monkeypatch.setattr(client, "_attempt", attempt)


async def apply_late(provider: EtcdLeaseProvider, withheld: list[Attempt]) -> None:
    assert withheld, "the release's first request was not sent"
    index, path, request, response_type, _ = withheld[0]
    try:
        await provider.client._attempt(index, path, request, response_type, 5.0)
    except grpc.aio.AioRpcError as exc:
        # A revoke of a lease the new tenure left (and revoked): nothing to end.
        assert is_revoke(path) and exc.code() == grpc.StatusCode.NOT_FOUND, exc


async def test_a_release_copy_applied_late_does_not_end_a_later_hold(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release was answered (a second copy); the same owner holds the key again."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        withheld: list[Attempt] = []
        async with provider.hold("k", "me", 3000):
            lose_answers(provider, monkeypatch, withheld=withheld, every_copy=False)
            with contextlib.suppress(LeaseError):  # released by a second copy, or unknown
                await provider.release_lease("k", "me")
        await settled(provider)
        async with provider.hold("k", "me", 3000) as again:
            await apply_late(provider, withheld)
            assert await provider.get_lease_owner("k") == "me", "a late release copy took it"
            assert not again.lost.is_set(), again.lost_reason


async def test_a_hold_after_a_release_with_no_answer_begins_another_tenure(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No copy was answered (outcome unknown) and none landed yet: a hold by the same
    owner finds its old tenure still there. It must not hand that one out: the pending
    copy would end it under the holder."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        withheld: list[Attempt] = []
        async with provider.hold("k", "me", 3000) as first:
            with monkeypatch.context() as patch:
                lose_answers(provider, patch, withheld=withheld, every_copy=True)
                with pytest.raises(BackendUnavailable):
                    await provider.release_lease("k", "me")
            async with provider.hold("k", "me", 3000) as again:
                assert again.token > first.token, "the tenure a pending release may end"
                await apply_late(provider, withheld)
                assert await provider.get_lease_owner("k") == "me", "a late release copy took it"
                assert not again.lost.is_set(), again.lost_reason
        assert len(provider._late_releases) == 0, "the hold's release settled it"


@pytest.mark.parametrize("caller", ["one-shot", "worker"])
async def test_an_acquire_after_a_release_with_no_answer_begins_another_tenure(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch, caller: str
) -> None:
    """No answer to a release (a one-shot's revokes the tenure's lease; past the
    one-shot, releases are transactions), the key still the owner's: an acquire by the
    same owner must not refresh the tenure the pending revoke or copy may end."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        if caller == "worker":
            await past_one_shot(provider)
        # Long enough to outlast the release's retries (the lease is not renewed).
        first = await provider.acquire_lease("k", "me", TTL_MS)
        assert first.acquired and provider._pool.recycling == (caller == "worker")
        withheld: list[Attempt] = []
        with monkeypatch.context() as patch:
            lose_answers(provider, patch, withheld=withheld, every_copy=True)
            with pytest.raises(BackendUnavailable):
                await provider.release_lease("k", "me")
        assert is_revoke(withheld[0][1]) == (caller == "one-shot")
        before = await provider.client.range(provider.etcd_key("k"))
        again = await provider.acquire_lease("k", "me", TTL_MS)
        assert again.acquired and again.token is not None and first.token is not None
        assert again.token > first.token, "the tenure a pending release may end"
        # Moved onto another lease at once: the key was never free in between (not
        # re-created once the first tenure ran out).
        after = await provider.client.range(provider.etcd_key("k"))
        assert before is not None and after is not None
        assert after.create_revision == before.create_revision
        await apply_late(provider, withheld)
        assert await provider.get_lease_owner("k") == "me", "a late release took it"
        # The tenure begun past the release's reach is an ordinary one: kept as it is.
        assert (await provider.acquire_lease("k", "me", TTL_MS)).token == again.token
        await provider.release_lease("k", "me")
        assert len(provider._late_releases) == 0, "an answered release settled it"


async def test_an_answered_release_settles_the_one_with_no_answer_before_it(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release with no answer, then one answered (nothing between): the key is free,
    and nothing is remembered of the first (100,000 keys would keep their entries)."""
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
        await past_one_shot(provider)
        assert (await provider.acquire_lease("k", "me", TTL_MS)).acquired
        withheld: list[Attempt] = []
        with monkeypatch.context() as patch:
            lose_answers(provider, patch, withheld=withheld, every_copy=True)
            with pytest.raises(BackendUnavailable):
                await provider.release_lease("k", "me")
        assert len(provider._late_releases) == 1
        await provider.release_lease("k", "me")
        assert len(provider._late_releases) == 0
        assert await provider.get_lease_owner("k") is None
        await apply_late(provider, withheld)


async def test_a_release_ends_a_tenure_begun_where_its_client_did_not_see_it(
    etcd: EtcdCluster,
) -> None:
    """An owner id used from two processes: one releases what the other took, at a
    revision its own client never saw. Its first copy compares too low a revision;
    the release then compares the revision of that answer, and frees the key."""
    prefix = unique_prefix()
    async with (
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as here,
        EtcdLeaseProvider(etcd.endpoints, prefix=prefix) as there,
    ):
        assert await here.get_lease_owner("k") is None
        seen = here.client.revision_seen
        taken = await there.acquire_lease("k", "run-7", TTL_MS)
        assert taken.token is not None and taken.token > seen
        await here.release_lease("k", "run-7")
        assert await there.get_lease_owner("k") is None


def test_the_highest_revision_an_unanswered_release_compared_is_kept() -> None:
    """Two releases of one key with no answer, the later-sent one failing first: the
    tenures either may end stay flagged, up to the higher revision."""
    late = LateReleases()
    late.unknown(b"k", 12)
    late.unknown(b"k", 10)
    assert late.may_end(pb.KeyValue(key=b"k", mod_revision=11))
    assert not late.may_end(pb.KeyValue(key=b"k", mod_revision=13))
    assert len(late) == 0, "a tenure above the revision settles it"
    late.unknown(b"k", 14)
    late.answered(b"k")  # a later release was answered: the tenure it compared is over
    assert not late.may_end(pb.KeyValue(key=b"k", mod_revision=14))
