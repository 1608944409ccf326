"""The model of tests/test_model.py refuses the answers the contract forbids (no etcd needed)."""

from __future__ import annotations

from etcd_leases import AcquireResult
from tests.lease_model import (
    ETCD,
    MEMORY,
    Free,
    Held,
    States,
    observe,
)
from tests.linearizability.history import acquire, get_owner, release, renew, transfer

START: States = frozenset({(Free(),)})


def held_by_alice(token: int = 5) -> States:
    """alice acquired the key with a 2 s TTL at t=0..0.1 and was told ``token``."""
    return observe(
        START,
        [(0, acquire("alice", 2000))],
        [AcquireResult(True, "alice", token, 2000)],
        0,
        0.1,
        ETCD,
    )


def test_a_free_key_is_acquired_and_held() -> None:
    states = held_by_alice()
    assert states
    assert observe(states, [(0, get_owner())], ["alice"], 0.2, 0.3, ETCD)
    assert not observe(states, [(0, get_owner())], [None], 0.2, 0.3, ETCD)
    assert not observe(
        states, [(0, acquire("bob", 1000))], [AcquireResult(True, "bob", 9, 1000)], 0.2, 0.3, ETCD
    )


def test_a_release_that_leaves_the_key_held_is_refused() -> None:
    released = observe(held_by_alice(), [(0, release("alice"))], [None], 0.2, 0.3, ETCD)
    assert not observe(released, [(0, get_owner())], ["alice"], 0.4, 0.5, ETCD)
    # ... unless the release and a renewal raced: then either order explains it.
    raced = observe(
        held_by_alice(),
        [(0, release("alice")), (0, renew("alice", 3000))],
        [None, True],
        0.2,
        0.3,
        ETCD,
    )
    assert not observe(raced, [(0, get_owner())], ["alice"], 0.4, 0.5, ETCD)
    assert observe(raced, [(0, get_owner())], [None], 0.4, 0.5, ETCD)


def test_no_transfer_or_renewal_after_expiry() -> None:
    for timing in (ETCD, MEMORY):
        states = observe(
            START,
            [(0, acquire("alice", 1000))],
            [AcquireResult(True, "alice", 5, 1000)],
            0,
            0.1,
            timing,
        )
        assert observe(states, [(0, transfer("alice", "bob", 1000))], [True], 0.5, 0.6, timing)
        assert not observe(states, [(0, transfer("alice", "bob", 1000))], [True], 1.2, 1.3, timing)
        assert not observe(states, [(0, renew("alice", 1000))], [True], 1.2, 1.3, timing)
        # Near the boundary both answers are allowed.
        assert observe(states, [(0, renew("alice", 1000))], [True], 0.99, 1.05, timing)
        assert observe(states, [(0, renew("alice", 1000))], [False], 0.99, 1.05, timing)


def test_etcd_may_show_an_expired_key_for_a_while_memory_may_not() -> None:
    states = held_by_alice()
    assert observe(states, [(0, get_owner())], ["alice"], 2.5, 2.6, ETCD)
    assert not observe(states, [(0, get_owner())], ["alice"], 2.5, 2.6, MEMORY)
    assert not observe(states, [(0, get_owner())], ["alice"], 2.2 + ETCD.deletion_slack, 9, ETCD)


def test_tokens_never_go_back_and_stay_within_a_tenure() -> None:
    states = held_by_alice(token=5)
    same = [(0, acquire("alice", 2000))]
    assert observe(states, same, [AcquireResult(True, "alice", 5, 2000)], 0.2, 0.3, ETCD)
    assert not observe(states, same, [AcquireResult(True, "alice", 6, 2000)], 0.2, 0.3, ETCD)
    released = observe(states, [(0, release("alice"))], [None], 0.2, 0.3, ETCD)
    assert not observe(
        released, [(0, acquire("bob", 2000))], [AcquireResult(True, "bob", 5, 2000)], 0.4, 0.5, ETCD
    )
    assert observe(
        released, [(0, acquire("bob", 2000))], [AcquireResult(True, "bob", 6, 2000)], 0.4, 0.5, ETCD
    )


def test_concurrent_acquires_have_one_winner_in_some_order() -> None:
    race = [(0, acquire("alice", 1000)), (0, acquire("bob", 1000))]
    bob_first = [AcquireResult(False, "bob"), AcquireResult(True, "bob", 3, 1000)]
    assert observe(START, race, bob_first, 0, 0.1, ETCD)
    both = [AcquireResult(True, "alice", 3, 1000), AcquireResult(True, "bob", 4, 1000)]
    assert not observe(START, race, both, 0, 0.1, ETCD)


def test_granted_ttls() -> None:
    assert [ETCD.granted(ms) for ms in (1, 999, 1000, 1001, 2500)] == [1000, 1000, 1000, 2000, 3000]
    assert MEMORY.granted(1234) == 1234
    assert Held("a", 1000, 1, 1, 1.0, 1.1).next_token() == 2
