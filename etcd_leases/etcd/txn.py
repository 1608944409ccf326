"""Building etcd transactions so each one reads as a single line.

Txn.when(version_is(k, 0)).then(put(k, v, lease), get(k)).otherwise(get(k))
"""

from __future__ import annotations

from typing import Self

from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb


def create_revision_is(key: bytes, revision: int) -> pb.Compare:
    """True when the key was created at ``revision`` (0: the key does not exist)."""
    return pb.Compare(
        key=key,
        target=pb.Compare.CREATE,
        result=pb.Compare.EQUAL,
        create_revision=revision,
    )


def mod_revision_is(key: bytes, revision: int) -> pb.Compare:
    """True when the key was last written at ``revision``: nothing changed it since."""
    return pb.Compare(
        key=key, target=pb.Compare.MOD, result=pb.Compare.EQUAL, mod_revision=revision
    )


def mod_revision_at_most(key: bytes, revision: int) -> pb.Compare:
    """True when the key was last written at ``revision`` or before (and, with a value
    compare beside it, exists): a tenure that began after ``revision`` never matches."""
    return pb.Compare(
        key=key, target=pb.Compare.MOD, result=pb.Compare.LESS, mod_revision=revision + 1
    )


def lease_is(key: bytes, lease: int) -> pb.Compare:
    """True when the key exists under ``lease``."""
    return pb.Compare(key=key, target=pb.Compare.LEASE, result=pb.Compare.EQUAL, lease=lease)


def range_is_empty(key: bytes, range_end: bytes) -> pb.Compare:
    """True when no key lies in ``[key, range_end)`` (etcd compares an empty range as absent)."""
    return pb.Compare(
        key=key,
        range_end=range_end,
        target=pb.Compare.CREATE,
        result=pb.Compare.EQUAL,
        create_revision=0,
    )


def value_is(key: bytes, value: bytes) -> pb.Compare:
    return pb.Compare(key=key, target=pb.Compare.VALUE, result=pb.Compare.EQUAL, value=value)


def put(key: bytes, value: bytes, lease: int = 0) -> pb.RequestOp:
    return pb.RequestOp(request_put=pb.PutRequest(key=key, value=value, lease=lease))


def delete(key: bytes, *, prev_kv: bool = False) -> pb.RequestOp:
    """Delete ``key``; with ``prev_kv``, the answer carries the key as it was."""
    return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=key, prev_kv=prev_kv))


def get(key: bytes) -> pb.RequestOp:
    return pb.RequestOp(request_range=pb.RangeRequest(key=key))


def first_in_range(key: bytes, range_end: bytes) -> pb.RequestOp:
    """The first key of ``[key, range_end)`` (no value), and how many keys it holds."""
    request = pb.RangeRequest(key=key, range_end=range_end, limit=1, keys_only=True)
    return pb.RequestOp(request_range=request)


def delete_range(key: bytes, range_end: bytes) -> pb.RequestOp:
    """Delete every key in ``[key, range_end)``."""
    return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=key, range_end=range_end))


class Txn:
    """``Txn.when(*compares).then(*ops).otherwise(*ops)`` builds a ``TxnRequest``."""

    def __init__(self, compares: tuple[pb.Compare, ...]) -> None:
        self.request = pb.TxnRequest(compare=compares)

    @classmethod
    def when(cls, *compares: pb.Compare) -> Self:
        return cls(compares)

    def then(self, *ops: pb.RequestOp) -> Self:
        self.request.success.extend(ops)
        return self

    def otherwise(self, *ops: pb.RequestOp) -> Self:
        self.request.failure.extend(ops)
        return self


def first_kv(response: pb.TxnResponse) -> pb.KeyValue | None:
    """The key read by the ``get`` of whichever branch ran, or ``None`` if absent."""
    for op in response.responses:
        if op.HasField("response_range"):
            kvs = op.response_range.kvs
            return kvs[0] if kvs else None
    return None


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])
