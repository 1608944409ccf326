"""Agent threads on the in-memory model and on etcd: routing, hand-off, wake-ups, limits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from google.protobuf.message import Message as ProtoMessage

from etcd_leases import (
    EtcdLeaseProvider,
    HeldLease,
    LeaseLost,
    LeaseTypeError,
    LeaseValueError,
)
from etcd_leases.etcd.inbox_keys import id_of, inbox_root
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from etcd_leases.inbox import MAX_PAYLOAD_BYTES, Inbox
from etcd_leases.testing import EtcdCluster
from etcd_leases.threads import (
    DeadLetter,
    Handler,
    InboxFull,
    Message,
    ThreadMessages,
    Threads,
)
from tests.conftest import Live, assert_freed, settled, unique_prefix


@dataclass
class Handled:
    """What the handler saw: (thread, seq, payload, token) per message, in order."""

    items: list[tuple[str, int, str, int]] = field(default_factory=list)
    runs: list[tuple[str, int]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def payloads(self, thread: str) -> list[str]:
        return [payload for name, _, payload, _ in self.items if name == thread]


def recorder(handled: Handled) -> Handler:
    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        handled.runs.append((thread, lease.token))
        async for message in messages:
            handled.items.append((thread, message.seq, message.text, lease.token))
            handled.arrived.set()
            await messages.ack(message)

    return handle


async def test_send_then_run_handles_in_order_and_frees_the_thread(live: Live) -> None:
    handled = Handled()
    threads = Threads(live.provider, recorder(handled), ttl_ms=5000)
    sent = [await threads.send("chat\0a", f"m{i}") for i in range(5)]
    assert [message.seq for message in sent] == [1, 2, 3, 4, 5]
    assert await threads.run("chat\0a")
    assert handled.payloads("chat\0a") == [f"m{i}" for i in range(5)]
    assert len(handled.runs) == 1
    assert await live.provider.inbox.pending("chat\0a") == []
    assert await live.provider.get_lease_owner(threads.key("chat\0a")) is None


async def test_a_message_sent_during_a_run_reaches_that_run(live: Live) -> None:
    handled = Handled()
    arrived_at: list[float] = []

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        handled.runs.append((thread, lease.token))
        async for message in messages:  # waits up to `linger` for the next one
            handled.items.append((thread, message.seq, message.text, lease.token))
            arrived_at.append(time.monotonic())
            handled.arrived.set()
            await messages.ack(message)
            if len(handled.items) == 2:
                return

    threads = Threads(live.provider, handle, ttl_ms=5000, linger=30)
    await threads.send("t", "first")
    running = asyncio.create_task(threads.run("t"))
    await asyncio.wait_for(handled.arrived.wait(), 10)
    handled.arrived.clear()
    # Steady state: the run's inbox watch is registered (a new process's first watch
    # also opens the watch stream, tens of ms on a busy machine).
    await asyncio.sleep(0.2)
    sent_at = time.monotonic()
    await threads.send("t", "second", run=True)  # the thread is held: the run gets it
    await asyncio.wait_for(handled.arrived.wait(), 10)
    latency = arrived_at[-1] - sent_at
    assert await running
    print(
        f"\n{live.provider.__class__.__name__}: delivered to the running run in "
        f"{latency * 1000:.1f} ms"
    )
    assert handled.payloads("t") == ["first", "second"]
    assert len(handled.runs) == 1, "the second message must reach the run that was running"
    assert handled.items[0][3] == handled.items[1][3]


async def test_unacknowledged_messages_go_to_a_follow_up_run_with_a_higher_token(
    live: Live,
) -> None:
    handled = Handled()
    acked_once: list[int] = []

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        handled.runs.append((thread, lease.token))
        async for message in messages:
            handled.items.append((thread, message.seq, message.text, lease.token))
            if not acked_once:  # the first run acks one message and leaves the rest
                acked_once.append(message.seq)
                await messages.ack(message)
                return
            await messages.ack(message)

    threads = Threads(live.provider, handle, ttl_ms=5000)
    for i in range(3):
        await threads.send("t", f"m{i}")
    assert await threads.run("t")
    assert handled.payloads("t") == ["m0", "m1", "m2"]
    (_, first), (_, second) = handled.runs
    assert second > first
    assert await live.provider.get_lease_owner(threads.key("t")) is None


async def test_no_lost_wake_up_when_sends_race_the_end_of_runs(live: Live) -> None:
    """Serverless senders racing a run that is ending: every message is handled."""
    handled = Handled()
    paths: Counter[str] = Counter()

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        first_of_run = True
        async for message in messages:
            handled.items.append((thread, message.seq, message.text, lease.token))
            if message.text.startswith("b"):
                # Who got the racing message: the ending run, its follow-up, or its sender.
                worker = lease.owner.split("/")[0]
                paths[f"{worker}, {'first' if first_of_run else 'later'} in its run"] += 1
            first_of_run = False
            await messages.ack(message)

    threads = Threads(live.provider, handle, worker="A", ttl_ms=5000)
    other = Threads(live.another(), handle, worker="B", ttl_ms=5000)
    rounds = 60

    async def send_after(delay: float, payload: str) -> None:
        await asyncio.sleep(delay)
        await other.send("race", payload, run=True)

    for i in range(rounds):
        await threads.send("race", f"a{i}")
        # One run ends (its inbox looks empty) while another sender's message lands.
        # The delays sweep the sender across the whole end of the run.
        await asyncio.gather(threads.run("race"), send_after(i * 0.0002, f"b{i}"))
        # Both calls returned: the message went to a run that has ended, so it was
        # handled; nothing may be left waiting (no run is left to pick it up).
        assert handled.payloads("race")[-2:] in ([f"a{i}", f"b{i}"], [f"b{i}", f"a{i}"])
    print(f"\n{type(live.provider).__name__}: racing message handled by {dict(paths)}")
    assert await live.provider.inbox.pending("race") == []
    assert await live.provider.get_lease_owner(threads.key("race")) is None


async def test_a_run_that_lost_its_thread_is_cut_short_and_cannot_acknowledge(
    live: Live,
) -> None:
    seen: list[Message] = []

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for message in messages:
            seen.append(message)
            # Someone takes the thread from under the run (as after an expiry).
            await live.provider.transfer_lease(lease.key, lease.owner, "thief", 5000)
            # The run is cancelled as soon as it sees the loss; if it gets here first,
            # the fenced ack refuses.
            await messages.ack(message)
            raise AssertionError("a run that lost its thread acknowledged a message")

    threads = Threads(live.provider, handle, ttl_ms=5000)
    await threads.send("t", "x")
    with pytest.raises(LeaseLost):
        await threads.run("t")
    assert len(seen) == 1
    assert [m.text for m in await live.provider.inbox.pending("t")] == ["x"]
    assert await live.provider.get_lease_owner(threads.key("t")) == "thief"


async def test_acks_and_releases_are_fenced_by_the_token(live: Live) -> None:
    inbox = live.provider.inbox
    message = await inbox.append("t", b"x", 10)
    first = await live.provider.acquire_lease("thread/t", "run-1", 5000)
    assert first.token is not None
    assert await live.provider.transfer_lease("thread/t", "run-1", "run-2", 5000)
    second = await live.provider.acquire_lease("thread/t", "run-2", 5000)
    assert second.token is not None and second.token > first.token
    assert not await inbox.ack("thread/t", "run-1", first.token, message)
    assert not await inbox.ack("thread/t", "run-2", first.token, message)
    assert not await inbox.release_if_empty("thread/t", "run-2", second.token, "t")
    # The holder's token named with another owner: the owner is compared too.
    assert not await inbox.ack("thread/t", "run-1", second.token, message)
    assert await inbox.ack("thread/t", "run-2", second.token, message)
    assert not await inbox.release_if_empty("thread/t", "run-1", second.token, "t")
    assert await inbox.pending("t") == []
    assert not await inbox.release_if_empty("thread/t", "run-1", first.token, "t")
    assert not await inbox.release_if_empty("thread/t", "run-2", first.token, "t")
    provider = live.provider
    lease = 0
    if isinstance(provider, EtcdLeaseProvider):
        kv = await provider.client.range(provider.etcd_key("thread/t"))
        assert kv is not None
        lease = kv.lease
    assert await inbox.release_if_empty("thread/t", "run-2", second.token, "t")
    assert await provider.get_lease_owner("thread/t") is None
    assert not await inbox.release_if_empty("thread/t", "run-2", second.token, "t")
    if isinstance(provider, EtcdLeaseProvider):  # the lease the key was on is freed
        await settled(provider)
        await assert_freed(provider, lease)


async def test_an_ack_refuses_an_id_outside_its_threads_inbox(live: Live) -> None:
    inbox, provider = live.provider.inbox, live.provider
    mine = await inbox.append("t", b"mine", 10)
    other = await inbox.append("u", b"other", 10)
    held = await provider.acquire_lease("thread/t", "run", 5000)
    assert held.token is not None
    forged = [other.id, "thread/t", mine.id.rpartition("/")[0], "\ud800"]  # no UTF-8
    if isinstance(provider, EtcdLeaseProvider):
        forged.append(id_of(provider.etcd_key("thread/t")))  # the lease key itself
    for message_id in forged:
        with pytest.raises(LeaseValueError, match="is not in the inbox of thread 't'"):
            await inbox.ack("thread/t", "run", held.token, Message("t", 1, b"", message_id))
    assert await provider.get_lease_owner("thread/t") == "run"
    assert [m.text for m in await inbox.pending("u")] == ["other"]
    assert await inbox.ack("thread/t", "run", held.token, mine)
    assert await inbox.pending("t") == []


async def test_a_run_acknowledges_only_its_own_threads_messages(live: Live) -> None:
    other = await live.provider.inbox.append("b", b"not yours", 10)

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for _ in messages:
            await messages.ack(other)
            raise AssertionError("a run acknowledged another thread's message")

    threads = Threads(live.provider, handle, ttl_ms=5000)
    await threads.send("a", "x")
    only_its_own = r"a run acknowledges only its own thread's messages$"
    with pytest.raises(LeaseValueError, match=only_its_own):
        await threads.run("a")
    assert [m.text for m in await live.provider.inbox.pending("b")] == ["not yours"]


async def test_count_pending_counts_what_is_waiting(live: Live) -> None:
    inbox = live.provider.inbox
    assert await inbox.count_pending("t") == 0
    first = await inbox.append("t", b"x" * MAX_PAYLOAD_BYTES, 10)
    await inbox.append("t", b"y", 10)
    await inbox.append("u", b"z", 10)
    assert await inbox.count_pending("t") == 2
    held = await live.provider.acquire_lease("thread/t", "run", 5000)
    assert held.token is not None
    assert await inbox.ack("thread/t", "run", held.token, first)
    assert await inbox.count_pending("t") == len(await inbox.pending("t")) == 1


async def test_serve_takes_over_a_thread_whose_owner_died(live: Live) -> None:
    handled = Handled()
    threads = Threads(live.provider, recorder(handled), ttl_ms=1000)
    # A dead owner: it holds the thread's lease, never renews it, never runs.
    assert (await live.provider.acquire_lease(threads.key("t"), "dead", 1000)).acquired
    await threads.send("t", "waiting")
    stop = asyncio.Event()
    serving = asyncio.create_task(threads.serve(stop))
    await asyncio.wait_for(handled.arrived.wait(), 15)
    await threads.send("t", "later")  # while serving: runs at once
    deadline = time.monotonic() + 10
    while handled.payloads("t") != ["waiting", "later"]:
        assert time.monotonic() < deadline, handled.items
        await asyncio.sleep(0.01)
    stop.set()
    await serving


async def test_bad_input_is_refused_before_anything_is_written(live: Live) -> None:
    threads = Threads(live.provider, recorder(Handled()), max_pending=2)
    with pytest.raises(ValueError, match="payload is 1048577 bytes"):
        await threads.send("t", b"x" * (MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(TypeError, match="thread must be a str"):
        await threads.send(42, "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="thread must not be empty"):
        await threads.send("", "x")
    with pytest.raises(TypeError, match="payload must be bytes or str"):
        await threads.send("t", 3)  # type: ignore[arg-type]
    assert await live.provider.inbox.pending("t") == []
    await threads.send("t", "1")
    await threads.send("t", "2")
    with pytest.raises(InboxFull, match=r"^the inbox of 't' holds 2 unacknowledged messages"):
        await threads.send("t", "3")
    assert [m.text for m in await live.provider.inbox.pending("t")] == ["1", "2"]
    assert await threads.run("t")
    await threads.send("t", "3")  # room again once the run caught up


async def _first_batch(inbox: Inbox, thread: str) -> list[Message]:
    async with contextlib.aclosing(inbox.watch(thread)) as batches:
        return await anext(batches)


# Every call of the inbox that names a thread, given ``thread`` for it.
THREAD_CALLS: dict[str, Callable[[Inbox, Any], Awaitable[object]]] = {
    "append": lambda inbox, thread: inbox.append(thread, b"x", 10),
    "wake": lambda inbox, thread: inbox.wake(thread),
    "count_woken": lambda inbox, thread: inbox.count_woken(thread),
    "pending": lambda inbox, thread: inbox.pending(thread),
    "count_pending": lambda inbox, thread: inbox.count_pending(thread),
    "watch": _first_batch,
    "ack": lambda inbox, thread: inbox.ack("k", "o", 1, Message(thread, 1, b"", "m")),
    "release_if_empty": lambda inbox, thread: inbox.release_if_empty("k", "o", 1, thread),
    "deliver": lambda inbox, thread: inbox.deliver("k", "o", 1, Message(thread, 1, b"", "m")),
    "dead_letter": lambda inbox, thread: inbox.dead_letter(
        "k", "o", 1, Message(thread, 1, b"", "m"), 3
    ),
    "dead_letters": lambda inbox, thread: inbox.dead_letters(thread),
    "drop_dead_letter": lambda inbox, thread: inbox.drop_dead_letter(
        DeadLetter(thread, 1, b"", "m", 3)
    ),
    "cancel_pending": lambda inbox, thread: inbox.cancel_pending("k", thread),
    "abort": lambda inbox, thread: inbox.abort("k", thread),
    "aborted": lambda inbox, thread: inbox.aborted(thread, 1),
}


async def test_every_inbox_call_refuses_a_thread_that_is_not_one_naming_it(live: Live) -> None:
    """An empty thread, or one not a str, is refused by each call in words naming the
    thread, as a key is (the contract's bad-input rules)."""
    inbox = live.provider.inbox
    for name, call in THREAD_CALLS.items():
        with pytest.raises(LeaseValueError, match=r"^thread must not be empty$"):
            await call(inbox, "")
            pytest.fail(f"{name} took the empty thread")
        with pytest.raises(LeaseTypeError, match=r"^thread must be a str, not int$"):
            await call(inbox, 42)
            pytest.fail(f"{name} took the thread 42")


async def test_the_largest_payload_is_stored(live: Live) -> None:
    threads = Threads(live.provider, recorder(Handled()))
    payload = b"\xff" * MAX_PAYLOAD_BYTES
    await threads.send("big", payload)
    assert [m.payload for m in await live.provider.inbox.pending("big")] == [payload]


async def test_threads_do_not_see_each_others_messages(live: Live) -> None:
    threads = Threads(live.provider, recorder(Handled()))
    await threads.send("a", "for a")
    await threads.send("a\0b", "for a-nul-b")
    await threads.send("a/0001/x", "for a/0001/x")
    assert [m.text for m in await live.provider.inbox.pending("a")] == ["for a"]


@pytest.mark.parametrize(
    ("lease_prefix", "root"),
    [("/etcd-leases/", b"/etcd-leases.inbox/"), ("/app", b"/app\xff.inbox/"), ("", b"\xff.inbox/")],
)
def test_inboxes_never_fall_under_a_lease_key(lease_prefix: str, root: bytes) -> None:
    assert inbox_root(lease_prefix) == root


async def test_a_failing_handler_releases_the_thread_and_keeps_its_messages(live: Live) -> None:
    async def fail(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for _ in messages:
            raise RuntimeError("the model is down")

    threads = Threads(live.provider, fail, ttl_ms=5000)
    await threads.send("t", "x")
    with pytest.raises(RuntimeError, match="the model is down"):
        await threads.run("t")
    assert await live.provider.get_lease_owner(threads.key("t")) is None
    handled = Handled()
    assert await Threads(live.provider, recorder(handled)).run("t")
    assert handled.payloads("t") == ["x"]


async def test_a_thread_with_nothing_waiting_is_not_run(live: Live) -> None:
    handled = Handled()
    threads = Threads(live.provider, recorder(handled))
    assert await threads.run("idle")  # took the thread, found nothing, released it
    assert handled.runs == []
    assert await live.provider.get_lease_owner(threads.key("idle")) is None


async def test_concurrent_sends_to_one_thread_get_one_seq_each_in_ack_order(live: Live) -> None:
    threads = [
        Threads(live.provider, recorder(Handled())),
        Threads(live.another(), recorder(Handled())),
    ]

    async def sender(index: int) -> list[int]:
        seqs = []
        for i in range(25):
            message = await threads[index % 2].send("busy", f"{index}-{i}")
            seqs.append(message.seq)
        return seqs

    per_sender = await asyncio.gather(*(sender(index) for index in range(8)))
    for seqs in per_sender:  # each sender's sends were acknowledged one after the other
        assert seqs == sorted(seqs)
    every = sorted(seq for seqs in per_sender for seq in seqs)
    assert every == list(range(1, 201))
    waiting = await live.provider.inbox.pending("busy")
    assert [message.seq for message in waiting] == every
    for provider in (live.provider, *live.others):
        if isinstance(provider, EtcdLeaseProvider):  # no send left its queue behind
            assert not provider.inbox._queues


async def test_append_checks_its_options_and_wakes_by_default(live: Live) -> None:
    inbox = live.provider.inbox
    with pytest.raises(LeaseTypeError, match=r"^send_id must be a SendId, not str$"):
        await inbox.append("t", b"x", 10, "req")  # type: ignore[arg-type]
    with pytest.raises(LeaseTypeError, match=r"^wake must be a bool, not str$"):
        await inbox.append("t", b"x", 10, wake="yes")  # type: ignore[arg-type]
    assert await inbox.pending("t") == []
    await inbox.append("t", b"x", 10)
    assert await inbox.count_woken("t") == 1


async def test_sends_queued_in_one_process_read_their_thread_once(
    etcd_provider: EtcdLeaseProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten sends at once to a thread that has messages already: the first reads the
    thread's ``seq`` key, and each send queued behind it takes that key from the answer
    to the one before, so none conflicts with another: one read, one transaction a
    send (a send that took the key for absent, or read it again, costs one more)."""
    inbox = etcd_provider.inbox
    await inbox.append("t", b"before", 100)
    seq_key = inbox.keys.seq("t")
    sent: Counter[str] = Counter()
    original = etcd_provider.client._attempt

    async def attempt(
        index: int,
        path: str,
        request: ProtoMessage,
        response_type: type[ProtoMessage],
        deadline: float,
    ) -> ProtoMessage:
        if isinstance(request, pb.TxnRequest):
            sent["txn"] += 1
        elif isinstance(request, pb.RangeRequest) and request.key == seq_key:
            sent["seq read"] += 1
        return await original(index, path, request, response_type, deadline)

    monkeypatch.setattr(etcd_provider.client, "_attempt", attempt)
    stored = await asyncio.gather(*(inbox.append("t", b"%d" % i, 100) for i in range(10)))
    assert [message.seq for message in stored] == list(range(2, 12))
    assert sent == {"seq read": 1, "txn": 10}


async def test_threads_work_under_a_lease_prefix_without_a_final_slash(etcd: EtcdCluster) -> None:
    async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix().rstrip("/")) as provider:
        handled = Handled()
        threads = Threads(provider, recorder(handled))
        await threads.send("t", "x", run=True)
        assert handled.payloads("t") == ["x"]
        assert await provider.inbox.pending("t") == []


async def test_a_run_that_ends_normally_logs_no_loss(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    handled = Handled()
    threads = Threads(live.provider, recorder(handled), ttl_ms=5000)
    await threads.send("quiet", "m")
    with caplog.at_level("WARNING", logger="etcd_leases"):
        assert await threads.run("quiet")
        await asyncio.sleep(0.2)  # the key's watch event of the release arrives
    assert handled.payloads("quiet") == ["m"]
    assert [r.getMessage() for r in caplog.records if "lost" in r.getMessage()] == []


async def test_hand_offs_and_aborts_are_not_logged_as_losses(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    one_per_run: list[str] = []
    started = asyncio.Event()

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for message in messages:
            if message.text == "abort me":
                started.set()
                await asyncio.Event().wait()
            await messages.ack(message)
            one_per_run.append(message.text)
            return  # the rest goes to a follow-up run: a hand-off each time

    threads = Threads(live.provider, handle, ttl_ms=5000)
    for text in ("a", "b", "c", "abort me", "d"):
        await threads.send("t", text)
    with caplog.at_level("INFO", logger="etcd_leases"):
        running = asyncio.create_task(threads.run("t"))
        await asyncio.wait_for(started.wait(), 10)
        assert await threads.abort("t")
        assert await asyncio.wait_for(running, 10)
        await asyncio.sleep(0.2)  # the key's watch events of the hand-offs arrive
    assert one_per_run == ["a", "b", "c", "d"]
    ours = [r for r in caplog.records if r.name in ("etcd_leases.hold", "etcd_leases.threads")]
    assert [r.getMessage() for r in ours if r.levelno >= logging.WARNING] == []
    assert sum("handed off" in r.getMessage() for r in caplog.records) == 4


async def abort_once_started(threads: Threads, texts: list[str], started: asyncio.Event) -> None:
    """Send ``texts`` to thread "t", run it, abort the run once its handler set
    ``started``; the run ends."""
    for text in texts:
        await threads.send("t", text)
    running = asyncio.create_task(threads.run("t"))
    await asyncio.wait_for(started.wait(), 10)
    assert await threads.abort("t")
    assert await asyncio.wait_for(running, 10)


async def test_an_abort_acknowledges_every_message_its_handler_was_handed(live: Live) -> None:
    started = asyncio.Event()

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for message in messages:  # taken, never acknowledged
            if message.text == "second":
                started.set()
                await asyncio.Event().wait()

    await abort_once_started(
        Threads(live.provider, handle, ttl_ms=5000), ["first", "second"], started
    )
    assert await live.provider.inbox.pending("t") == []


async def test_acknowledging_twice_is_harmless_and_an_abort_skips_what_was_acknowledged(
    live: Live,
) -> None:
    started = asyncio.Event()

    async def handle(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        async for message in messages:
            await messages.ack(message)
            await messages.ack(message)  # again: nothing more happens
            if message.text == "blocks":
                assert list(messages.handed) == []  # what was acknowledged is done with
                started.set()
                await asyncio.Event().wait()

    await abort_once_started(
        Threads(live.provider, handle, ttl_ms=5000), ["first", "blocks"], started
    )
    assert await live.provider.inbox.pending("t") == []


async def test_an_inbox_watch_never_yields_a_message_again_after_a_compaction(
    etcd: EtcdCluster, etcd_provider: EtcdLeaseProvider
) -> None:
    """A watch whose history was compacted away reads the whole inbox again: what it
    yielded before (message 1, still unacknowledged) is not yielded a second time."""
    inbox = etcd_provider.inbox
    await inbox.append("t", b"1", 10)
    batches = inbox.watch("t")
    try:
        assert [m.seq for m in await anext(batches)] == [1]
        # Its watch starts after this batch, from a revision compacted by then.
        for text in (b"2", b"3"):
            await inbox.append("t", text, 10)
        # Compacted past the inbox's last change: nothing of it left to replay.
        etcd.etcdctl("put", "elsewhere", "x")
        _, revision = await etcd_provider.client.range_at(b"elsewhere")
        etcd.etcdctl("compact", str(revision))
        seen: list[int] = []
        async with asyncio.timeout(10):
            while 3 not in seen:  # no put after the compaction: the read again finds them
                seen += [m.seq for m in await anext(batches)]
            assert seen == [2, 3]
            await inbox.append("t", b"4", 10)
            assert [m.seq for m in await anext(batches)] == [4]
    finally:
        await batches.aclose()


async def test_an_inbox_watch_of_an_empty_thread_yields_nothing_then_the_first_message(
    live: Live,
) -> None:
    inbox = live.provider.inbox
    async with contextlib.aclosing(inbox.watch("t")) as batches:
        assert await anext(batches) == []
        sent = await inbox.append("t", b"1", 10)
        async with asyncio.timeout(10):
            assert await anext(batches) == [sent]
