"""Sending a transaction again when etcd's answer is lost (invariant 5).

A copy of a transaction that compares what it changes lands at most once between all
its copies, so sending the same transaction again is safe where re-reading the key
is not (a read may overtake a transaction still in flight).
"""

from __future__ import annotations

from etcd_leases.errors import BackendError, BackendUnavailable, PermissionDenied
from etcd_leases.etcd.parts import BackendParts
from etcd_leases.etcd.rpc_errors import is_never_sent
from etcd_leases.etcd.txn import Txn, first_kv
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

# How many copies of a transaction to send when etcd's answers are lost.
_CAS_ATTEMPTS = 3


class TxnCopies(BackendParts):
    """Transactions sent until a copy is answered."""

    async def _send_copies(self, txn: Txn) -> tuple[pb.TxnResponse, bool]:
        """Send ``txn`` until a copy is answered; the answer, and whether any was lost.

        Only for transactions whose copies land at most once between them. A copy
        gRPC could not send to any member within the timeout ends the copies. A copy
        refused (say, etcd too busy) after an earlier copy's answer was lost says
        nothing of that earlier copy: the outcome is unknown (BackendUnavailable).
        """
        for attempt in range(_CAS_ATTEMPTS):
            try:
                response = await self._batcher.txn(txn.request)
                return response, attempt > 0
            except BackendUnavailable as exc:
                # No copy after one that never left in the whole timeout: etcd is out
                # of reach (and when it was the first, nothing landed).
                if attempt == _CAS_ATTEMPTS - 1 or is_never_sent(exc.__cause__):
                    raise
            except (BackendError, PermissionDenied) as exc:
                # A lease gone is news enough: whatever landed under it is gone too.
                if attempt == 0 or (
                    isinstance(exc, BackendError) and self._client.is_lease_not_found(exc)
                ):
                    raise
                raise BackendUnavailable(
                    f"etcd refused a copy of a transaction whose earlier answer was lost: {exc}"
                ) from exc
        raise AssertionError("unreachable")

    async def _cas(self, txn: Txn) -> pb.KeyValue | None:
        """Run a compare-and-swap whose branches read the key; the key as it stands after.

        When etcd's answer is lost, the same transaction is sent again rather than
        the key re-read (invariant 5): a read may overtake a transaction still in
        flight, while the copies, which put the same value under the same lease and
        compare the same thing, land at most once between them. Our lease on the key
        after the last copy says one did; a failed last copy says nothing of the
        earlier ones (another client may have changed the key since one landed).
        """
        response, _ = await self._send_copies(txn)
        return first_kv(response)
