"""Concurrent transactions share one nested transaction, each with the answer it earns."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from etcd_leases import EtcdLeaseProvider
from etcd_leases.errors import BackendError, BackendUnavailable, ProviderClosed
from etcd_leases.etcd.batch import (
    MAX_BATCH_BYTES,
    MAX_TXN_OPS,
    TxnBatcher,
    compared,
    most_ops,
    written_keys,
)
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


async def test_a_batch_whose_client_closed_fails_each_caller_as_closed(
    client: EtcdClient,
) -> None:
    """The provider closing under waiting transactions: each caller is told, and the
    batch's send ends there (it used to fail on, a task failure logged as an error)."""
    batcher = TxnBatcher(client, max_in_flight=1)
    keys = [unique_prefix().encode() + b"k%d" % i for i in range(4)]
    calls = [asyncio.ensure_future(batcher.txn(create(k, b"me").request)) for k in keys]
    await asyncio.sleep(0)  # the first is on its way, the others wait for it
    await client.close()
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10.0)
    assert all(isinstance(r, ProviderClosed) for r in results[1:]), results


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


def test_what_a_transaction_writes_and_compares_counts_its_nested_ones() -> None:
    inner = Txn.when(value_is(b"c1", b"x"), range_is_empty(b"r/", b"r0"))
    inner = inner.then(put(b"w1", b"v")).otherwise(delete(b"w2"))
    outer = Txn.when(value_is(b"c0", b"y"), range_is_empty(b"s/", b"s0"))
    outer = outer.then(put(b"w0", b"v"), pb.RequestOp(request_txn=inner.request))
    outer = outer.otherwise(delete(b"w3"))
    assert written_keys(outer.request) == {b"w0", b"w1", b"w2", b"w3"}
    keys, ranges = compared(outer.request)
    assert keys == {b"c0", b"c1"} and ranges == [(b"s/", b"s0"), (b"r/", b"r0")]


def test_a_transactions_ops_are_its_longest_branch_or_its_compares() -> None:
    ops = [put(b"k%d" % i, b"v") for i in range(3)]
    compares = [value_is(b"k%d" % i, b"v") for i in range(3)]
    assert most_ops(Txn.when(compares[0]).then(*ops).request) == 3
    assert most_ops(Txn.when(compares[0]).otherwise(*ops).request) == 3
    assert most_ops(Txn.when(*compares).then(ops[0]).request) == 3


async def batches_of(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch, steps: list[Txn]
) -> tuple[list[int], list[pb.TxnResponse]]:
    """Send ``steps`` at once through a batcher with one request in flight (the first
    step goes alone); how many transactions each request carried, and the answers."""
    batcher = TxnBatcher(client, max_in_flight=1)
    sent = sent_requests(client, monkeypatch)
    responses = await asyncio.gather(*(batcher.txn(step.request) for step in steps))
    return [len(r.success) if nested(r) else 1 for r in sent], responses


async def test_a_batch_holds_as_many_as_etcds_op_limit_allows(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd's --max-txn-ops (128) counts a nested transaction's members with the ops of
    its longest branch: beside one of 100 ops, 27 more fit, and etcd takes them."""
    prefix = unique_prefix().encode()
    wide = Txn.when().then(*(put(prefix + b"w%d" % i, b"v") for i in range(100)))
    singles = [Txn.when().then(put(prefix + b"s%d" % i, b"v")) for i in range(40)]
    first = Txn.when().then(put(prefix + b"first", b"v"))
    counts, responses = await batches_of(client, monkeypatch, [first, wide, *singles])
    assert counts == [1, MAX_TXN_OPS - 100, 41 - (MAX_TXN_OPS - 100)]  # none sent again
    assert all(r.succeeded for r in responses)


async def test_a_batch_stays_under_its_size_limit(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Members up to ``MAX_BATCH_BYTES`` together share a batch; one byte more waits."""
    prefix = unique_prefix().encode()

    def sized(name: bytes, size: int) -> Txn:
        """A put of ``name`` whose request is ``size`` bytes."""
        # Each byte of value is a byte of request, but for the lengths' varints.
        base = Txn.when().then(put(prefix + name, b"")).request.ByteSize()
        for length in range(size - base, size - base - 16, -1):
            txn = Txn.when().then(put(prefix + name, b"x" * length))
            if txn.request.ByteSize() == size:
                return txn
        raise AssertionError(f"no put of {size} bytes")

    first = Txn.when().then(put(prefix + b"first", b"v"))
    small = [sized(b"a", 300), sized(b"b", 400)]
    counts, _ = await batches_of(
        client, monkeypatch, [first, *small, sized(b"fits", MAX_BATCH_BYTES - 700)]
    )
    assert counts == [1, 3]
    counts, _ = await batches_of(
        client, monkeypatch, [first, *small, sized(b"over", MAX_BATCH_BYTES - 699)]
    )
    assert counts[1:] == [2, 1]


@pytest.mark.parametrize("direction", ["written, then compared", "compared, then written"])
async def test_no_batch_holds_a_key_both_written_and_compared(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    """Whichever comes first, and however many members stand between them (each
    member's keys count, not only the last one's); ranges alike."""
    prefix = unique_prefix().encode()
    first = Txn.when().then(put(prefix + b"first", b"v"))
    writes = [
        Txn.when().then(put(prefix + b"k", b"v")),
        Txn.when().then(put(prefix + b"r/1", b"v")),
        Txn.when().then(put(prefix + b"other", b"v")),
    ]
    compares = [
        Txn.when(value_is(prefix + b"k", b"v")).then(put(prefix + b"x1", b"v")),
        Txn.when(range_is_empty(prefix + b"r/", prefix + b"r0")).then(put(prefix + b"x2", b"v")),
        Txn.when(value_is(prefix + b"else", b"v")).then(put(prefix + b"x3", b"v")),
    ]
    steps = writes + compares if direction.startswith("written") else compares + writes
    counts, _ = await batches_of(client, monkeypatch, [first, *steps])
    # The third of each kind touches nothing the others do, so it joins the first batch.
    assert counts == [1, 4, 2]


async def test_a_cancelled_caller_leaves_the_batch_to_the_others(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = unique_prefix().encode()
    batcher = TxnBatcher(client, max_in_flight=1)
    sent = sent_requests(client, monkeypatch)
    steps = [Txn.when().then(put(prefix + b"k%d" % i, b"v")) for i in range(5)]
    calls = [asyncio.ensure_future(batcher.txn(step.request)) for step in steps]
    await asyncio.sleep(0)  # all five have started: the first is in flight
    calls[2].cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    assert [len(r.success) if nested(r) else 1 for r in sent] == [1, 3]
    assert await client.range(prefix + b"k2") is None


async def test_no_more_transactions_are_in_flight_than_the_cap(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sent alone wait for etcd's answer while three writes of one key queue up
    (no two can share a batch): each is sent once a send in flight ends, never more
    than two at once."""
    batcher = TxnBatcher(client, max_in_flight=2)
    prefix = unique_prefix().encode()
    gate, two_waiting = asyncio.Event(), asyncio.Event()
    in_flight, most = 0, 0
    original = client.txn

    async def txn(request: pb.TxnRequest) -> pb.TxnResponse:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            if in_flight == 2:
                two_waiting.set()
            await gate.wait()
            return await original(request)
        finally:
            in_flight -= 1

    monkeypatch.setattr(client, "txn", txn)
    alone = [create(prefix + b"a", b"me"), create(prefix + b"b", b"me")]
    same_key = [create(prefix + b"c", b"me%d" % i) for i in range(3)]
    calls = asyncio.gather(*(batcher.txn(t.request) for t in alone + same_key))
    async with asyncio.timeout(10):
        await two_waiting.wait()
        gate.set()
        responses = await calls
    assert [r.succeeded for r in responses[:2]] == [True, True]
    assert sum(r.succeeded for r in responses[2:]) == 1  # one create of "c" won
    assert most == 2
