"""The compares transactions are built from hold exactly when their condition does (real etcd)."""

from __future__ import annotations

from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.lease_ids import new_lease_id
from etcd_leases.etcd.txn import (
    Txn,
    create_revision_is,
    delete,
    first_kv,
    get,
    lease_is,
    mod_revision_is,
    prefix_end,
    put,
    range_is_empty,
    value_is,
)
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from tests.conftest import unique_prefix


async def holds(client: EtcdClient, compare: pb.Compare) -> bool:
    return (await client.txn(Txn.when(compare).request)).succeeded


async def test_range_is_empty_holds_until_a_key_lies_in_the_range(client: EtcdClient) -> None:
    inbox = unique_prefix().encode() + b"inbox/"
    end = prefix_end(inbox)
    assert await holds(client, range_is_empty(inbox, end))
    await client.txn(Txn.when().then(put(end, b"just past the range")).request)
    assert await holds(client, range_is_empty(inbox, end))
    await client.txn(Txn.when().then(put(inbox + b"m1", b"hello")).request)
    assert not await holds(client, range_is_empty(inbox, end))


async def test_key_compares_hold_exactly_for_the_key_as_it_is(client: EtcdClient) -> None:
    key = unique_prefix().encode() + b"k"
    assert await holds(client, create_revision_is(key, 0))
    assert not await holds(client, value_is(key, b""))  # an absent key has no value
    written = await client.txn(Txn.when().then(put(key, b"v")).request)
    revision = written.header.revision
    assert await holds(client, create_revision_is(key, revision))
    assert not await holds(client, create_revision_is(key, 0))
    assert await holds(client, mod_revision_is(key, revision))
    assert await holds(client, value_is(key, b"v"))
    assert not await holds(client, value_is(key, b"w"))
    await client.txn(Txn.when().then(put(key, b"w")).request)
    assert not await holds(client, mod_revision_is(key, revision))
    assert await holds(client, create_revision_is(key, revision))


async def test_lease_is_holds_exactly_for_the_key_under_that_lease(client: EtcdClient) -> None:
    key = unique_prefix().encode() + b"k"
    lease, other = new_lease_id(), new_lease_id()
    for granted in (lease, other):
        await client.grant(60, granted)
    assert not await holds(client, lease_is(key, lease))  # absent
    await client.txn(Txn.when().then(put(key, b"v")).request)
    assert not await holds(client, lease_is(key, lease))  # without a lease
    await client.txn(Txn.when().then(put(key, b"v", lease)).request)
    assert await holds(client, lease_is(key, lease))
    assert not await holds(client, lease_is(key, other))
    for granted in (lease, other):
        await client.revoke(granted)


def test_prefix_end_covers_exactly_the_keys_of_the_prefix() -> None:
    assert prefix_end(b"a/") == b"a0"
    assert prefix_end(b"aX") == b"aY"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"  # every key


async def test_delete_answers_with_the_key_as_it_was_only_when_asked(client: EtcdClient) -> None:
    key = unique_prefix().encode() + b"k"
    for prev_kv in (True, False):
        await client.txn(Txn.when().then(put(key, b"v")).request)
        answer = await client.txn(Txn.when().then(delete(key, prev_kv=prev_kv)).request)
        deleted = answer.responses[0].response_delete_range
        assert deleted.deleted == 1
        assert [kv.value for kv in deleted.prev_kvs] == ([b"v"] if prev_kv else [])
    await client.txn(Txn.when().then(put(key, b"v")).request)
    answer = await client.txn(Txn.when().then(delete(key)).request)
    assert not answer.responses[0].response_delete_range.prev_kvs


async def test_first_kv_is_the_key_read_or_none(client: EtcdClient) -> None:
    key = unique_prefix().encode() + b"k"
    assert first_kv(await client.txn(Txn.when().then(get(key)).request)) is None
    await client.txn(Txn.when().then(put(key, b"v")).request)
    read = first_kv(await client.txn(Txn.when().then(put(key + b"2", b"w"), get(key)).request))
    assert read is not None and read.value == b"v"
