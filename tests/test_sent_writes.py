"""What fault tests blame on the library: a revoke sent once its tenures were lost is
the library clearing up after the loss, never its cause (no etcd: the sends go nowhere)."""

from __future__ import annotations

from typing import Any

from etcd_leases import InMemoryLeaseProvider
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from tests.stall import SentWrites, every_tenure_lost


async def _nowhere(path: str, request: Any, *args: Any, **kwargs: Any) -> None:
    return None


async def test_a_revoke_sent_once_every_tenure_on_its_lease_was_lost_is_no_cause() -> None:
    heard: list[tuple[str, int | bytes]] = []
    provider = InMemoryLeaseProvider()
    async with provider.hold("a", "me", 5000) as a, provider.hold("b", "me", 5000) as b:
        held = [(a, 7), (b, 7)]
        sent = SentWrites(
            listener=lambda what, which, at: heard.append((what, which)),
            known_lost=lambda lease_id: every_tenure_lost(held, lease_id),
        )
        send = sent.wrap(_nowhere)

        async def revoke(lease_id: int) -> None:
            await send("/etcdserverpb.Lease/LeaseRevoke", pb.LeaseRevokeRequest(ID=lease_id))

        await revoke(7)  # both held: it may end them
        await a.transfer("other")
        await revoke(7)  # b still held on it
        await b.transfer("other")
        await revoke(7)  # every tenure on it lost already
        await revoke(8)  # none of ours on it: it may end anyone's
    assert heard == [("revoke", 7), ("revoke", 7), ("revoke after loss", 7), ("revoke", 8)]
    assert sorted(sent.revoked) == [7, 8]
