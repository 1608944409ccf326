"""How requests reach etcd: the calls etcd-leases makes, with failover and retries.

A small asyncio client over ``grpc.aio``. The members and their channels live in
:mod:`~etcd_leases.etcd.members` (followed by :mod:`~etcd_leases.etcd.member_sync`),
tokens in :mod:`~etcd_leases.etcd.auth`, and what an error means in
:mod:`~etcd_leases.etcd.rpc_errors`; this module makes the calls,
moving on to another member on a member failure, and turns every gRPC error into a
:class:`LeaseError`.

Only idempotent calls are retried here: ranges, grants with a client-chosen lease
ID, revokes and keep-alives. A transaction whose outcome is unknown surfaces as
:class:`BackendUnavailable`; the provider settles it by re-reading the key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from etcd_leases.errors import (
    BackendError,
    BackendUnavailable,
    LeaseError,
    LeaseValueError,
    PermissionDenied,
    ProviderClosed,
)
from etcd_leases.etcd.auth import Auth, Metadata
from etcd_leases.etcd.backoff import Backoff
from etcd_leases.etcd.member_sync import MemberSync
from etcd_leases.etcd.members import Members, parse_endpoints, ssl_credentials
from etcd_leases.etcd.rpc_errors import (
    details,
    is_invalid_token,
    is_member_failure,
    is_never_sent,
    is_no_leader,
    to_lease_error,
)
from etcd_leases.etcd.txn import prefix_end
from etcd_leases.etcd.version import warn_if_affected
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

RequestT = TypeVar("RequestT", bound=Message)
ResponseT = TypeVar("ResponseT", bound=Message)
T = TypeVar("T")

# etcd's error strings that decide what happens next (etcdserver/api/v3rpc/rpctypes).
_LEASE_EXISTS = "lease already exists"
_LEASE_NOT_FOUND = "requested lease not found"
# How long the server's version may take to come on connect.
_STATUS_TIMEOUT_S = 1.0
# Between a call's attempts after a member failure: the first wait, doubling up to the
# last (quicker than the streams' reconnect pace: a caller is waiting).
_BACKOFF_FIRST_S = 0.02
_BACKOFF_MAX_S = 0.5

_log = logging.getLogger(__name__)


def _time_left(deadline: float) -> float:
    return max(0.05, deadline - time.monotonic())


class EtcdClient:
    """The etcd calls we use, over the channels of :attr:`members`, with :attr:`auth`.

    Each call starts on the preferred member and moves on from the endpoint *it*
    tried (see :class:`Members`) until it is answered or its timeout has passed.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: float,
        username: str | None = None,
        password: str | None = None,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        member_sync_interval: float | None = 60.0,
    ) -> None:
        if not timeout > 0:
            raise LeaseValueError(f"timeout must be a positive number of seconds, got {timeout}")
        if (cert is None) != (key is None):
            raise LeaseValueError("cert and key must be given together")
        if (username is None) != (password is None):
            raise LeaseValueError("username and password must be given together")
        if username == "":
            raise LeaseValueError("username must not be empty")
        if member_sync_interval is not None and not member_sync_interval > 0:
            raise LeaseValueError(
                f"member_sync_interval must be a positive number of seconds or None, "
                f"got {member_sync_interval}"
            )
        tls = ca_cert is not None or cert is not None
        self.timeout = timeout
        #: The members: endpoints, channels, which to try first.
        self.members = Members(
            parse_endpoints(endpoints, tls=tls),
            ssl_credentials(ca_cert, cert, key),
            on_failure=lambda: self.member_sync.member_failed(),
        )
        #: Following the member list (see :mod:`~etcd_leases.etcd.member_sync`).
        self.member_sync = MemberSync(self.members, self._list_members, member_sync_interval)
        #: The auth tokens, per member.
        self.auth = Auth(self.members, username, password, timeout)
        self._callables: dict[tuple[int, str], grpc.aio.UnaryUnaryMultiCallable[Any, Any]] = {}
        #: The version of the first member that told us, once one has.
        self.server_version: str | None = None
        #: Called with each keep-alive's round trip in seconds, from request sent to
        #: answer read (the metrics' latency histogram listens here).
        self.keepalive_observers: list[Callable[[float], None]] = []
        #: The highest store revision an answer has shown (0 before the first): a write
        #: sent after reading it lands after it.
        self.revision_seen = 0

    @property
    def endpoints(self) -> list[str]:
        return self.members.targets

    @property
    def closed(self) -> bool:
        return self.members.closed

    def check_open(self) -> None:
        if self.members.closed:
            raise ProviderClosed("the provider is closed")

    def error(self, exc: BaseException) -> LeaseError:
        """The error to raise for ``exc``."""
        if self.closed:
            return ProviderClosed("the provider is closed")
        if isinstance(exc, LeaseError):
            return exc
        assert isinstance(exc, grpc.aio.AioRpcError)
        return to_lease_error(exc)

    def _attempt_failed(self, index: int, exc: BaseException) -> int:
        """The endpoint to try after ``exc`` on ``index`` (``index`` unless a member failure)."""
        if not is_member_failure(exc):
            return index
        text = details(exc) if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        return self.members.failed(index, no_leader=is_no_leader(text))

    def closed_under(self, exc: asyncio.CancelledError) -> LeaseError | None:
        """ProviderClosed when ``exc`` is gRPC cancelling a call because we closed.

        Closing a channel cancels its calls; the caller's task was not cancelled.
        """
        task = asyncio.current_task()
        if self.closed and (task is None or not task.cancelling()):
            return ProviderClosed("the provider was closed during the call")
        return None

    async def _attempt(
        self,
        index: int,
        path: str,
        request: Message,
        response_type: type[ResponseT],
        deadline_s: float,
    ) -> ResponseT:
        """One attempt on endpoint ``index``; it becomes the preferred one if it answers."""
        self.check_open()  # a retry may come after the close
        call = self._callables.get((index, path))
        if call is None:  # made once per member and method: making one costs each call
            call = self._callables[(index, path)] = self.members.channel(index).unary_unary(
                path,
                request_serializer=type(request).SerializeToString,
                response_deserializer=response_type.FromString,
            )
        try:
            for _ in range(2):
                try:
                    metadata = await self.auth.metadata(index, login_timeout=deadline_s)
                    response: ResponseT = await call(request, timeout=deadline_s, metadata=metadata)
                    self.members.answered(index)
                    header = getattr(response, "header", None)
                    if header is not None and header.revision > self.revision_seen:
                        self.revision_seen = header.revision
                    return response
                except grpc.aio.AioRpcError as exc:
                    # etcd's simple tokens expire: log in again and replay, once.
                    if not self.auth.enabled or not is_invalid_token(exc):
                        raise
                    self.auth.invalidate(index)
        except asyncio.CancelledError as exc:
            if closed := self.closed_under(exc):
                raise closed from None
            raise
        raise PermissionDenied("etcd: the auth token was refused right after logging in")

    async def _retried(
        self,
        attempt: Callable[[int], Awaitable[T]],
        deadline: float,
        again: Callable[[BaseException], bool] = is_member_failure,
    ) -> T:
        """``attempt(index)`` on the preferred member; after each failure ``again`` allows
        (a member failure by default) again, on the member the failure points to,
        backing off, until ``deadline`` has passed.

        The last attempt's error as a :class:`LeaseError`; any other error at once.
        (A loop of our own rather than a retry library: importing one costs a
        one-shot process milliseconds, and wrapping each call costs every call.)
        """
        index = self.members.preferred()
        backoff = Backoff(_BACKOFF_FIRST_S, _BACKOFF_MAX_S)
        while True:
            try:
                return await attempt(index)
            except (grpc.aio.AioRpcError, LeaseError) as exc:
                index = self._attempt_failed(index, exc)
                if not again(exc) or time.monotonic() >= deadline:
                    raise self.error(exc) from exc
            await asyncio.sleep(backoff.failed())

    def _attempt_timeout(self, deadline: float) -> float:
        remaining = deadline - time.monotonic()
        # With several members, leave time to try another if this one hangs.
        count = len(self.members)
        share = self.timeout / count if count > 1 else self.timeout
        return max(0.05, min(remaining, max(share, 0.5)))

    async def call(
        self,
        path: str,
        request: Message,
        response_type: type[ResponseT],
        *,
        retry: bool = True,
    ) -> ResponseT:
        """One unary call; retried on other members until ``timeout`` when ``retry``.

        Without ``retry`` the request is sent once: only a call gRPC failed before
        sending it goes to another member.
        """
        self.check_open()
        self.member_sync.start()
        if self.server_version is None:
            await self._read_server_version()
        deadline = time.monotonic() + self.timeout
        # Sent once, each attempt gets the whole time left: one that times out is not
        # tried again.
        attempt_timeout = self._attempt_timeout if retry else _time_left
        return await self._retried(
            lambda index: self._attempt(
                index, path, request, response_type, attempt_timeout(deadline)
            ),
            deadline,
            again=is_member_failure if retry else is_never_sent,
        )

    async def _read_server_version(self) -> None:
        """Learn the server's version on connect, to warn of its known bugs.

        Tried before each call until a member answers, briefly: the call itself
        reports an unreachable cluster.
        """
        index = self.members.preferred()
        self.server_version = ""  # unknown; no second attempt while this one runs
        try:
            response = await self._attempt(
                index,
                "/etcdserverpb.Maintenance/Status",
                pb.StatusRequest(),
                pb.StatusResponse,
                min(self.timeout, _STATUS_TIMEOUT_S),
            )
        except BaseException as exc:
            if is_member_failure(exc) or isinstance(exc, asyncio.CancelledError):
                self.server_version = None  # ask again, of a member that answers
            if isinstance(exc, grpc.aio.AioRpcError | LeaseError):
                return  # refused (say, by permissions): the version stays unknown
            raise
        self.server_version = response.version
        warn_if_affected(response.version, self.members.targets[index])

    # The etcd calls, one method each.

    async def _list_members(self) -> pb.MemberListResponse:
        return await self.call(
            "/etcdserverpb.Cluster/MemberList", pb.MemberListRequest(), pb.MemberListResponse
        )

    async def range(self, key: bytes) -> pb.KeyValue | None:
        """A linearizable read of one key."""
        return (await self.range_at(key))[0]

    async def range_at(self, key: bytes) -> tuple[pb.KeyValue | None, int]:
        """A linearizable read of one key, and the store's revision when it was read."""
        response = await self.call(
            "/etcdserverpb.KV/Range", pb.RangeRequest(key=key), pb.RangeResponse
        )
        return (response.kvs[0] if response.kvs else None), response.header.revision

    async def raft_term(self, key: bytes) -> int:
        """The raft term a linearizable read of ``key`` was answered in: confirmed by a
        quorum, so no leader of a later term had been elected before it."""
        request = pb.RangeRequest(key=key, count_only=True)
        response = await self.call("/etcdserverpb.KV/Range", request, pb.RangeResponse)
        return response.header.raft_term

    async def range_prefix(self, prefix: bytes) -> list[pb.KeyValue]:
        """A linearizable read of every key under ``prefix``."""
        request = pb.RangeRequest(key=prefix, range_end=prefix_end(prefix))
        response = await self.call("/etcdserverpb.KV/Range", request, pb.RangeResponse)
        return list(response.kvs)

    async def txn(self, request: pb.TxnRequest) -> pb.TxnResponse:
        """One transaction, sent once: its outcome is unknown on BackendUnavailable (one
        that never left goes to another member)."""
        return await self.call("/etcdserverpb.KV/Txn", request, pb.TxnResponse, retry=False)

    async def grant(self, ttl_s: int, lease_id: int) -> int:
        """Grant lease ``lease_id`` (see :func:`new_lease_id`); its TTL as granted.

        Choosing the ID ourselves means a grant whose answer was lost can be retried,
        and a caller interrupted mid-grant knows which lease to revoke.
        """
        request = pb.LeaseGrantRequest(TTL=ttl_s, ID=lease_id)
        try:
            response = await self.call(
                "/etcdserverpb.Lease/LeaseGrant", request, pb.LeaseGrantResponse
            )
        except BackendError as exc:
            # A retry after a lost answer finds the lease our first attempt made.
            if _LEASE_EXISTS not in str(exc):
                raise
            return (await self.time_to_live(lease_id)).grantedTTL
        return response.TTL

    @staticmethod
    def is_lease_not_found(exc: BackendError) -> bool:
        """Whether etcd refused a call because the lease it names does not exist."""
        return _LEASE_NOT_FOUND in str(exc)

    async def revoke(self, lease_id: int) -> bool:
        """Revoke a lease and delete its keys; ``False`` if it was already gone."""
        try:
            await self.call(
                "/etcdserverpb.Lease/LeaseRevoke",
                pb.LeaseRevokeRequest(ID=lease_id),
                pb.LeaseRevokeResponse,
            )
        except BackendError as exc:
            if self.is_lease_not_found(exc):
                return False
            raise
        return True

    async def revoke_quietly(self, lease_id: int) -> None:
        """Revoke, best effort: an unreachable or closed cluster lets it expire instead,
        and so does one that refuses (credentials revoked, say), with a warning."""
        try:
            await self.revoke(lease_id)
        except (BackendUnavailable, ProviderClosed):
            pass
        except LeaseError as exc:
            _log.warning("lease %x not revoked (it expires with its TTL): %s", lease_id, exc)

    async def time_to_live(
        self, lease_id: int, *, keys: bool = False
    ) -> pb.LeaseTimeToLiveResponse:
        """A lease's remaining and granted TTL (``TTL == -1`` when it does not exist),
        and with ``keys`` the keys on it."""
        return await self.call(
            "/etcdserverpb.Lease/LeaseTimeToLive",
            pb.LeaseTimeToLiveRequest(ID=lease_id, keys=keys),
            pb.LeaseTimeToLiveResponse,
        )

    async def leases(self) -> list[int]:
        """Every lease the cluster holds."""
        response = await self.call(
            "/etcdserverpb.Lease/LeaseLeases", pb.LeaseLeasesRequest(), pb.LeaseLeasesResponse
        )
        return [lease.ID for lease in response.leases]

    def _open_stream(
        self,
        path: str,
        request_type: type[RequestT],
        response_type: type[ResponseT],
        metadata: Metadata,
        index: int | None,
    ) -> grpc.aio.StreamStreamCall[RequestT, ResponseT]:
        method = self.members.channel(index).stream_stream(
            path,
            request_serializer=request_type.SerializeToString,
            response_deserializer=response_type.FromString,
        )
        return method(None, metadata=metadata)

    def keep_alive_stream(
        self, metadata: Metadata, index: int | None = None
    ) -> grpc.aio.StreamStreamCall[pb.LeaseKeepAliveRequest, pb.LeaseKeepAliveResponse]:
        """A bidirectional ``LeaseKeepAlive`` stream to endpoint ``index`` (the preferred)."""
        return self._open_stream(
            "/etcdserverpb.Lease/LeaseKeepAlive",
            pb.LeaseKeepAliveRequest,
            pb.LeaseKeepAliveResponse,
            metadata,
            index,
        )

    def watch_stream(
        self, metadata: Metadata, index: int | None = None
    ) -> grpc.aio.StreamStreamCall[pb.WatchRequest, pb.WatchResponse]:
        """A bidirectional ``Watch`` stream to endpoint ``index`` (the preferred)."""
        return self._open_stream(
            "/etcdserverpb.Watch/Watch", pb.WatchRequest, pb.WatchResponse, metadata, index
        )

    async def close(self) -> None:
        """Close every channel; idempotent."""
        await self.members.close()
        await self.member_sync.close(self.timeout)
