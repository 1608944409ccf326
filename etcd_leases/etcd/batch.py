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

What keeps a batch equivalent to its transactions sent alone:

- etcd refuses a transaction that writes one key twice, so a batch holds at most
  one transaction per key written; the next waits for a later batch.
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

from etcd_leases.errors import BackendError, BackendUnavailable, PermissionDenied
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

# etcd's default --max-txn-ops: the most ops one transaction (at each level) may have.
MAX_BATCH = 128
# Well under etcd's default request size limit (1.5 MiB).
MAX_BATCH_BYTES = 1 << 20


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
    keys: frozenset[bytes]
    answer: asyncio.Future[pb.TxnResponse]


class TxnBatcher:
    """Sends ``client``'s transactions, those that arrive together as one."""

    def __init__(self, client: EtcdClient, *, max_in_flight: int = 2) -> None:
        self._client = client
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._queue: deque[_Waiting] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
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
        waiting = _Waiting(
            request, written_keys(request), asyncio.get_running_loop().create_future()
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
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _next_batch(self) -> list[_Waiting]:
        batch: list[_Waiting] = []
        keys: set[bytes] = set()
        size = 0
        later: deque[_Waiting] = deque()
        while self._queue and len(batch) < MAX_BATCH:
            waiting = self._queue.popleft()
            if waiting.answer.done():  # its caller was cancelled
                continue
            request_size = waiting.request.ByteSize()
            if keys & waiting.keys or (batch and size + request_size > MAX_BATCH_BYTES):
                later.append(waiting)
                continue
            batch.append(waiting)
            keys |= waiting.keys
            size += request_size
        self._queue.extendleft(reversed(later))
        return batch

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
        except BackendUnavailable as exc:
            for waiting in batch:
                _fail(waiting, exc)
            return
        except (BackendError, PermissionDenied):
            # Refused as a whole: let each transaction earn its own answer.
            await asyncio.gather(*(self._answer(waiting) for waiting in batch))
            return
        except BaseException as exc:
            for waiting in batch:
                _fail(waiting, exc)
            raise
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
