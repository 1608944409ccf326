"""Threads' options: the defaults the README documents, and each bad option refused, by
name, before anything is sent. On the reference model: options are checked the same for
every backend."""

from __future__ import annotations

import os
import re
import socket

import pytest

from etcd_leases import HeldLease, InMemoryLeaseProvider, LeaseTypeError, LeaseValueError
from etcd_leases.contract import MAX_KEY_BYTES, MAX_OWNER_BYTES
from etcd_leases.threads import ThreadMessages, Threads
from etcd_leases.threads.retries import Retries


async def acknowledge(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
    async for message in messages:
        await messages.ack(message)


def test_the_defaults() -> None:
    threads = Threads(InMemoryLeaseProvider(), acknowledge)
    assert (threads.ttl_ms, threads.linger) == (15_000, 0.0)
    assert threads.key("chat") == "thread/chat"
    assert threads.retries == Retries(max_attempts=5, backoff_s=0.1, max_backoff_s=30.0)
    assert threads.worker == f"{socket.gethostname()}:{os.getpid()}"


async def test_each_run_is_owned_under_a_name_of_its_own() -> None:
    """``worker/<6 random hex digits>-<n>``: unique per run, even between workers of the
    same name (a restarted one), so a frozen run never passes for a later one."""
    owners: list[str] = []

    async def record(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
        owners.append(lease.owner)
        await acknowledge(thread, lease, messages)

    provider = InMemoryLeaseProvider()
    threads = Threads(provider, record, worker="w")
    restarted = Threads(provider, record, worker="w")
    for one in (threads, threads, restarted):
        await one.send("t", "x", run=True)
    assert [re.fullmatch(r"w/([0-9a-f]{6})-(\d+)", owner) is not None for owner in owners] == [
        True
    ] * 3
    assert [owner.rsplit("-", 1)[1] for owner in owners] == ["1", "2", "1"]
    assert len(set(owners)) == 3


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"worker": "w" * (MAX_OWNER_BYTES + 1)}, LeaseValueError, "worker is 1025 UTF-8 bytes"),
        ({"worker": 7}, LeaseTypeError, "worker must be a str, not int"),
        ({"linger": -0.5}, LeaseValueError, "linger must be a number of seconds >= 0, got -0.5"),
        ({"linger": float("inf")}, LeaseValueError, "linger must be .* got inf"),
        ({"max_payload_bytes": 0}, LeaseValueError, "max_payload_bytes must be in 1 ..= 1048576"),
        ({"namespace": 5}, LeaseTypeError, "namespace must be a str, not int"),
        (
            {"backoff_s": 2.0, "max_backoff_s": 1.0},
            LeaseValueError,
            "backoff must satisfy 0 <= backoff_s <= max_backoff_s",
        ),
        ({"max_backoff_s": float("inf")}, LeaseValueError, "backoff must satisfy"),
        ({"run_deadline_s": 0}, LeaseValueError, "run_deadline_s must be > 0, got 0"),
        ({"run_deadline_s": float("inf")}, LeaseValueError, "run_deadline_s must be > 0, got inf"),
    ],
)
def test_a_bad_option_is_refused_by_name(
    options: dict[str, object], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=f"^{words}"):
        Threads(InMemoryLeaseProvider(), acknowledge, **options)  # type: ignore[arg-type]


def test_the_bounds_themselves_are_allowed() -> None:
    provider = InMemoryLeaseProvider()
    Threads(provider, acknowledge, max_payload_bytes=1, backoff_s=2.0, max_backoff_s=2.0)
    Threads(provider, acknowledge, worker="w" * MAX_OWNER_BYTES, backoff_s=0.0)


def test_a_provider_without_an_inbox_is_refused_saying_what_it_lacks() -> None:
    with pytest.raises(
        LeaseTypeError,
        match=r"^object cannot run threads: it needs the hold capabilities and an inbox "
        r"\(see etcd_leases\.inbox\.InboxProvider\)$",
    ):
        Threads(object(), acknowledge)


def test_a_thread_name_too_long_under_the_namespace_is_refused_by_name() -> None:
    threads = Threads(InMemoryLeaseProvider(), acknowledge)
    name = "t" * (MAX_KEY_BYTES - 1)  # a valid thread name, too long once prefixed
    with pytest.raises(LeaseValueError, match=r"^namespace \+ thread is 4102 UTF-8 bytes"):
        threads.key(name)


async def test_sends_are_held_to_the_threads_own_payload_limit() -> None:
    threads = Threads(InMemoryLeaseProvider(), acknowledge, max_payload_bytes=4)
    await threads.send("t", "1234")
    with pytest.raises(LeaseValueError, match=r"^payload is 5 bytes, more than the 4 allowed$"):
        await threads.send("t", "12345")
    with pytest.raises(
        LeaseValueError, match=r"^run=True runs the thread, so it cannot go with wake=False$"
    ):
        await threads.send("t", "x", run=True, wake=False)
