"""Concurrent transactions share one nested transaction, each with the answer it earns."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from etcd_leases import EtcdLeaseProvider
from etcd_leases.errors import BackendError, BackendUnavailable
from etcd_leases.etcd.batch import TxnBatcher, written_keys
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.lease_ids import new_lease_id
from etcd_leases.etcd.txn import (
    Txn,
    create_revision_is,
    delete,
    get,
    put,
    range_is_empty,
    value_is,
)
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from tests.conftest import unique_prefix


def create(key: bytes, value: bytes, lease: int = 0) -> Txn:
    return Txn.when(create_revision_is(key, 0)).then(put(key, value, lease)).otherwise(get(key))


def sent_requests(
    client: EtcdClient,
    monkeypatch: pytest.MonkeyPatch,
    after_answer: Callable[[pb.TxnRequest], None] = lambda request: None,
) -> list[pb.TxnRequest]:
    """The transactions ``client`` sends from now on; ``after_answer(request)`` runs once
    etcd has answered each, and may raise in place of the answer."""
    sent: list[pb.TxnRequest] = []
    original = client.txn

    async def txn(request: pb.TxnRequest) -> pb.TxnResponse:
        sent.append(request)
        response = await original(request)
        after_answer(request)
        return response

    monkeypatch.setattr(client, "txn", txn)
    return sent


def nested(request: pb.TxnRequest) -> bool:
    return len(request.success) > 1 and request.success[0].HasField("request_txn")


async def test_transactions_sent_together_each_get_their_own_answer(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    batcher = TxnBatcher(client, max_in_flight=1)
    prefix = unique_prefix().encode()
    await client.txn(create(prefix + b"taken", b"someone").request)
    keys = [prefix + b"k%d" % i for i in range(40)] + [prefix + b"taken"]
    sent = sent_requests(client, monkeypatch)
    responses = await asyncio.gather(*(batcher.txn(create(k, b"me").request) for k in keys))
    # The first alone, the other 40 as one nested transaction answered as a whole.
    assert [len(request.success) for request in sent] == [1, 40] and nested(sent[1])
    assert [r.succeeded for r in responses] == [True] * 40 + [False]
    assert responses[-1].responses[0].response_range.kvs[0].value == b"someone"
    assert all(r.header.revision > 0 for r in responses)
    values = [await client.range(k) for k in keys]
    assert [kv.value for kv in values if kv is not None] == [b"me"] * 40 + [b"someone"]


async def test_a_batch_etcd_refuses_is_sent_again_one_by_one(client: EtcdClient) -> None:
    batcher = TxnBatcher(client, max_in_flight=1)
    prefix = unique_prefix().encode()
    gone = new_lease_id()  # never granted: etcd refuses a put under it
    requests = [create(prefix + b"k%d" % i, b"me").request for i in range(10)]
    requests.insert(5, create(prefix + b"bad", b"me", gone).request)
    results = await asyncio.gather(*(batcher.txn(r) for r in requests), return_exceptions=True)
    refused = results.pop(5)
    assert isinstance(refused, BackendError) and client.is_lease_not_found(refused)
    assert all(not isinstance(r, BaseException) and r.succeeded for r in results)
    assert await client.range(prefix + b"bad") is None


async def test_a_batch_whose_answer_is_lost_fails_every_caller_as_unavailable(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a lost answer to its own transaction would: each caller settles it alone."""

    def lose_nested(request: pb.TxnRequest) -> None:
        if nested(request):
            raise BackendUnavailable("the batch's answer was lost (test)")

    batcher = TxnBatcher(client, max_in_flight=1)
    keys = [unique_prefix().encode() + b"k%d" % i for i in range(6)]
    sent = sent_requests(client, monkeypatch, lose_nested)
    calls = asyncio.gather(
        *(batcher.txn(create(k, b"me").request) for k in keys), return_exceptions=True
    )
    results = await asyncio.wait_for(calls, 10.0)
    assert [len(request.success) for request in sent] == [1, 5]  # nothing sent again
    assert not isinstance(results[0], BaseException) and results[0].succeeded
    assert all(isinstance(r, BackendUnavailable) for r in results[1:]), results
    assert None not in [await client.range(k) for k in keys]  # the batch was applied


async def test_a_batch_cancelled_on_its_way_cancels_its_callers(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cancel_nested(request: pb.TxnRequest) -> None:
        if nested(request):
            raise asyncio.CancelledError

    batcher = TxnBatcher(client, max_in_flight=1)
    keys = [unique_prefix().encode() + b"k%d" % i for i in range(4)]
    sent_requests(client, monkeypatch, cancel_nested)
    calls = [asyncio.ensure_future(batcher.txn(create(k, b"me").request)) for k in keys]
    await asyncio.wait(calls, timeout=10.0)
    assert all(call.done() for call in calls)
    assert not calls[0].cancelled() and calls[0].result().succeeded
    assert all(call.cancelled() for call in calls[1:])
    # The batcher goes on: its slot in flight was given back.
    again = await asyncio.wait_for(batcher.txn(create(keys[0], b"x").request), 5.0)
    assert not again.succeeded  # keys[0] exists: the first call created it


async def test_two_writes_of_one_key_never_share_a_batch(client: EtcdClient) -> None:
    batcher = TxnBatcher(client, max_in_flight=1)
    key = unique_prefix().encode() + b"k"
    # Sent one after another, in order: the put, its delete, the put again.
    steps = [
        Txn.when(create_revision_is(key, 0)).then(put(key, b"a")),
        Txn.when(value_is(key, b"a")).then(delete(key)),
        Txn.when(create_revision_is(key, 0)).then(put(key, b"b")),
    ]
    assert written_keys(steps[0].request) == {key}
    responses = await asyncio.gather(*(batcher.txn(step.request) for step in steps))
    assert [r.succeeded for r in responses] == [True, True, True]
    kv = await client.range(key)
    assert kv is not None and kv.value == b"b"


async def test_many_racers_for_one_key_still_have_one_winner(
    etcd_provider: EtcdLeaseProvider,
) -> None:
    results = await asyncio.gather(
        *(etcd_provider.acquire_lease("seat", f"w{i}", 5000) for i in range(50))
    )
    winners = [r.owner for r in results if r.acquired]
    assert len(winners) == 1
    assert {r.owner for r in results} == {winners[0]}


@pytest.mark.parametrize("tasks", [16, 256])
async def test_concurrent_cycles_on_distinct_keys_are_batched(
    etcd_provider: EtcdLeaseProvider, tasks: int
) -> None:
    async def cycle(i: int) -> None:
        for round_ in range(3):
            result = await etcd_provider.acquire_lease(f"c{i}-{round_}", "me", 5000)
            assert result.acquired and result.token is not None
            await etcd_provider.release_lease(f"c{i}-{round_}", "me")

    await asyncio.gather(*(cycle(i) for i in range(tasks)))
    assert etcd_provider._batcher.batches_sent > 0
    assert await etcd_provider.client.range_prefix(etcd_provider.etcd_key("c")) == []


async def test_a_compare_never_shares_a_batch_with_a_write_it_compares(
    client: EtcdClient,
) -> None:
    # etcd judges every nested compare against the store before the batch: a release
    # comparing an empty inbox must not be batched after a send into that inbox (it
    # would succeed and strand the message), nor a fenced write after a transfer.
    batcher = TxnBatcher(client, max_in_flight=1)
    prefix = unique_prefix().encode()
    inbox, end = prefix + b"inbox/", prefix + b"inbox0"
    steps = [
        Txn.when().then(put(prefix + b"first", b"occupies the one slot in flight")),
        Txn.when().then(put(inbox + b"m1", b"hello")),  # a send into the inbox
        Txn.when(range_is_empty(inbox, end)).then(put(prefix + b"released", b"yes")),
        Txn.when().then(put(prefix + b"lease", b"b")),  # a transfer
        Txn.when(value_is(prefix + b"lease", b"a")).then(put(prefix + b"fenced", b"a's")),
    ]
    await client.txn(Txn.when().then(put(prefix + b"lease", b"a")).request)
    responses = await asyncio.gather(*(batcher.txn(step.request) for step in steps))
    assert [r.succeeded for r in responses] == [True, True, False, True, False]
    assert await client.range(prefix + b"released") is None
    assert await client.range(prefix + b"fenced") is None


async def test_a_range_compare_shares_a_batch_only_with_writes_outside_the_range(
    client: EtcdClient,
) -> None:
    # The range [inbox/, inbox0) holds its first key and not its end: a write of the
    # first key waits for a later batch, a write of the end may share the batch.
    batcher = TxnBatcher(client, max_in_flight=1)
    prefix = unique_prefix().encode()
    inbox, end = prefix + b"inbox/", prefix + b"inbox0"
    release = Txn.when(range_is_empty(inbox, end)).then(put(prefix + b"released", b"yes"))
    for write, released in ((end, True), (end, True), (inbox, False)):
        steps = [
            Txn.when().then(put(prefix + b"first", b"occupies the one slot in flight")),
            Txn.when().then(put(write, b"a message")),
            release,
        ]
        responses = await asyncio.gather(*(batcher.txn(step.request) for step in steps))
        assert [r.succeeded for r in responses] == [True, True, released]
    # The first rounds' last two went as one batch each; the last round's could not.
    assert batcher.batches_sent == 2
