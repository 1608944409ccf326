"""How requests reach etcd and how its errors come back.

A small asyncio client over ``grpc.aio`` for the calls etcd-leases needs. It owns
the channels (one per endpoint, TLS when asked), username/password auth, endpoint
failover and retries, and turns every gRPC error into a :class:`LeaseError`.

Only idempotent calls are retried here: ranges, grants with a client-chosen lease
ID, revokes and keep-alives. A transaction whose outcome is unknown surfaces as
:class:`BackendUnavailable`; the provider settles it by re-reading the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from etcd_leases.errors import (
    BackendError,
    BackendUnavailable,
    LeaseError,
    LeaseValueError,
    PermissionDenied,
    ProviderClosed,
)
from etcd_leases.etcd.version import warn_if_affected
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

RequestT = TypeVar("RequestT", bound=Message)
ResponseT = TypeVar("ResponseT", bound=Message)

# etcd's error strings that decide what happens next (etcdserver/api/v3rpc/rpctypes).
_NO_LEADER = ("no leader", "leader changed", "not capable", "request timed out")
_INVALID_TOKEN = "invalid auth token"
_LEASE_EXISTS = "lease already exists"
_LEASE_NOT_FOUND = "requested lease not found"
_AUTH_FAILED = ("authentication failed", "user name is empty", "permission denied")

# A member that failed us (down, frozen, timed out) is passed over for this long while
# another may answer: a frozen member must cost concurrent callers no more than it
# costs one. One that answered "no leader" will have one after an election: sooner.
_COOL_DOWN_S = 5.0
_NO_LEADER_COOL_DOWN_S = 0.5
# How long the server's version may take to come on connect.
_STATUS_TIMEOUT_S = 1.0

_CHANNEL_OPTIONS = [
    # A restarted member must be reachable again within a second, not after
    # gRPC's default backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Detect a frozen member under a long-lived stream...
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # ...and really do: by default gRPC stops pinging after two pings without data
    # and waits 60 s for an unanswered ping (a frozen member went unnoticed 60-120 s).
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.ping_timeout_ms", 5_000),
    # etcd does not cap what it sends: a watch replaying history can exceed gRPC's
    # 4 MiB default, which would break the shared stream again on every retry.
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.enable_retries", 0),
]


@dataclass(frozen=True)
class Endpoint:
    target: str
    secure: bool


def parse_endpoints(endpoints: str | Sequence[str], *, tls: bool) -> list[Endpoint]:
    """``"h:p"``, ``"http(s)://h:p"``, comma-separated lists of them, or a sequence."""
    items = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    parsed: list[Endpoint] = []
    for item in items:
        if not isinstance(item, str):
            raise LeaseValueError(f"endpoints must be strings, got {type(item).__name__}")
        parsed.extend(_endpoint(text, tls=tls) for raw in item.split(",") if (text := raw.strip()))
    if not parsed:
        raise LeaseValueError("endpoints must name at least one etcd member")
    return parsed


def _endpoint(text: str, *, tls: bool) -> Endpoint:
    """One ``[http(s)://]host:port``; refused at once when malformed, since gRPC
    would only fail when first called (and, with no port, try one of its own)."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = ("https" if tls else "http"), text
    elif scheme not in ("http", "https"):
        raise LeaseValueError(f"endpoints: {text!r}: the scheme must be http or https")
    target = rest.rstrip("/")
    parts = urllib.parse.urlsplit("//" + target)
    try:
        port = parts.port
    except ValueError:
        port = None
    malformed = f"endpoints: {text!r} is not [http(s)://]host:port"
    if not parts.hostname or parts.path or parts.query or parts.fragment or "@" in target:
        raise LeaseValueError(malformed)
    if not port:
        raise LeaseValueError(f"{malformed}: it has no valid port")
    return Endpoint(target, secure=scheme == "https")


def _code(exc: grpc.aio.AioRpcError) -> grpc.StatusCode:
    code: grpc.StatusCode = exc.code()
    return code


def _details(exc: grpc.aio.AioRpcError) -> str:
    return exc.details() or ""


def is_no_leader(text: str) -> bool:
    """True for etcd's errors of a member that has no leader (yet)."""
    return any(reason in text for reason in _NO_LEADER)


def is_member_failure(exc: BaseException) -> bool:
    """True when another member, or the same one a moment later, may answer."""
    if isinstance(exc, BackendUnavailable):
        return True
    if not isinstance(exc, grpc.aio.AioRpcError):
        return False
    code = _code(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return True
    return is_no_leader(_details(exc))


def to_lease_error(exc: grpc.aio.AioRpcError) -> LeaseError:
    """The :class:`LeaseError` a caller sees for a gRPC error."""
    details = _details(exc)
    code = _code(exc)
    message = f"etcd: {code.name}: {details}"
    if is_member_failure(exc):
        return BackendUnavailable(message)
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED) or any(
        reason in details for reason in _AUTH_FAILED
    ):
        return PermissionDenied(message)
    return BackendError(message)


# Lease IDs are random 62-bit ints whose top 16 bits mark session leases (shared by
# many keys), so that any process can tell them from the lease of a single tenure.
_MARK_SHIFT = 46
_SESSION_MARK = 0x5E55


def new_lease_id(*, session: bool = False) -> int:
    """A random positive int64; lets a grant whose answer was lost be retried safely."""
    mark = _SESSION_MARK
    while not session and mark == _SESSION_MARK:
        mark = secrets.randbits(62 - _MARK_SHIFT)
    return (mark << _MARK_SHIFT) | (secrets.randbits(_MARK_SHIFT - 1) + 1)


def is_session_lease(lease_id: int) -> bool:
    """Whether ``lease_id`` is a session lease (see :mod:`etcd_leases.etcd.session`)."""
    return lease_id >> _MARK_SHIFT == _SESSION_MARK


class EtcdClient:
    """Channels, auth, failover and retries for the etcd calls we use.

    Endpoints are tried from the *preferred* one (the last that answered). A member
    that fails a call cools down: calls and streams pass it over while another may
    answer. Each call moves on from the endpoint *it* tried, so concurrent failures
    on one frozen member never rotate the others back onto it.
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
    ) -> None:
        if not timeout > 0:
            raise LeaseValueError(f"timeout must be a positive number of seconds, got {timeout}")
        if (cert is None) != (key is None):
            raise LeaseValueError("cert and key must be given together")
        if (username is None) != (password is None):
            raise LeaseValueError("username and password must be given together")
        if username == "":
            raise LeaseValueError("username must not be empty")
        tls = ca_cert is not None or cert is not None
        self._endpoints = parse_endpoints(endpoints, tls=tls)
        self.timeout = timeout
        self._username = username
        self._password = password
        self._credentials = self._ssl_credentials(ca_cert, cert, key)
        self._channels: dict[Endpoint, grpc.aio.Channel] = {}
        self._preferred = 0
        # time.monotonic() until which each endpoint is passed over if others may answer.
        self._cool_until = [0.0] * len(self._endpoints)
        # Simple auth tokens are only valid on the member that issued them.
        self._tokens: dict[int, str] = {}
        self._closed = False
        #: The version of the first member that told us, once one has.
        self.server_version: str | None = None

    @staticmethod
    def _ssl_credentials(
        ca_cert: str | None, cert: str | None, key: str | None
    ) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return grpc.ssl_channel_credentials(
            root_certificates=read(ca_cert), private_key=read(key), certificate_chain=read(cert)
        )

    @property
    def endpoints(self) -> list[str]:
        return [endpoint.target for endpoint in self._endpoints]

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise ProviderClosed("the provider is closed")

    def preferred(self) -> int:
        """The endpoint to start from: the last that answered, unless it failed since."""
        return self._preferred

    def failed(self, index: int, *, no_leader: bool = False) -> int:
        """Endpoint ``index`` failed us: cool it down; the endpoint to try next.

        The next is the first after it that is not cooling down, else the one whose
        cool-down ends first (with every member failing, the least recent failure).
        """
        now = time.monotonic()
        cool_down = _NO_LEADER_COOL_DOWN_S if no_leader else _COOL_DOWN_S
        self._cool_until[index] = max(self._cool_until[index], now + cool_down)
        count = len(self._endpoints)
        following = min(
            ((index + step) % count for step in range(1, count + 1)),
            key=lambda i: max(self._cool_until[i], now),
        )
        if self._preferred == index:
            self._preferred = following
        return following

    def answered(self, index: int) -> None:
        """Endpoint ``index`` answered: prefer it."""
        self._cool_until[index] = 0.0
        self._preferred = index

    def channel(self, index: int | None = None) -> grpc.aio.Channel:
        """The channel to endpoint ``index`` (the preferred one), created on first use."""
        self.check_open()
        endpoint = self._endpoints[self._preferred if index is None else index]
        channel = self._channels.get(endpoint)
        if channel is None:
            if endpoint.secure:
                channel = grpc.aio.secure_channel(
                    endpoint.target, self._credentials, options=_CHANNEL_OPTIONS
                )
            else:
                channel = grpc.aio.insecure_channel(endpoint.target, options=_CHANNEL_OPTIONS)
            self._channels[endpoint] = channel
        return channel

    def invalidate_token(self, index: int | None = None) -> None:
        """Forget the auth token endpoint ``index`` refused; ``metadata()`` logs in again.

        For streams, which cannot replay a call the way ``call`` does.
        """
        self._tokens.pop(self._preferred if index is None else index, None)

    async def metadata(self, index: int | None = None) -> tuple[tuple[str, str], ...]:
        """Request metadata for endpoint ``index``: fail fast without a leader; the token."""
        index = self._preferred if index is None else index
        if self._username is not None and index not in self._tokens:
            await self._authenticate(index)
        pairs = [("hasleader", "true")]
        if index in self._tokens:
            pairs.append(("token", self._tokens[index]))
        return tuple(pairs)

    async def _authenticate(self, index: int) -> None:
        assert self._username is not None and self._password is not None
        request = pb.AuthenticateRequest(name=self._username, password=self._password)
        call = self.channel(index).unary_unary(
            "/etcdserverpb.Auth/Authenticate",
            request_serializer=pb.AuthenticateRequest.SerializeToString,
            response_deserializer=pb.AuthenticateResponse.FromString,
        )
        response: pb.AuthenticateResponse = await call(request, timeout=self.timeout)
        self._tokens[index] = response.token

    def error(self, exc: BaseException) -> LeaseError:
        """The error to raise for ``exc``."""
        if self._closed:
            return ProviderClosed("the provider is closed")
        if isinstance(exc, LeaseError):
            return exc
        assert isinstance(exc, grpc.aio.AioRpcError)
        return to_lease_error(exc)

    def _attempt_failed(self, index: int, exc: BaseException) -> int:
        """The endpoint to try after ``exc`` on ``index`` (``index`` unless a member failure)."""
        if not is_member_failure(exc):
            return index
        text = _details(exc) if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        return self.failed(index, no_leader=is_no_leader(text))

    def closed_under(self, exc: asyncio.CancelledError) -> LeaseError | None:
        """ProviderClosed when ``exc`` is gRPC cancelling a call because we closed.

        Closing a channel cancels its calls; the caller's task was not cancelled.
        """
        task = asyncio.current_task()
        if self._closed and (task is None or not task.cancelling()):
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
        call = self.channel(index).unary_unary(
            path,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        try:
            for _ in range(2):
                try:
                    response: ResponseT = await call(
                        request, timeout=deadline_s, metadata=await self.metadata(index)
                    )
                    self.answered(index)
                    return response
                except grpc.aio.AioRpcError as exc:
                    # etcd's simple tokens expire: log in again and replay, once.
                    if self._username is None or _INVALID_TOKEN not in _details(exc):
                        raise
                    self.invalidate_token(index)
        except asyncio.CancelledError as exc:
            if closed := self.closed_under(exc):
                raise closed from None
            raise
        raise PermissionDenied("etcd: the auth token was refused right after logging in")

    def _retrying(self) -> AsyncRetrying:
        """Attempts on member failures, backing off, until ``timeout`` has passed."""
        return AsyncRetrying(
            stop=stop_after_delay(self.timeout),
            wait=wait_exponential(multiplier=0.02, max=0.5),
            retry=retry_if_exception(is_member_failure),
            reraise=True,
        )

    def _attempt_timeout(self, deadline: float) -> float:
        remaining = deadline - time.monotonic()
        # With several members, leave time to try another if this one hangs.
        share = self.timeout / len(self._endpoints) if len(self._endpoints) > 1 else self.timeout
        return max(0.05, min(remaining, max(share, 0.5)))

    async def call(
        self,
        path: str,
        request: Message,
        response_type: type[ResponseT],
        *,
        retry: bool = True,
    ) -> ResponseT:
        """One unary call; retried on other members until ``timeout`` when ``retry``."""
        self.check_open()
        if self.server_version is None:
            await self._read_server_version()
        deadline = time.monotonic() + self.timeout
        index = self._preferred
        if not retry:
            try:
                return await self._attempt(index, path, request, response_type, self.timeout)
            except (grpc.aio.AioRpcError, LeaseError) as exc:
                self._attempt_failed(index, exc)
                raise self.error(exc) from exc
        try:
            async for attempt in self._retrying():
                with attempt:
                    try:
                        return await self._attempt(
                            index, path, request, response_type, self._attempt_timeout(deadline)
                        )
                    except (grpc.aio.AioRpcError, LeaseError) as exc:
                        index = self._attempt_failed(index, exc)
                        raise
        except (grpc.aio.AioRpcError, LeaseError) as exc:
            raise self.error(exc) from exc
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def _read_server_version(self) -> None:
        """Learn the server's version on connect, to warn of its known bugs.

        Tried before each call until a member answers, briefly: the call itself
        reports an unreachable cluster.
        """
        index = self._preferred
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
        warn_if_affected(response.version, self._endpoints[index].target)

    # The etcd calls, one method each.

    async def range(self, key: bytes) -> pb.KeyValue | None:
        """A linearizable read of one key."""
        return (await self.range_at(key))[0]

    async def range_at(self, key: bytes) -> tuple[pb.KeyValue | None, int]:
        """A linearizable read of one key, and the store's revision when it was read."""
        response = await self.call(
            "/etcdserverpb.KV/Range", pb.RangeRequest(key=key), pb.RangeResponse
        )
        return (response.kvs[0] if response.kvs else None), response.header.revision

    async def range_prefix(self, prefix: bytes) -> list[pb.KeyValue]:
        """A linearizable read of every key under ``prefix``."""
        request = pb.RangeRequest(key=prefix, range_end=prefix_end(prefix))
        response = await self.call("/etcdserverpb.KV/Range", request, pb.RangeResponse)
        return list(response.kvs)

    async def txn(self, request: pb.TxnRequest) -> pb.TxnResponse:
        """One transaction, never retried: its outcome is unknown on BackendUnavailable."""
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
        """Revoke, best effort: an unreachable or closed cluster lets it expire instead."""
        with contextlib.suppress(BackendUnavailable, ProviderClosed):
            await self.revoke(lease_id)

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

    async def keep_alive_once(self, lease_id: int) -> int:
        """Refresh a lease once; its TTL in seconds, or 0 when it is gone."""
        self.check_open()
        deadline = time.monotonic() + self.timeout
        index = self._preferred
        try:
            async for attempt in self._retrying():
                with attempt:
                    try:
                        return await self._keep_alive_attempt(index, lease_id, deadline)
                    except (grpc.aio.AioRpcError, LeaseError) as exc:
                        index = self._attempt_failed(index, exc)
                        raise
        except (grpc.aio.AioRpcError, LeaseError) as exc:
            raise self.error(exc) from exc
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def _keep_alive_attempt(self, index: int, lease_id: int, deadline: float) -> int:
        stream = self.keep_alive_stream(await self.metadata(index), index)
        try:
            await stream.write(pb.LeaseKeepAliveRequest(ID=lease_id))
            response = await asyncio.wait_for(stream.read(), self._attempt_timeout(deadline))
        except asyncio.CancelledError as exc:
            if closed := self.closed_under(exc):
                raise closed from None
            raise
        except TimeoutError:
            raise BackendUnavailable("etcd: a keep-alive was not answered in time") from None
        finally:
            stream.cancel()
        if not isinstance(response, pb.LeaseKeepAliveResponse):
            raise BackendUnavailable("etcd closed the keep-alive stream")
        self.answered(index)
        return max(0, response.TTL)

    def _open_stream(
        self,
        path: str,
        request_type: type[RequestT],
        response_type: type[ResponseT],
        metadata: tuple[tuple[str, str], ...],
        index: int | None,
    ) -> grpc.aio.StreamStreamCall[RequestT, ResponseT]:
        method = self.channel(index).stream_stream(
            path,
            request_serializer=request_type.SerializeToString,
            response_deserializer=response_type.FromString,
        )
        return method(None, metadata=metadata)

    def keep_alive_stream(
        self, metadata: tuple[tuple[str, str], ...], index: int | None = None
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
        self, metadata: tuple[tuple[str, str], ...], index: int | None = None
    ) -> grpc.aio.StreamStreamCall[pb.WatchRequest, pb.WatchResponse]:
        """A bidirectional ``Watch`` stream to endpoint ``index`` (the preferred)."""
        return self._open_stream(
            "/etcdserverpb.Watch/Watch", pb.WatchRequest, pb.WatchResponse, metadata, index
        )

    async def close(self) -> None:
        """Close every channel; idempotent."""
        self._closed = True
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(None)


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])
