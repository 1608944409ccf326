"""What etcd's gRPC errors mean: which to retry elsewhere, and what callers see.

Every gRPC error becomes a :class:`LeaseError`; the decision to move on to another
member rests on etcd's own error strings (etcdserver/api/v3rpc/rpctypes).
"""

from __future__ import annotations

import grpc
import grpc.aio

from etcd_leases.errors import (
    BackendError,
    BackendFull,
    BackendUnavailable,
    LeaseError,
    PermissionDenied,
)

__all__ = [
    "details",
    "is_invalid_token",
    "is_member_failure",
    "is_never_sent",
    "is_no_leader",
    "to_lease_error",
]

# "raft proposal dropped": the leader was handing over (MoveLeader, a graceful stop) and
# dropped the write unapplied. "context deadline exceeded" (code UNKNOWN): the member's
# own wait for the write ran out, as "request timed out" says; it may still land.
_NO_LEADER = (
    "no leader",
    "leader changed",
    "not capable",
    "request timed out",
    "raft proposal dropped",
    "context deadline exceeded",
)
# gRPC's own errors for a call whose stream broke (a member killed mid-call, a proxy
# resetting the stream): INTERNAL "Received RST_STREAM", UNKNOWN "Stream removed". The
# call may have been applied: never a refusal. etcd's own errors start with its name.
_BROKEN_CALL = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
_ETCD_ERROR = "etcdserver: "
_INVALID_TOKEN = "invalid auth token"
# gRPC fails a call it had no connection for (every connection attempt to the member
# failed) before sending a byte of it.
_NO_CONNECTION = "failed to connect to all addresses"
_AUTH_FAILED = ("authentication failed", "user name is empty", "permission denied")
_NO_SPACE = "database space exceeded"


def _code(exc: grpc.aio.AioRpcError) -> grpc.StatusCode:
    code: grpc.StatusCode = exc.code()
    return code


def details(exc: grpc.aio.AioRpcError) -> str:
    """The error's text ("" when it has none)."""
    return exc.details() or ""


def is_no_leader(text: str) -> bool:
    """True for etcd's errors of a member that has no leader (yet)."""
    return any(reason in text for reason in _NO_LEADER)


def is_invalid_token(exc: grpc.aio.AioRpcError) -> bool:
    """True when etcd refused an expired simple auth token: log in again."""
    return _INVALID_TOKEN in details(exc)


def is_member_failure(exc: BaseException) -> bool:
    """True when another member, or the same one a moment later, may answer."""
    if isinstance(exc, BackendUnavailable):
        return True
    if not isinstance(exc, grpc.aio.AioRpcError):
        return False
    code = _code(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return True
    if code in _BROKEN_CALL and not details(exc).startswith(_ETCD_ERROR):
        return True
    return is_no_leader(details(exc))


def is_never_sent(exc: BaseException | None) -> bool:
    """True when gRPC failed the call before sending it: etcd never saw it."""
    return (
        isinstance(exc, grpc.aio.AioRpcError)
        and _code(exc) == grpc.StatusCode.UNAVAILABLE
        and details(exc).startswith(_NO_CONNECTION)
    )


def to_lease_error(exc: grpc.aio.AioRpcError) -> LeaseError:
    """The :class:`LeaseError` a caller sees for a gRPC error."""
    text = details(exc)
    code = _code(exc)
    message = f"etcd: {code.name}: {text}"
    if is_member_failure(exc):
        return BackendUnavailable(message)
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED) or any(
        reason in text for reason in _AUTH_FAILED
    ):
        return PermissionDenied(message)
    if _NO_SPACE in text:
        return BackendFull(
            "etcd's database is full (its NOSPACE alarm is raised): it refuses writes until "
            "an operator compacts, defragments and runs 'etcdctl alarm disarm'; " + message
        )
    return BackendError(message)
