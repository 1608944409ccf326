"""Idempotent sends (issue 15, part 3), on the in-memory model and on etcd."""

from __future__ import annotations

import asyncio
import time

import pytest

from etcd_leases import EtcdLeaseProvider, HeldLease, LeaseValueError
from etcd_leases.etcd.txn import prefix_end
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.threads import ThreadMessages, Threads
from tests.conftest import Live


class Counting:
    def __init__(self) -> None:
        self.handled: list[str] = []

    async def __call__(self, thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for message in messages:
            self.handled.append(message.text)
            await messages.ack(message)


async def test_a_second_send_with_the_same_id_stores_nothing_and_says_so(live: Live) -> None:
    threads = Threads(live.provider, Counting(), ttl_ms=5000)
    first = await threads.send("t", "hello", send_id="req-1")
    again = await threads.send("t", "hello again", send_id="req-1")
    other = await threads.send("t", "hello", send_id="req-2")
    plain = [await threads.send("t", "hello") for _ in range(2)]
    assert not first.duplicate and again.duplicate and not other.duplicate
    assert (first.thread, first.text) == ("t", "hello")
    # The earlier send's message (seq, id), with this send's payload.
    assert (again.thread, again.seq, again.id, again.text) == (
        "t",
        first.seq,
        first.id,
        "hello again",
    )
    assert [m.seq for m in (other, *plain)] == [2, 3, 4]
    assert [m.seq for m in await live.provider.inbox.pending("t")] == [1, 2, 3, 4]


async def test_a_send_id_is_per_thread(live: Live) -> None:
    threads = Threads(live.provider, Counting(), ttl_ms=5000)
    assert not (await threads.send("a", "x", send_id="req")).duplicate
    assert not (await threads.send("b", "x", send_id="req")).duplicate


async def test_a_retry_after_the_message_was_handled_is_still_a_duplicate(live: Live) -> None:
    handler = Counting()
    threads = Threads(live.provider, handler, ttl_ms=5000)
    first = await threads.send("t", "order 66", send_id="req-1", run=True)
    assert handler.handled == ["order 66"]
    again = await threads.send("t", "order 66", send_id="req-1", run=True)
    assert again.duplicate and again.seq == first.seq
    assert handler.handled == ["order 66"]  # not handled twice
    assert await live.provider.inbox.pending("t") == []


async def test_a_thread_remembers_at_most_max_send_ids(live: Live) -> None:
    threads = Threads(live.provider, Counting(), ttl_ms=5000, max_send_ids=3)
    for name in "abcd":
        await threads.send("t", name, send_id=name)
    assert (await threads.send("t", "d", send_id="d")).duplicate
    assert (await threads.send("t", "b", send_id="b")).duplicate
    assert not (await threads.send("t", "a", send_id="a")).duplicate  # pushed out by d
    if isinstance(live.provider, EtcdLeaseProvider):
        keys = live.provider.inbox.keys
        for kind in (b"ids/", b"idn/"):
            start = keys.root + kind
            request = pb.RangeRequest(key=start, range_end=prefix_end(start), count_only=True)
            found = await live.provider.client.call(
                "/etcdserverpb.KV/Range", request, pb.RangeResponse
            )
            assert found.count == 3, kind


async def test_a_send_id_is_forgotten_after_its_window(live: Live) -> None:
    threads = Threads(live.provider, Counting(), ttl_ms=5000, send_id_window_s=1)
    first = await threads.send("t", "x", send_id="req")
    sent_at = time.monotonic()
    first_revision = 0
    if isinstance(live.provider, EtcdLeaseProvider):
        tomb = await live.provider.client.range(live.provider.inbox.keys.send_id("t", "req"))
        assert tomb is not None
        first_revision = tomb.mod_revision
    # etcd expires the tombstone with its lease, a little after the window.
    while (again := await threads.send("t", "x", send_id="req")).duplicate:
        assert time.monotonic() - sent_at < 30
        await asyncio.sleep(0.2)
    assert time.monotonic() - sent_at >= 1
    assert again.seq == first.seq + 1
    if isinstance(live.provider, EtcdLeaseProvider):  # both of its tombstone's keys went
        keys, client = live.provider.inbox.keys, live.provider.client
        assert await client.range(keys.send_id_number("t", 1)) is None
        kv = await client.range(keys.send_id("t", "req"))
        assert kv is not None and kv.mod_revision > first_revision  # the second send's


@pytest.mark.parametrize(
    "options",
    [{"send_id_window_s": 0}, {"send_id_window_s": 100_000}, {"max_send_ids": 0}],
)
async def test_send_id_limits_are_checked(live: Live, options: dict[str, float]) -> None:
    with pytest.raises(LeaseValueError):
        Threads(live.provider, Counting(), **options)  # type: ignore[arg-type]


async def test_an_empty_send_id_is_refused(live: Live) -> None:
    with pytest.raises(LeaseValueError):
        await Threads(live.provider, Counting()).send("t", "x", send_id="")
