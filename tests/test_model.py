"""Model-based tests: random sequences of the five calls on etcd and on the memory model.

A Hypothesis state machine sends the same calls (several keys and owners, concurrent
batches, bad arguments, time passing beyond TTLs) to an :class:`EtcdLeaseProvider` and
an :class:`InMemoryLeaseProvider`, and checks every answer of each against what the
contract allows (:mod:`tests.lease_model`). Then fuzzing of keys, owners and TTLs at
the public API: bad ones are refused before anything is sent, odd good ones round-trip.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

from etcd_leases import (
    EtcdLeaseProvider,
    InMemoryLeaseProvider,
    LeaseProvider,
    LeaseTypeError,
    LeaseValueError,
)
from etcd_leases.contract import MAX_KEY_BYTES, MAX_OWNER_BYTES, MAX_TTL_MS
from etcd_leases.testing import EtcdCluster, free_ports
from tests.conftest import unique_prefix
from tests.lease_model import (
    ETCD,
    MEMORY,
    Free,
    States,
    Timing,
    observe,
)
from tests.linearizability.history import Call, acquire, get_owner, release, renew, transfer
from tests.linearizability.recorder import send

KEYS = ["k", "thread\x00one", "ключ"]
OWNERS = ["alice", "bob", "carol"]
TTLS = [1000, 1500, 2000, 3000]  # etcd grants 1 s, 2 s, 2 s and 3 s
EXAMPLES = int(os.environ.get("MODEL_EXAMPLES", "8"))
MAX_SLEEP_PER_EXAMPLE = 6.0  # seconds: bounds the run, and is past every TTL and slack

calls = st.one_of(
    st.builds(acquire, st.sampled_from(OWNERS), st.sampled_from(TTLS)),
    st.just(get_owner()),
    st.builds(release, st.sampled_from(OWNERS)),
    st.builds(renew, st.sampled_from(OWNERS), st.sampled_from(TTLS)),
    st.builds(transfer, st.sampled_from(OWNERS), st.sampled_from(OWNERS), st.sampled_from(TTLS)),
)
keyed_calls = st.tuples(st.integers(0, len(KEYS) - 1), calls)


# Bad arguments, each with the error the contract requires: (call, error class).
BadCall = Callable[[LeaseProvider], Awaitable[Any]]
BAD_CALLS: list[tuple[str, BadCall, type[Exception]]] = [
    ("key not a str", lambda p: p.acquire_lease(b"k", "alice", 1000), LeaseTypeError),  # type: ignore[arg-type]
    ("empty key", lambda p: p.get_lease_owner(""), LeaseValueError),
    ("lone surrogate", lambda p: p.release_lease("k\ud800", "alice"), LeaseValueError),
    ("key too long", lambda p: p.get_lease_owner("k" * (MAX_KEY_BYTES + 1)), LeaseValueError),
    (
        "owner too long",
        lambda p: p.renew_lease("k", "o" * (MAX_OWNER_BYTES + 1), 1000),
        LeaseValueError,
    ),
    ("owner None", lambda p: p.release_lease("k", None), LeaseTypeError),  # type: ignore[arg-type]
    ("ttl bool", lambda p: p.acquire_lease("k", "alice", True), LeaseTypeError),
    ("ttl float", lambda p: p.renew_lease("k", "alice", 1000.0), LeaseTypeError),  # type: ignore[arg-type]
    ("ttl NaN", lambda p: p.acquire_lease("k", "alice", math.nan), LeaseTypeError),  # type: ignore[arg-type]
    ("ttl 0", lambda p: p.transfer_lease("k", "alice", "bob", 0), LeaseValueError),
    ("ttl too big", lambda p: p.acquire_lease("k", "alice", MAX_TTL_MS + 1), LeaseValueError),
    ("empty to_owner", lambda p: p.transfer_lease("k", "alice", "", 1000), LeaseValueError),
]


class System:
    """One provider under test and the states the model still allows it to be in."""

    def __init__(self, name: str, provider: LeaseProvider, timing: Timing) -> None:
        self.name = name
        self.provider = provider
        self.timing = timing
        self.states: States = frozenset({tuple(Free() for _ in KEYS)})
        self.history: list[str] = []

    async def run(self, batch: list[tuple[int, Call]]) -> None:
        start = time.monotonic()
        answers = await asyncio.gather(*(send(self.provider, KEYS[k], c) for k, c in batch))
        end = time.monotonic()
        self.history.append(
            f"[{start:.3f}, {end:.3f}] "
            + " | ".join(
                f"{KEYS[k]!r} {c} -> {a!r}" for (k, c), a in zip(batch, answers, strict=True)
            )
        )
        allowed = observe(self.states, batch, answers, start, end, self.timing)
        assert allowed, (
            f"{self.name}: no state the contract allows explains the last answers.\n"
            + "\n".join(self.history[-8:])
            + f"\nstates before: {sorted(map(str, self.states))}"
        )
        self.states = allowed


async def cancel_the_rest() -> None:
    """Cancel calls left running (by a batch one of whose calls failed) and wait for them."""
    left = asyncio.all_tasks() - {asyncio.current_task()}
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


class LeaseMachine(RuleBasedStateMachine):
    endpoints: ClassVar[list[str]] = []

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        etcd = EtcdLeaseProvider(self.endpoints, prefix=unique_prefix(), timeout=10)
        self.systems = [
            System("memory", InMemoryLeaseProvider(), MEMORY),
            System("etcd", etcd, ETCD),
        ]
        self.slept = 0.0

    @rule(call=keyed_calls)
    def one_call(self, call: tuple[int, Call]) -> None:
        for system in self.systems:
            self.loop.run_until_complete(system.run([call]))

    @rule(batch=st.lists(keyed_calls, min_size=2, max_size=3))
    def concurrent_calls(self, batch: list[tuple[int, Call]]) -> None:
        for system in self.systems:
            self.loop.run_until_complete(system.run(batch))

    @rule(bad=st.sampled_from(BAD_CALLS))
    def bad_arguments(self, bad: tuple[str, BadCall, type[Exception]]) -> None:
        name, make, error = bad
        for system in self.systems:
            with pytest.raises(error):
                self.loop.run_until_complete(make(system.provider))
            system.history.append(f"bad call ({name}) refused")

    @precondition(lambda self: self.slept < MAX_SLEEP_PER_EXAMPLE)
    @rule(seconds=st.sampled_from([0.3, 1.1, 2.3]))
    def time_passes(self, seconds: float) -> None:
        time.sleep(seconds)
        self.slept += seconds
        for system in self.systems:
            system.history.append(f"slept {seconds} s")

    def teardown(self) -> None:
        for system in self.systems:
            close = getattr(system.provider, "close", None)
            if close is not None:
                self.loop.run_until_complete(close())
        self.loop.run_until_complete(cancel_the_rest())
        self.loop.close()


@pytest.mark.timeout(60 + 12 * EXAMPLES)
def test_random_call_sequences_get_answers_the_contract_allows(etcd: EtcdCluster) -> None:
    """Eight sequences by default (time passes for real); MODEL_EXAMPLES=200 for a soak."""
    LeaseMachine.endpoints = etcd.endpoints
    run_state_machine_as_test(
        LeaseMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# Fuzzing the public API.

good_keys = st.text(min_size=1).filter(lambda s: len(s.encode()) <= MAX_KEY_BYTES)
good_owners = st.text(min_size=1).filter(lambda s: len(s.encode()) <= MAX_OWNER_BYTES)
not_strings = st.one_of(st.none(), st.integers(), st.binary(), st.floats(), st.lists(st.text()))
bad_texts = st.one_of(
    st.just(""),
    st.text(st.characters(categories=["Cs"]), min_size=1),  # lone surrogates
    st.text(min_size=1).map(lambda s: s * (MAX_KEY_BYTES + 1)),  # too long as key and owner
)
bad_ttls = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=MAX_TTL_MS + 1),
    st.booleans(),
    st.floats(),
    st.none(),
    st.text(),
)


def ttl_error(ttl: object) -> type[Exception]:
    return LeaseValueError if isinstance(ttl, int) and not isinstance(ttl, bool) else LeaseTypeError


@pytest.fixture(scope="module")
def nowhere() -> list[str]:
    """An endpoint nothing listens on: a call that sent anything would fail unavailable."""
    return [f"127.0.0.1:{free_ports()[0]}"]


def refused(call: Callable[[LeaseProvider], Awaitable[Any]], endpoints: list[str]) -> list[type]:
    """The errors each provider raised for ``call``, in at most a second (nothing sent)."""

    async def both() -> list[type]:
        found: list[type] = []
        async with EtcdLeaseProvider(endpoints, timeout=1) as etcd:
            for provider in (InMemoryLeaseProvider(), etcd):
                try:
                    await call(provider)
                except Exception as exc:
                    found.append(type(exc))
        return found

    return asyncio.run(both())


FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
SLOW = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@FUZZ
@given(key=st.one_of(not_strings, bad_texts), owner=good_owners)
def test_bad_keys_are_refused_before_anything_is_sent(
    nowhere: list[str], key: object, owner: str
) -> None:
    error = LeaseTypeError if not isinstance(key, str) else LeaseValueError
    errors = refused(lambda p: p.acquire_lease(key, owner, 1000), nowhere)  # type: ignore[arg-type]
    assert errors == [error, error]


@FUZZ
@given(owner=st.one_of(not_strings, bad_texts))
def test_bad_owners_are_refused_before_anything_is_sent(nowhere: list[str], owner: object) -> None:
    error = LeaseTypeError if not isinstance(owner, str) else LeaseValueError
    errors = refused(lambda p: p.transfer_lease("k", "alice", owner, 1000), nowhere)  # type: ignore[arg-type]
    assert errors == [error, error]


TTL_CALLS: dict[str, Callable[[LeaseProvider, Any], Awaitable[Any]]] = {
    "acquire": lambda p, ttl: p.acquire_lease("k", "alice", ttl),
    "renew": lambda p, ttl: p.renew_lease("k", "alice", ttl),
    "transfer": lambda p, ttl: p.transfer_lease("k", "alice", "bob", ttl),
}


@FUZZ
@given(ttl=bad_ttls, call=st.sampled_from(sorted(TTL_CALLS)))
def test_bad_ttls_are_refused_before_anything_is_sent(
    nowhere: list[str], ttl: object, call: str
) -> None:
    errors = refused(lambda p: TTL_CALLS[call](p, ttl), nowhere)
    assert errors == [ttl_error(ttl)] * 2


@settings(max_examples=25, deadline=None, suppress_health_check=SLOW)
@given(key=good_keys, owner=good_owners, ttl=st.integers(1, MAX_TTL_MS))
@example(key="\x00", owner="\x00", ttl=1)
@example(key="resource\x00thread", owner="worker-é", ttl=1001)
@example(key="é" * (MAX_KEY_BYTES // 2), owner="ö" * (MAX_OWNER_BYTES // 2), ttl=MAX_TTL_MS)
@example(key="\U0001f600" * (MAX_KEY_BYTES // 4), owner="\u0394", ttl=999)
def test_odd_good_keys_owners_and_ttls_round_trip(
    etcd: EtcdCluster, key: str, owner: str, ttl: int
) -> None:
    async def round_trip() -> None:
        async with EtcdLeaseProvider(etcd.endpoints, prefix=unique_prefix()) as provider:
            for each in (InMemoryLeaseProvider(), provider):
                started = time.monotonic()
                result = await each.acquire_lease(key, owner, ttl)
                assert result.acquired and result.owner == owner
                assert result.ttl_ms is not None and result.ttl_ms >= ttl
                if each is provider:  # whole seconds, rounded up
                    assert result.ttl_ms == ETCD.granted(ttl)
                # Held for the TTL from the call's start: on a loaded host the read or
                # the renewal may come after it (then the tenure may have run out).
                ttl_s = result.ttl_ms / 1000
                read = await each.get_lease_owner(key)
                read_at = time.monotonic() - started
                renewed = await each.renew_lease(key, owner, ttl)
                renewed_at = time.monotonic() - started
                assert read == owner or (read_at >= ttl_s and read is None), read_at
                assert renewed or renewed_at >= ttl_s, renewed_at
                await each.release_lease(key, owner)
                assert await each.get_lease_owner(key) is None

    asyncio.run(round_trip())
