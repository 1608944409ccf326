"""The floor: bare gRPC calls to etcd, no retries, no client logic, from this process.

Every raft round (grant, revoke, txn) costs at least what a bare call costs here;
what the library adds on top is measured against these.
"""

from __future__ import annotations

import grpc.aio
from google.protobuf.message import Message

from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

FLOOR_CALLS = ("Txn put", "LeaseGrant", "LeaseRevoke", "Range (linearizable)")


class BareEtcd:
    """One plain channel and the four calls, each a single unary RPC."""

    def __init__(self, endpoint: str, prefix: str) -> None:
        target = endpoint.split(",")[0].rpartition("://")[2]
        self._channel = grpc.aio.insecure_channel(target)
        self._prefix = prefix.encode()
        self._txn = self._unary("/etcdserverpb.KV/Txn", pb.TxnResponse)
        self._range = self._unary("/etcdserverpb.KV/Range", pb.RangeResponse)
        self._grant = self._unary("/etcdserverpb.Lease/LeaseGrant", pb.LeaseGrantResponse)
        self._revoke = self._unary("/etcdserverpb.Lease/LeaseRevoke", pb.LeaseRevokeResponse)

    def _unary(
        self, path: str, response: type[Message]
    ) -> grpc.aio.UnaryUnaryMultiCallable[Message, Message]:
        return self._channel.unary_unary(
            path,
            request_serializer=lambda request: request.SerializeToString(),
            response_deserializer=response.FromString,
        )

    def key(self, name: str) -> bytes:
        return self._prefix + b"bare/" + name.encode()

    async def close(self) -> None:
        await self._channel.close(None)

    async def txn_put(self, key: bytes, value: bytes) -> None:
        """One Txn with a single unconditional put: the cheapest consensus write."""
        put = pb.RequestOp(request_put=pb.PutRequest(key=key, value=value))
        await self._txn(pb.TxnRequest(success=[put]))

    async def grant(self, ttl_s: int) -> int:
        answer = await self._grant(pb.LeaseGrantRequest(TTL=ttl_s))
        assert isinstance(answer, pb.LeaseGrantResponse)
        return answer.ID

    async def revoke(self, lease_id: int) -> None:
        await self._revoke(pb.LeaseRevokeRequest(ID=lease_id))

    async def range(self, key: bytes) -> None:
        """Linearizable (etcd's default): a ReadIndex round, no raft write."""
        await self._range(pb.RangeRequest(key=key))

    async def take(self, key: bytes, ttl_s: int) -> int | None:
        """A bare lock: grant, then put the key on that lease if it is absent.

        The lease ID when taken; ``None`` (its lease revoked) when the key was held.
        """
        lease_id = await self.grant(ttl_s)
        absent = pb.Compare(
            key=key, target=pb.Compare.CREATE, result=pb.Compare.EQUAL, create_revision=0
        )
        put = pb.RequestOp(request_put=pb.PutRequest(key=key, value=b"bare", lease=lease_id))
        answer = await self._txn(pb.TxnRequest(compare=[absent], success=[put]))
        assert isinstance(answer, pb.TxnResponse)
        if not answer.succeeded:
            await self.revoke(lease_id)
            return None
        return lease_id
