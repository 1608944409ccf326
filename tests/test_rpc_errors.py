"""What callers see for etcd's error strings that the chaos suite met (issue 14)."""

from __future__ import annotations

import grpc
import grpc.aio

from etcd_leases import BackendFull, BackendUnavailable
from etcd_leases.etcd.rpc_errors import is_member_failure, is_never_sent, to_lease_error
from tests.conftest import BROKEN_STREAM_ERRORS, etcd_error


def test_a_full_database_says_so_and_what_to_do() -> None:
    error = to_lease_error(
        etcd_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded")
    )
    assert isinstance(error, BackendFull)
    assert "database is full" in str(error) and "alarm disarm" in str(error)


def test_a_write_dropped_while_the_leader_hands_over_is_tried_again() -> None:
    # Seen during MoveLeader: the write was never applied, so another try is safe.
    dropped = etcd_error(grpc.StatusCode.UNKNOWN, "raft proposal dropped")
    assert is_member_failure(dropped)
    assert isinstance(to_lease_error(dropped), BackendUnavailable)


def test_a_write_the_member_stopped_waiting_for_is_an_answer_lost() -> None:
    # Seen during a partition of the leader: it may still land, as after a lost answer.
    timed_out = etcd_error(grpc.StatusCode.UNKNOWN, "context deadline exceeded")
    assert is_member_failure(timed_out)
    assert isinstance(to_lease_error(timed_out), BackendUnavailable)


def test_a_call_whose_stream_broke_is_a_member_failure_and_an_etcd_error_is_not() -> None:
    # gRPC's own errors for a broken stream: the call may have been applied.
    for code, text in BROKEN_STREAM_ERRORS:
        broken = etcd_error(code, text)
        assert is_member_failure(broken)
        assert isinstance(to_lease_error(broken), BackendUnavailable)
    refused = etcd_error(grpc.StatusCode.UNKNOWN, "etcdserver: some refusal")
    assert not is_member_failure(refused)
    assert not isinstance(to_lease_error(refused), BackendUnavailable)


def test_only_a_call_grpc_had_no_connection_for_is_known_never_sent() -> None:
    # The rest may have reached etcd: a stream removed mid-call, a deadline, a refusal.
    never_sent = etcd_error(
        grpc.StatusCode.UNAVAILABLE,
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2379: "
        "Failed to connect to remote host: Connection refused",
    )
    assert is_never_sent(never_sent) and is_member_failure(never_sent)
    maybe_sent = [
        etcd_error(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)"),
        etcd_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
        etcd_error(grpc.StatusCode.UNKNOWN, "context deadline exceeded"),
        *(etcd_error(code, text) for code, text in BROKEN_STREAM_ERRORS),
    ]
    assert not any(is_never_sent(error) for error in maybe_sent)
    assert not is_never_sent(BackendUnavailable("etcd: UNAVAILABLE: failed to connect"))
