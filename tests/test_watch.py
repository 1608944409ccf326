"""WatchStream: one etcd Watch stream for many watchers, resumed without loss or repeat."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

import grpc
import pytest

from etcd_leases import BackendError, LeaseError, PermissionDenied, ProviderClosed
from etcd_leases.errors import LeaseTypeError, LeaseValueError
from etcd_leases.etcd.auth import Metadata
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.txn import Txn, delete, put
from etcd_leases.etcd.watch import Watcher, WatchStream
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.testing import EtcdCluster, etcd_version, free_ports
from tests.conftest import enable_auth

PUT, DELETE = pb.Event.PUT, pb.Event.DELETE


def new_key() -> bytes:
    return f"/test/watch/{uuid.uuid4().hex}".encode()


async def write(client: EtcdClient, key: bytes, value: bytes | None) -> int:
    """Put ``value`` (``None``: delete the key); the revision of the write."""
    op = delete(key) if value is None else put(key, value)
    response = await client.txn(Txn.when().then(op).request)
    return response.header.revision


async def current_revision(client: EtcdClient) -> int:
    return (await client.range_at(b"/test/watch/revision-probe"))[1]


async def next_batch(watcher: Watcher, within: float = 5.0) -> list[pb.Event]:
    async with asyncio.timeout(within):
        return await anext(watcher)


async def eventually(condition: Callable[[], bool], within: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met in time")


async def registered(*watchers: Watcher, within: float = 10.0) -> None:
    await eventually(lambda: all(watcher.registered for watcher in watchers), within)


def summary(events: list[pb.Event]) -> list[tuple[int, bytes | None, int]]:
    """(type, value or None for a delete, revision) of each event."""
    return [(e.type, None if e.type == DELETE else e.kv.value, e.kv.mod_revision) for e in events]


@pytest.fixture
async def stream(client: EtcdClient) -> AsyncIterator[WatchStream]:
    stream = WatchStream(client)
    yield stream
    await stream.close()


async def test_puts_and_a_delete_arrive_in_order_one_batch_each(
    client: EtcdClient, stream: WatchStream
) -> None:
    key = new_key()
    start = await current_revision(client) + 1
    watcher = stream.watch(key, start)
    # Written before etcd registered the watch: still delivered, the watch starts at `start`.
    await write(client, key + b"/after", b"not its key")  # a key sorting after it
    first = await write(client, key, b"a")
    assert first >= start
    assert summary(await next_batch(watcher)) == [(PUT, b"a", first)]
    await registered(watcher)
    assert repr(watcher) == f"<Watcher {key!r} next_revision={first + 1}>"

    latencies = []
    for value in (b"b", b"c", None):
        started = time.perf_counter()
        revision = await write(client, key, value)
        batch = await next_batch(watcher)
        latencies.append(time.perf_counter() - started)
        assert summary(batch) == [(DELETE if value is None else PUT, value, revision)]
        assert watcher.next_revision == revision + 1
    # The figure only: speed is the benchmark's (benchmarks/), next_batch bounds it.
    print(f"write -> event: {', '.join(f'{s * 1000:.1f} ms' for s in latencies)}")


async def test_an_older_start_revision_replays_history(
    client: EtcdClient, stream: WatchStream
) -> None:
    key = new_key()
    history: list[tuple[int, bytes | None, int]] = [
        (PUT, v, await write(client, key, v)) for v in (b"1", b"2", b"3")
    ]
    history.append((DELETE, None, await write(client, key, None)))
    history.append((PUT, b"4", await write(client, key, b"4")))

    async def collect(watcher: Watcher, count: int) -> list[pb.Event]:
        events: list[pb.Event] = []
        while len(events) < count:
            events.extend(await next_batch(watcher))
        return events

    everything = stream.watch(key, history[0][2])
    tail = stream.watch(key, history[2][2])
    assert summary(await collect(everything, 5)) == history
    assert summary(await collect(tail, 3)) == history[2:]
    # Nothing more, and nothing twice.
    await write(client, key, b"5")
    assert [e.kv.value for e in await next_batch(everything)] == [b"5"]
    assert [e.kv.value for e in await next_batch(tail)] == [b"5"]


async def test_start_revision_zero_watches_from_registration(
    client: EtcdClient, stream: WatchStream
) -> None:
    key = new_key()
    await write(client, key, b"before")
    watcher = stream.watch(key, 0)
    await registered(watcher)
    revision = await write(client, key, b"after")
    assert summary(await next_batch(watcher)) == [(PUT, b"after", revision)]


async def test_a_thousand_watchers_share_one_stream(
    etcd: EtcdCluster,
    client: EtcdClient,
    stream: WatchStream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened: list[object] = []
    open_stream = client.watch_stream

    def counting(metadata: Metadata, index: int | None = None) -> object:
        opened.append(metadata)
        return open_stream(metadata, index)

    monkeypatch.setattr(client, "watch_stream", counting)
    keys = [new_key() for _ in range(1000)]
    start = await current_revision(client) + 1
    seen: dict[bytes, list[tuple[float, list[pb.Event]]]] = {key: [] for key in keys}
    waiting, all_seen = set(keys), asyncio.Event()

    def recorder(key: bytes) -> Callable[[list[pb.Event]], None]:
        def record(batch: list[pb.Event]) -> None:
            seen[key].append((time.perf_counter(), batch))
            waiting.discard(key)
            if not waiting:
                all_seen.set()

        return record

    began = time.perf_counter()
    watchers = [stream.watch(key, start, on_events=recorder(key)) for key in keys]
    await registered(*watchers, within=30)
    registration = time.perf_counter() - began
    assert len(opened) == 1  # one stream carries them all

    # The writes come from another thread with its own loop and client, as from
    # another process: the watching loop does nothing but dispatch events.
    written: dict[bytes, tuple[float, int]] = {}

    async def write_all(concurrency: int) -> None:
        writer = EtcdClient(etcd.endpoints, timeout=5)
        gate = asyncio.Semaphore(concurrency)

        async def write_one(key: bytes) -> None:
            async with gate:
                started = time.perf_counter()
                written[key] = (started, await write(writer, key, key))

        try:
            await asyncio.gather(*(write_one(key) for key in keys))
        finally:
            await writer.close()

    await asyncio.to_thread(asyncio.run, write_all(8))
    async with asyncio.timeout(10):
        await all_seen.wait()
    await asyncio.sleep(0.2)  # anything extra would show up now

    latencies = []
    for key in keys:
        [(arrived, batch)] = seen[key]
        assert summary(batch) == [(PUT, key, written[key][1])]
        latencies.append(arrived - written[key][0])
    latencies.sort()
    print(
        f"etcd {etcd_version(etcd.binary)}, 1000 watchers: registered in "
        f"{registration * 1000:.0f} ms; write -> callback "
        f"p50 {statistics.median(latencies) * 1000:.1f} ms, "
        f"p99 {latencies[989] * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms"
    )


async def test_a_range_watch_sees_every_key_in_it_and_a_refused_one_ends_once(
    stream: WatchStream, client: EtcdClient
) -> None:
    base = new_key()
    start = await current_revision(client) + 1
    watcher = stream.watch(base + b"/", start, range_end=base + b"0")  # b"0" follows b"/"
    # etcd refuses an empty range with a reason that is not about auth: the watcher
    # ends with it, rather than being created again and again.
    errors: list[Exception] = []
    refused = stream.watch(base + b"/b", start, range_end=base + b"/a", on_error=errors.append)
    await write(client, base + b"0", b"outside")  # would come first if it were seen
    inside = [await write(client, base + b"/" + name, name) for name in (b"a", b"b")]
    events: list[pb.Event] = []
    while len(events) < len(inside):
        events.extend(await next_batch(watcher))
    assert summary(events) == [(PUT, b"a", inside[0]), (PUT, b"b", inside[1])]
    await eventually(lambda: refused.ended)
    assert isinstance(refused.error, BackendError) and "watcher range is empty" in str(
        refused.error
    )
    assert errors == [refused.error]
    assert watcher.registered and not watcher.ended


async def test_cancel_stops_delivery(etcd: EtcdCluster, client: EtcdClient) -> None:
    stream = WatchStream(client, idle_timeout=0.1)
    try:
        key = new_key()
        start = await current_revision(client) + 1
        calls: list[list[pb.Event]] = []
        kept = stream.watch(key, start)
        dropped = stream.watch(key, start, on_events=calls.append)
        unborn = stream.watch(key, start)
        unborn.cancel()  # before etcd even registered it
        await registered(kept, dropped)
        dropped.cancel()
        dropped.cancel()  # idempotent
        revision = await write(client, key, b"x")
        assert summary(await next_batch(kept)) == [(PUT, b"x", revision)]
        await asyncio.sleep(0.1)
        assert calls == []
        with pytest.raises(StopAsyncIteration):
            await next_batch(unborn)

        # A watcher cancelled while its iterator waits: the iteration ends.
        waiting = asyncio.create_task(next_batch(kept))
        await asyncio.sleep(0.05)
        kept.cancel()
        with pytest.raises(StopAsyncIteration):
            await waiting

        # No watcher left: the stream and its task go away, and come back on demand.
        await eventually(lambda: not stream.running, within=5)
        again = stream.watch(key, revision)
        assert summary(await next_batch(again)) == [(PUT, b"x", revision)]
    finally:
        await stream.close()


class Lone(NamedTuple):
    """A one-member cluster of the test's own (to kill, compact, count watches on), a
    client of it and a stream on that client."""

    etcd: EtcdCluster
    client: EtcdClient
    stream: WatchStream


@pytest.fixture
async def lone(etcd_binary: str) -> AsyncIterator[Lone]:
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        client = EtcdClient(etcd.endpoints, timeout=5)
        stream = WatchStream(client)
        try:
            yield Lone(etcd, client, stream)
        finally:
            await stream.close()
            await client.close()


async def test_cancelled_watchers_leave_no_watch_on_etcd(
    lone: Lone, caplog: pytest.LogCaptureFixture
) -> None:
    """A cancelled watcher's watch is cancelled on etcd too, and only its own (also one
    cancelled while etcd had its create unanswered): the stream the others share goes on
    unbroken. Counted on a member of its own (etcd's gauge of
    live watchers), so no other test's watches are in the count."""
    caplog.set_level(logging.INFO, logger="etcd_leases.etcd.watch.stream")
    client, stream, member = lone.client, lone.stream, lone.etcd.members[0]
    key = new_key()
    start = await current_revision(client) + 1
    kept = stream.watch(key, start)
    dropped = stream.watch(key, start)
    unborn = stream.watch(key, start)
    unborn.cancel()  # before its create was sent
    await registered(kept, dropped)
    dropped.cancel()
    # One cancelled while its create is in flight: the member, frozen, has it unanswered.
    member.pause()
    midway = stream.watch(key, start)
    await asyncio.sleep(0.2)  # sent
    midway.cancel()
    member.resume()
    # Wait for etcd's answer to the create and the stream's cancel, then for etcd to act
    # on it: the gauge reads 1 before etcd has read the create too.
    await eventually(lambda: stream._creating is None and not stream._cancels)
    await eventually(lambda: member.metric("etcd_debugging_mvcc_watcher_total") == 1)
    revision = await write(client, key, b"x")
    assert summary(await next_batch(kept)) == [(PUT, b"x", revision)]
    assert member.metric("etcd_debugging_mvcc_watcher_total") == 1
    assert [r.getMessage() for r in caplog.records if "broke" in r.getMessage()] == []


async def test_writes_during_an_outage_arrive_once_after_the_stream_moves(
    etcd_cluster: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    endpoints = etcd_cluster.endpoints
    watching = EtcdClient(endpoints, timeout=5)  # its stream starts on members[0]
    writer = EtcdClient(endpoints[1:], timeout=5)
    stream = WatchStream(watching)
    try:
        key = new_key()
        first = await write(writer, key, b"v0")
        watcher = stream.watch(key, first)
        assert summary(await next_batch(watcher)) == [(PUT, b"v0", first)]

        # Freeze the member the stream is on: the stream hangs, writes go on elsewhere.
        etcd_cluster.members[0].pause()
        await asyncio.to_thread(etcd_cluster.leader)
        expected: list[tuple[int, bytes | None, int]] = []
        for value in (b"v1", b"v2", b"v3", None, b"v4"):
            expected.append(
                (DELETE if value is None else PUT, value, await write(writer, key, value))
            )
        etcd_cluster.members[0].kill()
        # And some while the stream reconnects.
        for value in (b"v5", b"v6"):
            expected.append((PUT, value, await write(writer, key, value)))

        events: list[pb.Event] = []
        async with asyncio.timeout(10):
            while len(events) < len(expected):
                events.extend(await anext(watcher))
        assert summary(events) == expected
        # Exactly once: nothing more arrives, and new writes still do.
        with pytest.raises(TimeoutError):
            await next_batch(watcher, within=0.3)
        revision = await write(writer, key, b"v7")
        assert summary(await next_batch(watcher)) == [(PUT, b"v7", revision)]
        assert any("watch stream broke" in r.getMessage() for r in caplog.records)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR and not grpc_poller(r)]
    finally:
        await stream.close()
        await watching.close()
        await writer.close()


@pytest.mark.parametrize(
    ("asked", "reason"),
    [
        ("nothing", "etcd stopped answering the watch stream"),
        ("a create", "etcd did not confirm a watch in time"),
    ],
    ids=["quiet", "creating"],
)
async def test_a_member_that_freezes_under_a_stream_is_given_up_and_nothing_missed(
    etcd_cluster: EtcdCluster, caplog: pytest.LogCaptureFixture, asked: str, reason: str
) -> None:
    """A frozen member keeps its connections open and answers nothing, and gRPC's
    keepalive would take 15 s to notice. A quiet stream asks for progress and gives the
    member up when no answer comes; a create unanswered gives it up at once. Either way
    the change made meanwhile arrives from the next member. Decided by the reason the
    stream logs, not by the time it took."""
    caplog.set_level(logging.INFO, logger="etcd_leases.etcd.watch.stream")
    frozen = etcd_cluster.members[0]
    watching = EtcdClient(etcd_cluster.endpoints, timeout=5)  # its stream starts on `frozen`
    writer = EtcdClient(etcd_cluster.endpoints[1:], timeout=5)
    stream = WatchStream(watching)
    try:
        key = new_key()
        start = await current_revision(writer) + 1
        quiet = stream.watch(key, start)
        await registered(quiet)
        frozen.pause()
        late = stream.watch(key, start) if asked == "a create" else quiet
        await asyncio.to_thread(etcd_cluster.leader)
        revision = await write(writer, key, b"meanwhile")
        for watcher in {quiet, late}:
            assert summary(await next_batch(watcher, within=30)) == [(PUT, b"meanwhile", revision)]
        broke = [r.getMessage() for r in caplog.records if "watch stream broke" in r.getMessage()]
        assert broke[0].startswith(f"etcd watch stream broke (_StreamBroken: {reason}); ")
    finally:
        if frozen.paused:
            frozen.resume()
        await stream.close()
        await watching.close()
        await writer.close()


@pytest.mark.parametrize("endpoints", [2, 3])
async def test_an_unanswered_create_costs_the_members_share_of_the_timeout(
    etcd_cluster: EtcdCluster, endpoints: int
) -> None:
    """A create waits for its answer the client's timeout divided among the members (with
    one member, all of it), then the stream moves on. Decided by order, not by seconds: a
    transaction (never retried) sent on the frozen member first fails at the whole
    timeout, after the watch, begun later, has been created on another member."""
    frozen = etcd_cluster.members[0]
    client = EtcdClient(etcd_cluster.endpoints[:endpoints], timeout=3.0)
    stream = WatchStream(client)
    try:
        first = stream.watch(new_key(), await current_revision(client) + 1)
        await registered(first)  # the stream is up, on `frozen`
        frozen.pause()
        stuck = asyncio.ensure_future(client.txn(Txn.when().then(put(new_key(), b"")).request))
        await asyncio.sleep(0.2)
        late = stream.watch(new_key(), first.next_revision)
        await registered(late)
        assert not stuck.done()
        with pytest.raises(LeaseError):
            await stuck
    finally:
        if frozen.paused:
            frozen.resume()
        await stream.close()
        await client.close()


async def test_a_stream_that_served_a_while_is_reopened_without_the_grown_backoff(
    lone: Lone, caplog: pytest.LogCaptureFixture
) -> None:
    """While its member is down the stream is retried ever later (50 ms, 100 ms, ...);
    once a stream has served for 2 s, its break is a new failure, retried after 50 ms
    again. Read in the waits the stream logs, not in seconds."""
    caplog.set_level(logging.INFO, logger="etcd_leases.etcd.watch.stream")
    client, stream, member = lone.client, lone.stream, lone.etcd.members[0]
    watcher = stream.watch(new_key(), await current_revision(client) + 1)
    await registered(watcher)

    def waits() -> list[str]:
        return [
            r.getMessage().rpartition("reopening in ")[2]
            for r in caplog.records
            if "watch stream broke" in r.getMessage()
        ]

    await asyncio.to_thread(member.kill)
    await eventually(lambda: len(waits()) >= 4, within=20)
    await asyncio.to_thread(member.start)
    await registered(watcher)
    await asyncio.sleep(2.5)  # serving longer than 2 s
    grown = len(waits())
    assert waits()[:4] == ["0.05 s", "0.10 s", "0.20 s", "0.40 s"]
    await asyncio.to_thread(member.kill)
    await eventually(lambda: len(waits()) > grown, within=20)
    assert waits()[grown] == "0.05 s"


def grpc_poller(record: logging.LogRecord) -> bool:
    """gRPC's poller delivering an event of a call made on an earlier test's event loop,
    closed since (grpc/grpc#25364: one poller serves every loop a process has had); not
    this test's doing."""
    return "PollerCompletionQueue._handle_events" in record.getMessage()


async def test_compacted_start_revision_yields_the_reread_signal(lone: Lone) -> None:
    # Compaction is cluster-wide: on a member of our own.
    client, stream = lone.client, lone.stream
    async with asyncio.timeout(20):
        key = new_key()
        revisions = [await write(client, key, v) for v in (b"1", b"2", b"3")]
        await asyncio.to_thread(lone.etcd.etcdctl, "compact", str(revisions[2]))
        watcher = stream.watch(key, revisions[0])
        assert await next_batch(watcher) == []  # history lost: re-read the key
        assert watcher.next_revision == revisions[2] and not watcher.registered  # yet
        # It resumes at the compaction revision: what etcd kept comes once.
        events = await next_batch(watcher)
        assert summary(events) == [(PUT, b"3", revisions[2])]
        revision = await write(client, key, b"4")
        assert summary(await next_batch(watcher)) == [(PUT, b"4", revision)]


async def test_a_watch_from_now_resumes_where_it_began_when_its_stream_breaks(lone: Lone) -> None:
    """``start_revision=0`` begins right after the revision etcd created the watch at;
    after a break (its member restarted) the watcher is not registered until created
    again, from there: no change before it replayed, none after it lost."""
    client, stream, member = lone.client, lone.stream, lone.etcd.members[0]
    key = new_key()
    before = await write(client, key, b"before")
    watcher = stream.watch(key, 0)
    await registered(watcher)
    assert watcher.next_revision == before + 1
    await asyncio.to_thread(member.kill)
    await eventually(lambda: not watcher.registered)
    await asyncio.to_thread(member.start)
    await registered(watcher)  # the member serves again (a transaction is never retried)
    after = await write(client, key, b"after")
    assert summary(await next_batch(watcher)) == [(PUT, b"after", after)]


async def test_a_quiet_stream_on_a_live_member_is_kept(
    lone: Lone, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream with nothing to deliver asks for progress after a second of quiet, and the
    answer proves it alive: it is not given up, however long the quiet (here past the 3 s
    after which an unanswered probe gives a member up)."""
    caplog.set_level(logging.INFO, logger="etcd_leases.etcd.watch.stream")
    client, stream = lone.client, lone.stream
    key = new_key()
    watcher = stream.watch(key, await current_revision(client) + 1)
    await registered(watcher)
    await asyncio.sleep(4.5)
    assert [r.getMessage() for r in caplog.records if "broke" in r.getMessage()] == []
    revision = await write(client, key, b"after the quiet")
    assert summary(await next_batch(watcher)) == [(PUT, b"after the quiet", revision)]


class SlowProgressAnswers:
    """A watch call whose answers to progress requests, after the first, reach the stream
    1.3 s after their request, as over a slow link. It notes how long the stream had
    heard nothing when it asked for each; ``holding`` is set while it holds one back."""

    def __init__(self, call: grpc.aio.StreamStreamCall[pb.WatchRequest, pb.WatchResponse]) -> None:
        self._call = call
        self._heard_at = self._asked_at = asyncio.get_running_loop().time()
        self.progress_answers = 0
        self.quiet_before_requests: list[float] = []
        self.holding = asyncio.Event()

    async def write(self, request: pb.WatchRequest) -> None:
        if request.HasField("progress_request"):
            self._asked_at = asyncio.get_running_loop().time()
            self.quiet_before_requests.append(self._asked_at - self._heard_at)
        await self._call.write(request)

    async def read(self) -> object:
        response = await self._call.read()
        if isinstance(response, pb.WatchResponse) and response.watch_id == -1:
            self.progress_answers += 1
            if self.progress_answers > 1:
                self.holding.set()
                # From the request, not from the answer: how fast etcd answered does
                # not move the moment the stream hears it.
                await asyncio.sleep(self._asked_at + 1.3 - asyncio.get_running_loop().time())
                self.holding.clear()
        self._heard_at = asyncio.get_running_loop().time()
        return response

    def cancel(self) -> bool:
        return self._call.cancel()


async def test_a_slow_probe_answer_has_the_whole_patience(
    lone: Lone, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer to a progress request keeps the stream if it comes within the 2 s of
    patience counted from that request, however soon the answer before it came (one did
    not: a request sent 2 s after a prompt answer had 1 s), and whatever the stream sends
    meanwhile (here a cancel). Decided by order: each late answer comes 1.3 s after its
    request, 0.7 s before its patience ends; the code that gave 1 s gave the stream up at
    the first. And the stream asks only after a second of quiet."""
    caplog.set_level(logging.INFO, logger="etcd_leases.etcd.watch.stream")
    client, stream = lone.client, lone.stream
    calls: list[SlowProgressAnswers] = []
    open_call = client.watch_stream

    def slow_call(metadata: Metadata, index: int | None = None) -> SlowProgressAnswers:
        calls.append(SlowProgressAnswers(open_call(metadata, index)))
        return calls[-1]

    monkeypatch.setattr(client, "watch_stream", slow_call)
    key = new_key()
    start = await current_revision(client) + 1
    watcher, dropped = stream.watch(key, start), stream.watch(new_key(), start)
    await registered(watcher, dropped)
    async with asyncio.timeout(10):
        await calls[0].holding.wait()
    dropped.cancel()  # the sender writes while its request is unanswered
    # Three answers: a prompt one, then two late ones; or a second stream.
    await eventually(lambda: len(calls) > 1 or calls[0].progress_answers >= 3, within=20)
    assert [r.getMessage() for r in caplog.records if "broke" in r.getMessage()] == []
    assert len(calls) == 1
    assert min(calls[0].quiet_before_requests) >= 1.0
    revision = await write(client, key, b"after the slow answers")
    assert summary(await next_batch(watcher)) == [(PUT, b"after the slow answers", revision)]


async def test_a_quiet_watcher_follows_the_store_and_survives_a_compaction(
    etcd_binary: str,
) -> None:
    """etcd's progress notifications move a quiet watcher's resume point along, so a
    compaction past where it began costs it no history: resumed after a restart, it
    gets its next event, not "history lost"."""
    notify = "--experimental-watch-progress-notify-interval=100ms"
    with EtcdCluster(1, binary=etcd_binary, extra_args=[notify]) as etcd:
        async with asyncio.timeout(30):
            client = EtcdClient(etcd.endpoints, timeout=5)
            stream = WatchStream(client)
            try:
                key = new_key()
                watcher = stream.watch(key, await write(client, key, b"1") + 1)
                others = [await write(client, new_key(), b"x") for _ in range(5)]
                await eventually(lambda: watcher.next_revision == others[-1])
                await asyncio.to_thread(etcd.etcdctl, "compact", str(others[-1]))
                await asyncio.to_thread(etcd.members[0].restart)  # the stream breaks
                # A read is retried while the channel reconnects; a write is sent once
                # (UNAVAILABLE "failed to connect" seen in CI, the member just back).
                await current_revision(client)
                revision = await write(client, key, b"2")
                assert summary(await next_batch(watcher, 10)) == [(PUT, b"2", revision)]
            finally:
                await stream.close()
                await client.close()


@pytest.mark.parametrize(
    ("key", "start", "error", "message"),
    [
        ("text", 1, LeaseTypeError, "key must be bytes, not str"),
        (b"", 1, LeaseValueError, "key must not be empty"),
        (b"k", 1.0, LeaseTypeError, "start_revision must be an int, not float"),
        (b"k", True, LeaseTypeError, "start_revision must be an int, not bool"),
        (b"k", -1, LeaseValueError, "start_revision must be >= 0, got -1"),
    ],
)
async def test_bad_watch_arguments_are_refused_before_anything_is_sent(
    client: EtcdClient, key: object, start: object, error: type[Exception], message: str
) -> None:
    stream = WatchStream(client)
    try:
        with pytest.raises(error) as raised:
            stream.watch(key, start)  # type: ignore[arg-type]
        assert str(raised.value) == message
        assert not stream.running  # nothing was opened
    finally:
        await stream.close()


async def test_close_ends_every_watcher_with_provider_closed(
    client: EtcdClient,
) -> None:
    stream = WatchStream(client)
    key = new_key()
    start = await current_revision(client) + 1
    errors: list[Exception] = []
    iterated = stream.watch(key, start)
    called = stream.watch(key, start, on_events=lambda batch: None, on_error=errors.append)
    await registered(iterated, called)
    # One task serves the stream, named for whoever lists a process's tasks.
    names = [task.get_name() for task in asyncio.all_tasks()]
    assert names.count("etcd-leases watch stream") == 1
    revision = await write(client, key, b"x")

    async def drain() -> list[pb.Event]:
        events: list[pb.Event] = []
        async for batch in iterated:
            events.extend(batch)
        return events

    draining = asyncio.create_task(drain())
    await asyncio.sleep(0.1)
    await stream.close()
    await stream.close()  # idempotent
    with pytest.raises(ProviderClosed, match=r"^the watch stream is closed$"):
        await draining
    assert "etcd-leases watch stream" not in [task.get_name() for task in asyncio.all_tasks()]
    with pytest.raises(ProviderClosed):  # and again, for a late reader
        await anext(iterated)
    assert [type(error) for error in errors] == [ProviderClosed]
    assert called.ended and not stream.running
    assert not called.registered and repr(called) == f"<Watcher {key!r} ended>"
    with pytest.raises(ProviderClosed, match=r"^the watch stream is closed$"):
        stream.watch(key, revision)


async def test_closing_the_client_ends_watchers_with_provider_closed(etcd: EtcdCluster) -> None:
    client = EtcdClient(etcd.endpoints, timeout=5)
    stream = WatchStream(client)
    watcher = stream.watch(new_key(), await current_revision(client) + 1)
    await registered(watcher)
    await client.close()
    with pytest.raises(ProviderClosed, match=r"^the provider is closed$"):
        await next_batch(watcher)
    await stream.close()


async def test_no_member_reachable_keeps_watchers_waiting_until_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    [port] = free_ports(1)
    client = EtcdClient(f"127.0.0.1:{port}", timeout=1)
    stream = WatchStream(client)
    try:
        watcher = stream.watch(new_key(), 1)
        # The stream retries with backoff; the watcher neither ends nor sees a gRPC error.
        with pytest.raises(TimeoutError):
            await next_batch(watcher, within=1.0)
        assert not watcher.ended and stream.running
        assert sum("watch stream broke" in r.getMessage() for r in caplog.records) >= 3
    finally:
        await stream.close()
        await client.close()
    with pytest.raises(ProviderClosed):
        await next_batch(watcher)


async def test_a_failing_callback_does_not_disturb_the_others(
    client: EtcdClient, stream: WatchStream, caplog: pytest.LogCaptureFixture
) -> None:
    key = new_key()
    start = await current_revision(client) + 1

    def broken(batch: list[pb.Event]) -> None:
        raise RuntimeError("consumer bug")

    failing = stream.watch(key, start, on_events=broken)
    healthy = stream.watch(key, start)
    for value in (b"1", b"2"):
        revision = await write(client, key, value)
        assert summary(await next_batch(healthy)) == [(PUT, value, revision)]
    # The failing watcher was given both batches too (its answers may come later).
    await eventually(lambda: failing.next_revision == revision + 1)
    assert not failing.ended
    raised = [r for r in caplog.records if r.exc_info and "consumer bug" in str(r.exc_info[1])]
    assert len(raised) == 2


async def test_a_watch_outlives_any_number_of_expired_tokens(
    etcd_binary: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream reopened after its member froze carries a token that expired meanwhile:
    etcd refuses the first create, the client logs in again, and the watch is created.
    Each refusal settled so is forgotten: three of them (the limit for a watch refused
    though its key is readable) leave the watch alive. Tokens live 1 s here."""
    caplog.set_level(logging.INFO, logger="etcd_leases.etcd.watch.stream")
    with EtcdCluster(1, binary=etcd_binary, extra_args=["--auth-token-ttl=1"]) as etcd:
        enable_auth(etcd)
        member = etcd.members[0]
        client = EtcdClient(etcd.endpoints, timeout=5, username="app", password="apppw")
        stream = WatchStream(client)

        def refusals() -> int:
            return sum("etcd refused a watch" in r.getMessage() for r in caplog.records)

        def created_after(refused: int) -> Callable[[], bool]:
            return lambda: refusals() == refused and watcher.registered

        try:
            watcher = stream.watch(b"/allowed/w", (await client.range_at(b"/allowed/w"))[1] + 1)
            await registered(watcher)
            for round_ in range(1, 4):
                member.pause()
                try:
                    await eventually(lambda: not watcher.registered)  # the probe gave up
                finally:
                    member.resume()
                await eventually(created_after(round_))
            revision = await write(client, b"/allowed/w", b"still watched")
            assert summary(await next_batch(watcher)) == [(PUT, b"still watched", revision)]
        finally:
            await stream.close()
            await client.close()


async def test_a_client_closed_while_the_stream_logs_in_ends_its_watchers(
    etcd_binary: str,
) -> None:
    """Closing the client cancels the stream's login in flight (its member frozen): the
    watchers end with ``ProviderClosed`` rather than wait for ever."""
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        enable_auth(etcd)
        member = etcd.members[0]
        client = EtcdClient(etcd.endpoints, timeout=5, username="app", password="apppw")
        stream = WatchStream(client)
        try:
            start = (await client.range_at(b"/allowed/c"))[1] + 1  # connected, logged in
            member.pause()
            client.auth.invalidate(0)  # the stream must log in again, on the frozen member
            watcher = stream.watch(b"/allowed/c", start)
            await asyncio.sleep(0.3)  # its login is waiting
            await client.close()
            with pytest.raises(ProviderClosed, match=r"^the provider was closed during the call$"):
                await next_batch(watcher)
        finally:
            member.resume()
            await stream.close()
            await client.close()


async def test_an_expired_token_is_renewed_and_a_real_refusal_reported(etcd_binary: str) -> None:
    # etcd checks the token a stream was opened with at every create; tokens live 1 s here.
    with EtcdCluster(1, binary=etcd_binary, extra_args=["--auth-token-ttl=1"]) as etcd:
        enable_auth(etcd)
        client = EtcdClient(etcd.endpoints, timeout=5, username="app", password="apppw")
        stream = WatchStream(client)
        try:
            start = (await client.range_at(b"/allowed/a"))[1] + 1
            first = stream.watch(b"/allowed/a", start)
            await registered(first)
            await asyncio.sleep(2.5)  # the stream's token has expired by now
            errors: list[Exception] = []
            second = stream.watch(b"/allowed/b", start)
            refused = stream.watch(b"/forbidden", start, on_error=errors.append)
            a = await write(client, b"/allowed/a", b"1")
            b = await write(client, b"/allowed/b", b"2")
            assert summary(await next_batch(second)) == [(PUT, b"2", b)]
            assert summary(await next_batch(first)) == [(PUT, b"1", a)]
            with pytest.raises(TimeoutError):  # once, though the stream was reopened
                await next_batch(first, within=0.3)
            await eventually(lambda: refused.ended)
            assert [type(error) for error in errors] == [PermissionDenied]
            with pytest.raises(PermissionDenied):
                await next_batch(refused)
        finally:
            await stream.close()
            await client.close()
