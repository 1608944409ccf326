"""Writes to other keys that land only while a tenure holds its key (fencing)."""

from __future__ import annotations

from collections.abc import Callable

from etcd_leases.contract import check_key, check_lease_call
from etcd_leases.errors import BackendUnavailable
from etcd_leases.etcd.copies import TxnCopies
from etcd_leases.etcd.txn import Txn, delete, first_kv, get, mod_revision_is, put, value_is
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb


class FencedWrites(TxnCopies):
    """``put_fenced`` / ``delete_fenced``: compared with the tenure's token and owner."""

    async def put_fenced(
        self, key: str, owner: str, token: int, data_key: str, value: bytes
    ) -> bool:
        check_key(data_key, "data_key")
        data = data_key.encode("utf-8")
        return await self._fenced(
            key,
            owner,
            token,
            data,
            put(data, value),
            lambda kv: kv is not None and kv.value == value,
        )

    async def delete_fenced(self, key: str, owner: str, token: int, data_key: str) -> bool:
        check_key(data_key, "data_key")
        data = data_key.encode("utf-8")
        return await self._fenced(key, owner, token, data, delete(data), lambda kv: kv is None)

    async def get_value(self, data_key: str) -> bytes | None:
        """The value of the etcd key ``data_key`` (as written by a fenced put)."""
        check_key(data_key, "data_key")
        self._client.check_open()
        kv = await self._client.range(data_key.encode("utf-8"))
        return None if kv is None else kv.value

    async def _fenced(
        self,
        key: str,
        owner: str,
        token: int,
        data_key: bytes,
        op: pb.RequestOp,
        shows_op: Callable[[pb.KeyValue | None], bool],
    ) -> bool:
        """Apply ``op`` to ``data_key`` only if the tenure ``token`` still holds ``key``.

        Each attempt also compares ``data_key``'s mod_revision as read just before, so
        when etcd's answer is lost the same transaction can be sent again and lands at
        most once. A copy that then fails shows why: ``data_key`` unchanged means the
        fence refused it; changed into what ``op`` makes of it (``shows_op``), a copy
        of ours landed (or a write with the same effect, which is as good). Changed
        otherwise, another writer came first: try again, unless a copy of ours may
        have landed under that write (then BackendUnavailable: the outcome is unknown).
        """
        check_lease_call(key, owner)
        self._client.check_open()
        lease_key = self.etcd_key(key)
        fence = (mod_revision_is(lease_key, token), value_is(lease_key, owner.encode("utf-8")))
        while True:
            before = await self._client.range(data_key)
            read = 0 if before is None else before.mod_revision
            txn = (
                Txn.when(*fence, mod_revision_is(data_key, read)).then(op).otherwise(get(data_key))
            )
            response, answers_lost = await self._send_copies(txn)
            if response.succeeded:
                return True
            now = first_kv(response)
            if (0 if now is None else now.mod_revision) == read:
                return False  # the fence refused it
            if answers_lost:
                if shows_op(now):
                    return True
                raise BackendUnavailable(
                    f"etcd: the answer to a fenced write of {data_key!r} was lost and "
                    "another write to it followed: whether ours applied is unknown"
                )
