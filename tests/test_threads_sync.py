"""Agent threads from threads (etcd_leases.threads.sync), on memory and on etcd."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from etcd_leases import LeaseLost
from etcd_leases.sync import EtcdLeaseProvider, InMemoryLeaseProvider, SyncHeldLease
from etcd_leases.sync import SyncLeaseProvider as Provider
from etcd_leases.threads.sync import SyncThreadMessages, Threads
from tests.conftest import ETCD_BINARIES, EtcdMembers, unique_prefix


@pytest.fixture(params=["memory", *ETCD_BINARIES])
def providers(
    request: pytest.FixtureRequest, etcd_members: EtcdMembers
) -> Iterator[list[Provider]]:
    """Two blocking providers of one backend (two processes' worth, on etcd)."""
    if request.param == "memory":
        only = InMemoryLeaseProvider()
        yield [only, only]
        only.close()
        return
    endpoints = etcd_members.get(ETCD_BINARIES[str(request.param)]).endpoints
    prefix = unique_prefix()
    with (
        EtcdLeaseProvider(endpoints, prefix=prefix) as one,
        EtcdLeaseProvider(endpoints, prefix=prefix) as two,
    ):
        yield [one, two]


def _inbox_count(provider: Provider, count: str, thread: str) -> int:
    """The provider's inbox's ``count_woken`` or ``count_pending`` of ``thread``."""
    inbox = provider.aio.inbox  # type: ignore[attr-defined]
    return int(provider.portal.call(getattr(inbox, count), thread))


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int, str]] = []  # thread, payload, token, OS thread
        self.arrived = threading.Event()

    def __call__(self, thread: str, lease: SyncHeldLease, messages: SyncThreadMessages) -> None:
        assert messages.thread == thread
        for message in messages:
            self.seen.append((thread, message.text, lease.token, threading.current_thread().name))
            self.arrived.set()
            messages.ack(message)


def test_send_and_run_in_a_worker_thread(providers: list[Provider]) -> None:
    handled = Recorder()
    threads = Threads(providers[0], handled, ttl_ms=5000)
    threads.send("chat", "one")
    threads.send("chat", "two", run=True)
    assert [(name, payload) for name, payload, _, _ in handled.seen] == [
        ("chat", "one"),
        ("chat", "two"),
    ]
    assert handled.seen[0][3] != threading.current_thread().name
    assert providers[1].get_lease_owner(threads.key("chat")) is None


def test_serve_from_a_thread_until_stopped(providers: list[Provider]) -> None:
    handled = Recorder()
    worker = Threads(providers[0], handled, worker="w", ttl_ms=5000)
    sender = Threads(providers[1], handled, worker="s", ttl_ms=5000)
    serving = threading.Thread(target=worker.serve)
    serving.start()
    try:
        for i in range(5):
            sender.send(f"t{i % 2}", f"m{i}")
        deadline = time.monotonic() + 10
        while len(handled.seen) < 5:
            assert time.monotonic() < deadline, handled.seen
            time.sleep(0.01)
    finally:
        worker.stop()
        serving.join(10)
    assert not serving.is_alive()
    assert sorted(payload for _, payload, _, _ in handled.seen) == [f"m{i}" for i in range(5)]


def test_a_handler_that_lost_its_thread_cannot_ack(providers: list[Provider]) -> None:
    outcome: list[str] = []

    def handle(thread: str, lease: SyncHeldLease, messages: SyncThreadMessages) -> None:
        for message in messages:
            providers[1].transfer_lease(lease.key, lease.owner, "thief", 5000)
            assert lease.lost.wait(5)
            try:
                messages.ack(message)
            except LeaseLost as exc:
                outcome.append(str(exc))
                raise

    threads = Threads(providers[0], handle, ttl_ms=5000)
    threads.send("t", "x")
    with pytest.raises(LeaseLost):
        threads.run("t")
    assert len(outcome) == 1 and "lost 't' before acknowledging message 1" in outcome[0]
    assert providers[1].get_lease_owner(threads.key("t")) == "thief"


def test_a_send_retried_from_another_client_with_its_send_id_is_a_duplicate(
    providers: list[Provider],
) -> None:
    handled: list[str] = []

    def handle(thread: str, lease: SyncHeldLease, messages: SyncThreadMessages) -> None:
        for message in messages:
            handled.append(message.text)
            messages.ack(message)

    one, two = (Threads(provider, handle, ttl_ms=5000) for provider in providers)
    first = one.send("t", "hello", send_id="req-1", run=True)
    again = two.send("t", "hello", send_id="req-1", run=True)
    assert not first.duplicate and again.duplicate and again.id == first.id
    assert handled == ["hello"]


def test_an_abort_ends_a_blocking_handlers_messages(providers: list[Provider]) -> None:
    holding, aborted = threading.Event(), threading.Event()

    after: list[list[str]] = []

    def handle(thread: str, lease: SyncHeldLease, messages: SyncThreadMessages) -> None:
        for message in messages:
            if message.text != "hold":
                messages.ack(message)
                continue
            holding.set()
            # A thread cannot be cancelled: it checks between steps of its work.
            while not messages.aborted:
                time.sleep(0.01)
            # Its messages have ended, "next" too: that goes to the follow-up run.
            after.append([m.text for m in messages] + [m.text for m in messages.take_waiting()])
            aborted.set()
            messages.ack(message)  # harmless: the abort acknowledged it already

    threads = Threads(providers[0], handle, ttl_ms=5000)
    other = Threads(providers[1], Recorder())
    threads.send("t", "hold")
    threads.send("t", "next")
    running = threading.Thread(target=threads.run, args=("t",))
    running.start()
    assert holding.wait(10)
    assert other.abort("t")
    running.join(10)
    assert not running.is_alive()
    assert aborted.is_set() and after == [[]]
    assert providers[1].get_lease_owner(threads.key("t")) is None
    assert _inbox_count(providers[1], "count_pending", "t") == 0  # "next" was handled
    assert not other.abort("t")


def test_quiet_sends_wake_and_cancel_pending_from_threads(providers: list[Provider]) -> None:
    handled = Recorder()
    threads = Threads(providers[0], handled, ttl_ms=5000)
    other = Threads(providers[1], Recorder())
    other.send("t", "dropped", wake=False)
    assert _inbox_count(providers[1], "count_woken", "t") == 0  # quiet: nobody woken
    assert other.cancel_pending("t") == 1
    assert not other.wake("t")
    other.send("t", "kept", wake=False)
    assert other.wake("t")
    assert threads.run("t")
    assert [payload for _, payload, _, _ in handled.seen] == ["kept"]


def test_dead_letters_listed_retried_and_dropped_from_threads(providers: list[Provider]) -> None:
    delivered: list[str] = []

    def leave_poison(thread: str, lease: SyncHeldLease, messages: SyncThreadMessages) -> None:
        for message in messages:
            delivered.append(message.text)
            return  # left unacknowledged: a failed delivery

    threads = Threads(providers[0], leave_poison, ttl_ms=5000, max_attempts=1, backoff_s=0)
    other = Threads(providers[1], Recorder())
    threads.send("t", "poison", run=True)
    threads.send("t", "poison", run=True)
    first, second = other.dead_letters("t")
    assert [(first.seq, first.text), (second.seq, second.text)] == [(1, "poison"), (2, "poison")]
    retried = threads.retry_dead_letter(first, run=True)
    assert delivered == ["poison"] * 3  # run at once
    assert [letter.seq for letter in other.dead_letters("t")] == [2, retried.seq]
    assert threads.drop_dead_letter(second)
    assert not other.drop_dead_letter(second)
    (again,) = other.dead_letters("t")
    other.retry_dead_letter(again)  # sent again, not run
    assert other.dead_letters("t") == [] and delivered == ["poison"] * 3
    assert _inbox_count(providers[1], "count_pending", "t") == 1


def test_a_busy_blocking_handler_takes_in_what_was_sent_since(providers: list[Provider]) -> None:
    busy, sent = threading.Event(), threading.Event()
    taken: list[str] = []

    def handle(thread: str, lease: SyncHeldLease, messages: SyncThreadMessages) -> None:
        for message in messages:
            busy.set()
            assert sent.wait(10)
            deadline = time.monotonic() + 10
            while not taken and time.monotonic() < deadline:  # between two steps
                taken.extend(m.text for m in messages.take_waiting())
                time.sleep(0.01)
            messages.ack(message)

    threads = Threads(providers[0], handle, ttl_ms=5000)
    threads.send("t", "first")
    running = threading.Thread(target=threads.run, args=("t",))
    running.start()
    assert busy.wait(10)
    Threads(providers[1], Recorder()).send("t", "second", wake=False)
    sent.set()
    running.join(20)
    assert taken == ["second"]


def test_the_options_reach_each_run_and_its_lease_writes_fenced(providers: list[Provider]) -> None:
    runs: list[tuple[str, int, bool]] = []

    def handle(thread: str, lease: SyncHeldLease, messages: SyncThreadMessages) -> None:
        for message in messages:
            runs.append((lease.owner, lease.ttl_ms, lease.put("reply", message.text)))
            messages.ack(message)

    threads = Threads(providers[0], handle, worker="worker-7", ttl_ms=7000)
    threads.send("t", "hello", run=True)
    ((owner, ttl_ms, written),) = runs
    assert owner.startswith("worker-7/") and ttl_ms == 7000 and written


def test_a_blocking_handlers_error_reaches_the_caller_and_its_message_stays(
    providers: list[Provider],
) -> None:
    def fails(thread: str, lease: SyncHeldLease, messages: SyncThreadMessages) -> None:
        for _ in messages:
            raise RuntimeError("the model is down")

    threads = Threads(providers[0], fails, ttl_ms=5000)
    threads.send("t", "x")
    with pytest.raises(RuntimeError, match="the model is down"):
        threads.run("t")
    assert providers[1].get_lease_owner(threads.key("t")) is None
    assert _inbox_count(providers[1], "count_pending", "t") == 1
