"""Members: which endpoint a call tries first and next, and what etcd's member list adds.

The policy is decided on the clock alone, so these tests set the clock the module reads
rather than wait: a failed member cools down for 5 s (0.5 s after "no leader"), and
every choice below is read at a given instant. The failover tests run the same policy
against real etcd members (``test_failover.py``, ``test_renewal_round.py``).
"""

from __future__ import annotations

import asyncio
import re
import types

import grpc
import pytest

from etcd_leases.errors import BackendUnavailable, LeaseValueError, ProviderClosed
from etcd_leases.etcd import member_sync as member_sync_module
from etcd_leases.etcd import members as members_module
from etcd_leases.etcd.member_sync import MemberSync
from etcd_leases.etcd.members import Members, parse_endpoints
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from tests.conftest import eventually


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(members_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    return clock


def cluster(count: int, failures: list[str] | None = None) -> Members:
    """``count`` members on made-up ports; each failure reported appends to ``failures``."""
    endpoints = parse_endpoints([f"127.0.0.1:{2379 + 10 * i}" for i in range(count)], tls=False)
    log = failures if failures is not None else []
    return Members(endpoints, grpc.ssl_channel_credentials(), lambda: log.append("failed"))


def test_the_first_endpoint_is_preferred_until_another_answers(clock: Clock) -> None:
    members = cluster(3)
    assert (len(members), members.preferred()) == (3, 0)
    members.answered(2)
    assert members.preferred() == 2


def test_a_failure_moves_on_to_the_next_member_that_is_not_cooling_down(clock: Clock) -> None:
    failures: list[str] = []
    members = cluster(4, failures)
    assert members.failed(0) == 1 and members.preferred() == 1
    clock.now += 1
    assert members.failed(1) == 2
    clock.now += 1
    assert members.failed(3) == 2  # 0 and 1 cool down: passed over, wrapping round
    assert members.preferred() == 2  # 3 failing leaves the preferred one alone
    assert failures == ["failed"] * 3


def test_with_every_member_cooling_down_the_one_that_failed_first_is_next(clock: Clock) -> None:
    members = cluster(3)
    members.failed(1)
    clock.now += 1
    members.failed(2)
    clock.now += 1
    assert members.failed(0) == 1  # its cool-down ends first
    clock.now += 3.5  # 1's ends now, the others' later
    assert members.failed(2) == 1


@pytest.mark.parametrize(("no_leader", "cool_down_s"), [(False, 5.0), (True, 0.5)])
def test_a_failed_member_cools_down_for_five_seconds_or_half_a_second_after_no_leader(
    clock: Clock, no_leader: bool, cool_down_s: float
) -> None:
    members = cluster(3)
    members.failed(1, no_leader=no_leader)
    clock.now += cool_down_s - 0.1
    assert members.failed(0) == 2  # 1 still cools down
    members = cluster(3)
    members.failed(2, no_leader=no_leader)
    clock.now += 0.05
    members.failed(1, no_leader=no_leader)
    clock.now += cool_down_s
    assert members.failed(0) == 1  # neither does: the next in order, not 2


def test_a_tie_goes_to_the_next_member_not_back_to_the_one_that_failed(clock: Clock) -> None:
    members = cluster(2)
    members.failed(1)
    assert members.failed(0) == 1  # both cool down until the same instant


def test_a_member_whose_cool_down_ended_counts_as_one_that_never_failed(clock: Clock) -> None:
    members = cluster(3)
    members.failed(2)
    clock.now += 1
    members.failed(1)
    clock.now += 10
    assert members.failed(0) == 1  # the next in order, not the one that failed first


def test_a_shorter_cool_down_never_cuts_a_longer_one_short(clock: Clock) -> None:
    members = cluster(2)
    members.failed(1)
    members.failed(1, no_leader=True)
    clock.now += 0.1
    members.failed(0, no_leader=True)
    clock.now += 0.1
    assert members.failed(0, no_leader=True) == 0  # 1 cools down for 5 s, 0 for 0.5 s


def test_an_answer_ends_the_cool_down(clock: Clock) -> None:
    members = cluster(3)
    members.failed(1)
    members.answered(1)
    assert members.failed(0) == 1 and members.preferred() == 1


def test_the_member_list_adds_new_voters_only_once(clock: Clock) -> None:
    members = cluster(2)
    added = members.learn(
        [
            "http://127.0.0.1:2379",  # known
            "http://127.0.0.1:3000",
            "unix:///var/run/etcd.sock",  # nothing we can dial
            "https://127.0.0.1:3001/",
            "http://127.0.0.1:3000",  # listed twice
        ]
    )
    assert added == ["127.0.0.1:3000", "127.0.0.1:3001"]
    assert members.targets == ["127.0.0.1:2379", "127.0.0.1:2389", *added]
    assert members.learn(["http://127.0.0.1:3000"]) == []
    assert members.failed(1) == 2  # a learned member can be tried, and cools down alike
    members.failed(2)
    assert members.failed(3) == 0


async def test_one_channel_per_endpoint_until_closed(clock: Clock) -> None:
    members = cluster(2)
    first = members.channel()
    assert members.channel(0) is first and members.channel(1) is not first
    members.answered(1)
    assert members.channel() is members.channel(1) and members.channel(0) is first
    await members.close()
    await members.close()  # idempotent
    assert members.closed
    with pytest.raises(ProviderClosed, match=r"^the provider is closed$"):
        members.channel(0)


NOT_HOST_PORT = "is not [http(s)://]host:port"


@pytest.mark.parametrize(
    ("endpoints", "words"),
    [
        ("", "endpoints must name at least one etcd member"),
        ([" , ", ""], "endpoints must name at least one etcd member"),
        (["a:1", 2379], "endpoints must be strings, got int"),
        ("ftp://a:1", "endpoints: 'ftp://a:1': the scheme must be http or https"),
        ("http://", f"endpoints: 'http://' {NOT_HOST_PORT}"),
        # The scheme is what comes before the first "://": the rest is no host:port.
        ("http://a:1://b", f"endpoints: 'http://a:1://b' {NOT_HOST_PORT}"),
        ("a:1/path", f"endpoints: 'a:1/path' {NOT_HOST_PORT}"),
        ("a:1?x=1", f"endpoints: 'a:1?x=1' {NOT_HOST_PORT}"),
        ("a:1#top", f"endpoints: 'a:1#top' {NOT_HOST_PORT}"),
        ("u@a:1", f"endpoints: 'u@a:1' {NOT_HOST_PORT}"),
        ("b:2,a", f"endpoints: 'a' {NOT_HOST_PORT}: it has no valid port"),
        ("a:http", f"endpoints: 'a:http' {NOT_HOST_PORT}: it has no valid port"),
        ("https://a:0", f"endpoints: 'https://a:0' {NOT_HOST_PORT}: it has no valid port"),
    ],
)
def test_a_malformed_endpoint_is_refused_in_words_naming_it(
    endpoints: str | list[str], words: str
) -> None:
    with pytest.raises(LeaseValueError, match=f"^{re.escape(words)}$"):
        parse_endpoints(endpoints, tls=False)


def test_an_endpoint_speaks_tls_by_its_scheme_else_by_the_tls_flag() -> None:
    def secure(text: str, tls: bool) -> list[bool]:
        return [endpoint.secure for endpoint in parse_endpoints(text, tls=tls)]

    assert secure("a:1,http://b:2,https://c:3", tls=False) == [False, False, True]
    assert secure("a:1,http://b:2,https://c:3", tls=True) == [True, False, True]
    assert [e.target for e in parse_endpoints(["https://c:3/", " d:4 "], tls=True)] == [
        "c:3",
        "d:4",
    ]


class MemberLists:
    """The member lists a ``MemberSync`` reads, as etcd's response (the policy under
    test is what it does with them; ``test_failover.py`` follows real replacements)."""

    def __init__(self, *members: pb.Member) -> None:
        self.members = list(members)
        self.reads = 0

    async def __call__(self) -> pb.MemberListResponse:
        self.reads += 1
        return pb.MemberListResponse(members=self.members)


async def test_a_sync_adds_the_voting_members_and_passes_learners_over(clock: Clock) -> None:
    members = cluster(1)
    lists = MemberLists(
        pb.Member(clientURLs=["http://127.0.0.1:2379"]),
        pb.Member(clientURLs=["http://127.0.0.1:3000", "http://127.0.0.2:3000"]),
        pb.Member(clientURLs=["http://127.0.0.1:3001"], isLearner=True),
    )
    sync = MemberSync(members, lists, None)
    assert await sync.sync() == ["127.0.0.1:3000", "127.0.0.2:3000"]
    assert await sync.sync() == []
    assert members.targets == ["127.0.0.1:2379", "127.0.0.1:3000", "127.0.0.2:3000"]


async def test_a_member_failure_reads_the_list_at_most_every_five_seconds(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure within 5 s of the last read is read for at their end, never dropped:
    the call that failed moved on to a member that answers, and may not fail again."""
    monkeypatch.setattr(
        member_sync_module, "time", types.SimpleNamespace(monotonic=clock.monotonic)
    )
    endpoints = parse_endpoints("127.0.0.1:2379,127.0.0.1:2389", tls=False)
    members = Members(endpoints, grpc.ssl_channel_credentials(), lambda: sync.member_failed())
    lists = MemberLists(pb.Member(clientURLs=["http://127.0.0.1:3000"]))
    sync = MemberSync(members, lists, 3600.0)  # never periodically in this test
    members.failed(0)
    await sync.close(1.0)  # waits for the sync the failure started
    assert lists.reads == 1 and members.targets[-1] == "127.0.0.1:3000"
    clock.now += 4.9
    lists.members.append(pb.Member(clientURLs=["http://127.0.0.1:3001"]))
    members.failed(1)
    members.failed(0)
    await asyncio.sleep(0.02)
    assert lists.reads == 1  # not yet: 0.1 s (of the event loop's clock) to go
    await eventually(lambda: lists.reads == 2, "the list read at the end of the 5 s")
    assert members.targets[-1] == "127.0.0.1:3001"
    await asyncio.sleep(0.2)
    assert lists.reads == 2  # one read for both failures
    clock.now += 5
    members.failed(0)  # 5 s after that read: read again at once
    await sync.close(1.0)
    assert lists.reads == 3
    clock.now += 4.9
    members.failed(1)  # a read due in 0.1 s...
    await sync.close(1.0)  # ...is not made once the client closed
    await asyncio.sleep(0.3)
    assert lists.reads == 3
    await members.close()
    members.failed(0)  # closed: nothing more is read
    clock.now += 10
    members.failed(1)
    await sync.close(1.0)
    assert lists.reads == 3


async def test_a_member_list_read_that_fails_is_quiet_and_made_again_later(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd unreachable for the read a member failure asked for: nothing is raised or
    logged as a failure (the background check of this suite would fail the test), and
    the next failure 5 s later reads again."""
    monkeypatch.setattr(
        member_sync_module, "time", types.SimpleNamespace(monotonic=clock.monotonic)
    )
    reads = 0

    async def unreachable() -> pb.MemberListResponse:
        nonlocal reads
        reads += 1
        raise BackendUnavailable("etcd: no member answered (test)")

    members = cluster(2)
    sync = MemberSync(members, unreachable, 3600.0)
    sync.member_failed()
    await sync.close(1.0)
    clock.now += 5
    sync.member_failed()
    await sync.close(1.0)
    assert reads == 2
    await members.close()


async def test_closing_does_not_wait_past_its_timeout_for_a_read_that_hangs() -> None:
    """A member-list read etcd never answers (a frozen member): closing waits for it
    only its timeout, then ends it."""
    hanging = asyncio.Event()

    async def never_answered() -> pb.MemberListResponse:
        await hanging.wait()
        raise AssertionError("unreachable")

    members = cluster(2)
    sync = MemberSync(members, never_answered, 3600.0)
    sync.member_failed()
    await asyncio.sleep(0)
    async with asyncio.timeout(5):  # bounds a close that waits for ever
        await sync.close(0.1)
    await members.close()


async def test_the_periodic_sync_runs_once_per_client_until_the_members_close() -> None:
    lists = MemberLists(pb.Member(clientURLs=["http://127.0.0.1:3000"]))
    members = cluster(1)
    sync = MemberSync(members, lists, 0.01)
    sync.start()
    sync.start()  # idempotent: still one task
    await asyncio.sleep(0.1)
    running = [t for t in asyncio.all_tasks() if t.get_name() == "etcd-leases member sync"]
    assert len(running) == 1 and lists.reads >= 2
    assert members.targets == ["127.0.0.1:2379", "127.0.0.1:3000"]
    await members.close()  # the client closing: the loop ends of itself
    await asyncio.wait(running, timeout=1.0)
    assert running[0].done() and not running[0].cancelled()
    await sync.close(1.0)


async def test_no_interval_means_no_sync_at_all(clock: Clock) -> None:
    lists = MemberLists(pb.Member(clientURLs=["http://127.0.0.1:3000"]))
    members = cluster(1)
    sync = MemberSync(members, lists, None)
    sync.start()
    sync.member_failed()
    await asyncio.sleep(0.05)
    await sync.close(1.0)
    assert lists.reads == 0
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "etcd-leases member sync"]
