"""Concurrent transactions of one provider, sent together as one nested transaction.

An op of an etcd transaction may itself be a transaction with compares of its own
(etcd 3.3 and later). etcd applies the ops of one transaction in order, atomically:
N independent transactions nested in one take effect exactly as if they were sent
one after another, each judging its own compares, but they cost one raft round (one
fsync) and one round trip instead of N.

:class:`TxnBatcher` batches naturally, as group commit does: a transaction goes out
at once while fewer than ``max_in_flight`` requests are on the way, so a lone caller
waits for nothing; the others queue, and each time a request comes back the queue
leaves as one batch. Under load batches grow to fit it.

What keeps a batch equivalent to its transactions sent alone, one after another:

- etcd refuses a transaction that writes one key twice, so a batch holds at most
  one transaction per key written; the next waits for a later batch.
- etcd judges the compares of every nested transaction against the store as it was
  before the batch (measured on 3.4), while a later one sent alone would see what the
  earlier ones wrote. So no transaction joins a batch if it compares a key (or a range)
  that another in the batch writes, or writes one that another compares: a release
  that compares an empty inbox never shares a batch with a send into that inbox.
- A batch that etcd refuses as a whole (a lease one of them names is gone, a key one
  may not write) is sent again one transaction at a time, so each caller gets the
  answer its own transaction earns.
- A batch whose answer is lost fails every caller with ``BackendUnavailable``, as a
  lost answer to its own transaction would: each caller settles it as it would have.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from etcd_leases.errors import BackendError, PermissionDenied
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.tasks import BackgroundTasks
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

# etcd's default --max-txn-ops. A nested transaction may have at most this many ops,
# less the ops of the transaction around it: a batch of n allows 128 - n per branch.
MAX_TXN_OPS = 128
# Well under etcd's default request size limit (1.5 MiB).
MAX_BATCH_BYTES = 1 << 20


def compared(request: pb.TxnRequest) -> tuple[frozenset[bytes], list[tuple[bytes, bytes]]]:
    """What ``request`` compares: single keys, and ``[key, range_end)`` ranges."""
    keys: set[bytes] = set()
    ranges: list[tuple[bytes, bytes]] = []
    for compare in request.compare:
        if compare.range_end:
            ranges.append((compare.key, compare.range_end))
        else:
            keys.add(compare.key)
    for op in (*request.success, *request.failure):
        if op.HasField("request_txn"):
            nested_keys, nested_ranges = compared(op.request_txn)
            keys |= nested_keys
            ranges += nested_ranges
    return frozenset(keys), ranges


def most_ops(request: pb.TxnRequest) -> int:
    return max(len(request.success), len(request.failure), len(request.compare))


def written_keys(request: pb.TxnRequest) -> frozenset[bytes]:
    """The keys ``request`` may put or delete, in either branch."""
    keys: set[bytes] = set()
    for op in (*request.success, *request.failure):
        if op.HasField("request_put"):
            keys.add(op.request_put.key)
        elif op.HasField("request_delete_range"):
            keys.add(op.request_delete_range.key)
        elif op.HasField("request_txn"):
            keys |= written_keys(op.request_txn)
    return frozenset(keys)


@dataclass(slots=True)
class _Waiting:
    request: pb.TxnRequest
    writes: frozenset[bytes]
    compared_keys: frozenset[bytes]
    compared_ranges: list[tuple[bytes, bytes]]
    answer: asyncio.Future[pb.TxnResponse]


class _Batch:
    """The transactions of one batch, and what they write and compare."""

    def __init__(self) -> None:
        self.members: list[_Waiting] = []
        self.writes: set[bytes] = set()
        self.compared_keys: set[bytes] = set()
        self.compared_ranges: list[tuple[bytes, bytes]] = []
        self.size = 0
        self.ops = 0

    def admits(self, waiting: _Waiting) -> bool:
        if not self.members:
            return True
        ops = max(self.ops, most_ops(waiting.request))
        if len(self.members) + 1 > MAX_TXN_OPS - ops:
            return False
        if self.size + waiting.request.ByteSize() > MAX_BATCH_BYTES:
            return False
        if not self.writes.isdisjoint(waiting.writes | waiting.compared_keys):
            return False
        if not self.compared_keys.isdisjoint(waiting.writes):
            return False
        return not (
            _overlap(waiting.compared_ranges, self.writes)
            or _overlap(self.compared_ranges, waiting.writes)
        )

    def add(self, waiting: _Waiting) -> None:
        self.members.append(waiting)
        self.writes |= waiting.writes
        self.compared_keys |= waiting.compared_keys
        self.compared_ranges += waiting.compared_ranges
        self.size += waiting.request.ByteSize()
        self.ops = max(self.ops, most_ops(waiting.request))


def _overlap(ranges: list[tuple[bytes, bytes]], keys: set[bytes] | frozenset[bytes]) -> bool:
    return any(start <= key < end for start, end in ranges for key in keys)


class TxnBatcher:
    """Sends ``client``'s transactions, those that arrive together as one."""

    def __init__(self, client: EtcdClient, *, max_in_flight: int = 2) -> None:
        self._client = client
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._queue: deque[_Waiting] = deque()
        self._sends = BackgroundTasks()
        self.batches_sent = 0  # requests of more than one transaction (for tests)

    async def txn(self, request: pb.TxnRequest) -> pb.TxnResponse:
        """etcd's answer to ``request``, as if it had been sent alone."""
        if self._in_flight < self._max_in_flight and not self._queue:
            self._in_flight += 1
            try:
                return await self._client.txn(request)
            finally:
                self._in_flight -= 1
                self._flush()
        compared_keys, compared_ranges = compared(request)
        waiting = _Waiting(
            request,
            written_keys(request),
            compared_keys,
            compared_ranges,
            asyncio.get_running_loop().create_future(),
        )
        self._queue.append(waiting)
        return await waiting.answer

    def _flush(self) -> None:
        """Send what waits, as batches, while fewer than the most are in flight."""
        while self._queue and self._in_flight < self._max_in_flight:
            batch = self._next_batch()
            if not batch:
                continue
            self._in_flight += 1
            self._sends.start(self._send(batch))

    def _next_batch(self) -> list[_Waiting]:
        batch = _Batch()
        later: deque[_Waiting] = deque()
        while self._queue and len(batch.members) < MAX_TXN_OPS:
            waiting = self._queue.popleft()
            if waiting.answer.done():  # its caller was cancelled
                continue
            if batch.admits(waiting):
                batch.add(waiting)
            else:
                later.append(waiting)
        self._queue.extendleft(reversed(later))
        return batch.members

    async def _send(self, batch: list[_Waiting]) -> None:
        try:
            if len(batch) == 1:
                await self._answer(batch[0])
            else:
                await self._send_nested(batch)
        finally:
            self._in_flight -= 1
            self._flush()

    async def _send_nested(self, batch: list[_Waiting]) -> None:
        self.batches_sent += 1
        nested = pb.TxnRequest(success=[pb.RequestOp(request_txn=w.request) for w in batch])
        try:
            response = await self._client.txn(nested)
        except (BackendError, PermissionDenied):
            # Refused as a whole: let each transaction earn its own answer.
            await asyncio.gather(*(self._answer(waiting) for waiting in batch))
            return
        except BaseException as exc:
            # Each caller has its error (unavailable for a lost answer, as its own
            # transaction's would be); only a cancellation goes on up.
            for waiting in batch:
                _fail(waiting, exc)
            if not isinstance(exc, Exception):
                raise
            return
        for waiting, op in zip(batch, response.responses, strict=True):
            inner = op.response_txn
            inner.header.CopyFrom(response.header)
            if not waiting.answer.done():
                waiting.answer.set_result(inner)

    async def _answer(self, waiting: _Waiting) -> None:
        try:
            response = await self._client.txn(waiting.request)
        except BaseException as exc:
            _fail(waiting, exc)
            if not isinstance(exc, Exception):
                raise
            return
        if not waiting.answer.done():
            waiting.answer.set_result(response)


def _fail(waiting: _Waiting, exc: BaseException) -> None:
    if waiting.answer.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        waiting.answer.cancel()
    else:
        waiting.answer.set_exception(exc)
