"""The blocking API from threads: providers, hold, adopt, fencing and election."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from etcd_leases import LeaseHeld, LeaseLost
from etcd_leases.sync import Election, EtcdLeaseProvider, InMemoryLeaseProvider, SyncLeaseProvider
from tests.conftest import ETCD_BINARIES, EtcdMembers, unique_prefix


@pytest.fixture(params=["memory", *ETCD_BINARIES])
def sync_provider(
    request: pytest.FixtureRequest, etcd_members: EtcdMembers
) -> Iterator[tuple[SyncLeaseProvider, SyncLeaseProvider]]:
    """Two blocking providers of one backend (two processes' worth, on etcd)."""
    name = str(request.param)
    if name == "memory":
        only = InMemoryLeaseProvider()
        yield only, only
        only.close()
        return
    endpoints = etcd_members.get(ETCD_BINARIES[name]).endpoints
    prefix = unique_prefix()
    with (
        EtcdLeaseProvider(endpoints, prefix=prefix) as one,
        EtcdLeaseProvider(endpoints, prefix=prefix) as two,
    ):
        yield one, two


def test_contract_calls_block_and_answer(
    sync_provider: tuple[SyncLeaseProvider, SyncLeaseProvider],
) -> None:
    one, two = sync_provider
    result = one.acquire_lease("k", "alice", 5000)
    assert result.acquired and result.token is not None
    assert two.acquire_lease("k", "bob", 5000).owner == "alice"
    assert one.get_lease_owner("k") == "alice"
    assert one.renew_lease("k", "alice", 5000)
    assert two.transfer_lease("k", "alice", "bob", 5000)
    one.release_lease("k", "bob")
    assert two.get_lease_owner("k") is None
    with pytest.raises(ValueError):
        one.acquire_lease("", "alice", 5000)


def test_threads_contend_and_one_wins(
    sync_provider: tuple[SyncLeaseProvider, SyncLeaseProvider],
) -> None:
    one, two = sync_provider
    results: list[tuple[str, bool, str | None]] = []

    def contend(provider: SyncLeaseProvider, name: str) -> None:
        r = provider.acquire_lease("race", name, 5000)
        results.append((name, r.acquired, r.owner))

    threads = [
        threading.Thread(target=contend, args=((one, two)[i % 2], f"t{i}")) for i in range(16)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [name for name, acquired, _ in results if acquired]
    assert len(winners) == 1 and all(owner == winners[0] for _, _, owner in results)


def test_hold_keeps_detects_loss_and_fences(
    sync_provider: tuple[SyncLeaseProvider, SyncLeaseProvider],
) -> None:
    one, two = sync_provider
    with one.hold("job", "alice", 1000) as lease:
        time.sleep(2.5)  # renewed in the background
        lease.check()
        assert lease.remaining() > 0 and lease.put("job/state", "v1")
        with pytest.raises(LeaseHeld), two.hold("job", "bob", 1000):
            pass
        assert two.transfer_lease("job", "alice", "bob", 5000)
        assert lease.lost.wait(2.5)
        with pytest.raises(LeaseLost):
            lease.check()
        assert not lease.put("job/state", "stale")
    assert one.get_value("job/state") == b"v1"
    with two.adopt("job", "bob", 5000) as adopted:
        assert adopted.token > lease.token
        assert adopted.put("job/state", "v2")
    assert one.get_lease_owner("job") is None


def test_hold_waits_in_a_thread(sync_provider: tuple[SyncLeaseProvider, SyncLeaseProvider]) -> None:
    one, two = sync_provider
    one.acquire_lease("q", "alice", 10_000)
    got: list[float] = []

    def waiter() -> None:
        with two.hold("q", "bob", 10_000, wait=5):
            got.append(time.monotonic())

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    released = time.monotonic()
    one.release_lease("q", "alice")
    thread.join(5)  # half the TTL: the release was seen, not the TTL waited out
    assert got
    print(f"taken {1000 * (got[0] - released):.0f} ms after the release")


def test_election_from_threads(sync_provider: tuple[SyncLeaseProvider, SyncLeaseProvider]) -> None:
    one, two = sync_provider
    alice, bob = Election(one, "e", "alice", 5000), Election(two, "e", "bob", 5000)
    seen: list[str | None] = []

    def observe() -> None:
        for leader in bob.observe():
            seen.append(leader)
            if len(seen) == 4:
                return

    observer = threading.Thread(target=observe)
    observer.start()
    deadline = time.monotonic() + 10
    while seen != [None]:  # the observer saw the empty seat before alice campaigns
        assert time.monotonic() < deadline, seen
        time.sleep(0.01)
    alice.campaign()
    assert bob.leader() == "alice"
    with pytest.raises(LeaseHeld):
        bob.campaign(timeout=0.2)
    alice.resign()
    with bob.leadership() as lease:
        assert lease.owner == "bob"
    observer.join(5)
    assert seen == [None, "alice", None, "bob"]

    with pytest.raises(LeaseLost), alice.leadership() as lease:
        assert two.transfer_lease("e", "alice", "mallory", 5000)
        assert lease.lost.wait(2.5)
    assert one.get_lease_owner("e") == "mallory"
    one.release_lease("e", "mallory")


def test_run_from_a_thread_until_stopped(
    sync_provider: tuple[SyncLeaseProvider, SyncLeaseProvider],
) -> None:
    one, two = sync_provider
    election = Election(one, "r", "alice", 5000)
    terms: list[int] = []
    stopped: list[bool] = []
    leaders: list[str | None] = []

    def lead(lease: object) -> None:
        from etcd_leases.sync import SyncHeldLease

        assert isinstance(lease, SyncHeldLease)
        terms.append(lease.token)
        lease.lost.wait(10)  # work until the seat is lost

    runner = threading.Thread(
        target=election.run, args=(lead, lambda: stopped.append(True), leaders.append)
    )
    runner.start()
    deadline = time.monotonic() + 5
    while not terms and time.monotonic() < deadline:
        time.sleep(0.02)
    assert two.transfer_lease("r", "alice", "mallory", 5000)
    time.sleep(0.2)
    two.release_lease("r", "mallory")
    while len(terms) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(terms) == 2 and terms[1] > terms[0]
    election.stop()
    two.transfer_lease("r", "alice", "mallory", 5000)  # ends the term's work
    runner.join(5)
    assert not runner.is_alive() and len(stopped) == 2
    assert "mallory" in leaders


def test_stop_before_run_is_not_lost(
    sync_provider: tuple[SyncLeaseProvider, SyncLeaseProvider],
) -> None:
    """run() used to clear the stop event as it began, so an early stop() was lost."""
    one, _ = sync_provider
    election = Election(one, "early", "alice", 5000)
    terms: list[int] = []
    election.stop()
    runner = threading.Thread(target=election.run, args=(lambda lease: terms.append(1),))
    runner.start()
    runner.join(10)
    assert not runner.is_alive() and terms == []
    # The stop was used up by that run: the next run leads.
    election.run(lambda lease: terms.append(1))
    assert terms == [1]
