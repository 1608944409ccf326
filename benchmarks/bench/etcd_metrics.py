"""What etcd itself counts: raft writes and requests received, from its ``/metrics``.

Counted on the server, so the figures hold whatever the client does inside (a pool
of leases, one shared keep-alive stream, transactions grouped together): a raft
write is one ``etcd_server_proposals_committed_total``; a request is one gRPC
message etcd received (``grpc_server_msg_received_total``, all methods: a unary
call is one, a keep-alive or watch request on a stream one each).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

PROPOSALS = "etcd_server_proposals_committed_total"
MESSAGES = "grpc_server_msg_received_total"


@dataclass(frozen=True)
class Counts:
    raft_writes: float
    requests: float

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.raft_writes + other.raft_writes, self.requests + other.requests)

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.raft_writes - other.raft_writes, self.requests - other.requests)


def parse_counts(text: str) -> Counts:
    """The two counters from a Prometheus text exposition (labels summed over)."""
    raft_writes = requests = 0.0
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == PROPOSALS:
            raft_writes = float(value)
        elif name.startswith(MESSAGES + "{"):
            requests += float(value)
    return Counts(raft_writes, requests)


class EtcdMetrics:
    """Samples one member's counters over HTTP; ``None`` when they cannot be read."""

    def __init__(self, client_url: str) -> None:
        url = client_url if "://" in client_url else f"http://{client_url}"
        self.url = f"{url.rstrip('/')}/metrics"

    def sample(self) -> Counts | None:
        try:
            with urllib.request.urlopen(self.url, timeout=5) as answer:
                return parse_counts(answer.read().decode())
        except (OSError, ValueError):
            return None


class CallCounts:
    """Raft writes and requests etcd saw during each labelled call, averaged per call.

    Only meaningful while nothing else talks to etcd: the counting rounds run on
    their own, after the timed ones, with no lease kept alive in the background.
    """

    def __init__(self, metrics: EtcdMetrics) -> None:
        self._metrics = metrics
        self._totals: dict[str, Counts] = {}
        self._calls: dict[str, int] = {}
        self.available = True

    async def count(self, label: str, call: Awaitable[T]) -> T:
        before = self._metrics.sample()
        result = await call
        after = self._metrics.sample()
        if before is None or after is None:
            self.available = False
            return result
        self._totals[label] = self._totals.get(label, Counts(0, 0)) + (after - before)
        self._calls[label] = self._calls.get(label, 0) + 1
        return result

    def per_call(self, label: str) -> Counts | None:
        calls = self._calls.get(label)
        if not self.available or not calls:
            return None
        total = self._totals[label]
        return Counts(total.raft_writes / calls, total.requests / calls)
