"""Where the members are: the endpoints, a channel to each, and which to try first.

Endpoints are tried from the *preferred* one (the last that answered). A member that
fails a call cools down: calls and streams pass it over while another may answer.
Each caller moves on from the endpoint *it* tried, so concurrent failures on one
frozen member never rotate the others back onto it.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from etcd_leases.errors import LeaseValueError, ProviderClosed

__all__ = ["Endpoint", "Members", "parse_endpoints"]

# A member that failed us (down, frozen, timed out) is passed over for this long while
# another may answer: a frozen member must cost concurrent callers no more than it
# costs one. One that answered "no leader" will have one after an election: sooner.
_COOL_DOWN_S = 5.0
_NO_LEADER_COOL_DOWN_S = 0.5

_CHANNEL_OPTIONS = [
    # A restarted member must be reachable again within a second, not after
    # gRPC's default backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Not a backoff: the time one connection attempt is given (gRPC's minimum connect
    # timeout, 20 s by default). At 0.1 s, a connection set up slowly (a loaded host,
    # a distant one, TLS) failed its first calls; 2 s bounds how long a member cut off
    # by the network keeps a new attempt waiting once it is reachable again.
    ("grpc.min_reconnect_backoff_ms", 2000),
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


def ssl_credentials(
    ca_cert: str | None, cert: str | None, key: str | None
) -> grpc.ChannelCredentials:
    """TLS credentials from PEM files (``None``: the system's roots, no client cert)."""

    def read(path: str | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca_cert), private_key=read(key), certificate_chain=read(cert)
    )


class Members:
    """The endpoints of a cluster, a channel to each, and how well each serves us."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        credentials: grpc.ChannelCredentials,
        on_failure: Callable[[], None] = lambda: None,
    ) -> None:
        self._endpoints = endpoints
        self._credentials = credentials
        self._on_failure = on_failure
        self._channels: dict[Endpoint, grpc.aio.Channel] = {}
        self._preferred = 0
        # time.monotonic() until which each endpoint is passed over if others may answer.
        self._cool_until = [0.0] * len(endpoints)
        self._closed = False

    def __len__(self) -> int:
        return len(self._endpoints)

    @property
    def targets(self) -> list[str]:
        return [endpoint.target for endpoint in self._endpoints]

    @property
    def closed(self) -> bool:
        return self._closed

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
        self._on_failure()
        return following

    def answered(self, index: int) -> None:
        """Endpoint ``index`` answered: prefer it."""
        self._cool_until[index] = 0.0
        self._preferred = index

    def learn(self, client_urls: Iterable[str]) -> list[str]:
        """Add the members' client URLs not known yet (from etcd's member list); them.

        Only added, never dropped: an endpoint given to us may be a proxy or a DNS
        name that no member advertises, and a member gone for good just fails and
        cools down. Indices stay stable for the streams that use them.
        """
        known = {endpoint.target for endpoint in self._endpoints}
        added: list[str] = []
        for url in client_urls:
            try:
                endpoint = _endpoint(url, tls=False)  # a member's URL names its scheme
            except LeaseValueError:
                continue  # advertised as something we cannot dial
            if endpoint.target not in known:
                known.add(endpoint.target)
                self._endpoints.append(endpoint)
                self._cool_until.append(0.0)
                added.append(endpoint.target)
        return added

    def channel(self, index: int | None = None) -> grpc.aio.Channel:
        """The channel to endpoint ``index`` (the preferred one), created on first use."""
        if self._closed:
            raise ProviderClosed("the provider is closed")
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

    async def close(self) -> None:
        """Close every channel; idempotent."""
        self._closed = True
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(None)
