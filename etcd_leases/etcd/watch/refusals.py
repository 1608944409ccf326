"""Watches etcd refused for auth reasons: an expired token, or a real refusal?

etcd checks the token a watch stream was opened with at every create, and says
"permission denied" (3.5) or "invalid auth token" (3.4) once it has expired. Before
the stream is reopened, a unary read of each refused key settles which: the client
logs in again if its token expired, so a read that passes means the next stream
carries a good token; a read refused means the watch is too.
"""

from __future__ import annotations

from etcd_leases.errors import LeaseError, PermissionDenied
from etcd_leases.etcd.client import EtcdClient
from etcd_leases.etcd.watch.watcher import Watcher

_AUTH_REFUSALS = ("permission denied", "invalid auth token")
_MAX_REFUSALS = 3


def is_auth_refusal(reason: str) -> bool:
    """Whether etcd's ``cancel_reason`` for a create may be an expired token."""
    return any(word in reason for word in _AUTH_REFUSALS)


class Refusals:
    """The watchers whose create etcd refused for auth reasons, and how many times."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._counts: dict[Watcher, int] = {}

    def __bool__(self) -> bool:
        return bool(self._counts)

    def add(self, watcher: Watcher) -> None:
        self._counts[watcher] = self._counts.get(watcher, 0) + 1

    def accepted(self, watcher: Watcher) -> None:
        """etcd created the watch after all: it was the token, then."""
        self._counts.pop(watcher, None)

    async def check(self) -> list[Watcher]:
        """Read each refused key; end the watchers refused for good, and return them."""
        refused, self._counts = self._counts, {}
        ended: list[Watcher] = []
        for watcher, count in refused.items():
            if watcher.ended:
                continue
            try:
                await self._client.range(watcher.key)
            except PermissionDenied as exc:
                watcher._finish(PermissionDenied(f"etcd: cannot watch {watcher.key!r}: {exc}"))
                ended.append(watcher)
                continue
            except LeaseError:
                pass  # unknown yet: the next stream's create asks again
            if count >= _MAX_REFUSALS:
                # Readable, yet never watchable: do not reopen the stream forever.
                watcher._finish(PermissionDenied(f"etcd: cannot watch {watcher.key!r}"))
                ended.append(watcher)
            else:
                self._counts[watcher] = count
        return ended
