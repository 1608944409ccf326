"""Releases whose outcome is unknown: their copies may still land, so what may they end?

A release is sent as copies until one is answered (:mod:`.copies`). A copy whose
answer was lost may still be applied later: its proposal was already on its way
through raft. Each copy therefore compares the tenure, not only the owner: the owner's
value *and* a ``mod_revision`` no higher than the highest revision this client had
seen when the release began. A tenure that began after that has a higher one, so no
copy can end it, however late it lands.

That leaves the tenure the release was about. When no copy was answered, the release
raises "outcome unknown" and that tenure may still end at any moment; if this process
then takes the key again for the same owner, it must not hand out that tenure (and its
TTL promise) as if nothing were pending. :class:`LateReleases` remembers, per key, the
revision such a release compared, and tells the takes when the tenure they found is
one the release may still end: they then write the key again (a new ``mod_revision``),
and a late copy finds nothing to end. A later release of the key that is answered, or
any tenure seen above the revision, settles it.
"""

from __future__ import annotations

from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

__all__ = ["LateReleases"]


class LateReleases:
    """Per key, the revision up to which a release whose outcome is unknown may end tenures."""

    def __init__(self) -> None:
        self._up_to: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._up_to)

    def unknown(self, etcd_key: bytes, up_to: int) -> None:
        """A release of ``etcd_key`` comparing ``mod_revision <= up_to`` had no answer."""
        self._up_to[etcd_key] = max(up_to, self._up_to.get(etcd_key, 0))

    def answered(self, etcd_key: bytes) -> None:
        """A later release of ``etcd_key`` was answered: the owner's tenure it compared
        (every one the earlier releases could end) is over, and later ones are safe."""
        self._up_to.pop(etcd_key, None)

    def may_end(self, kv: pb.KeyValue) -> bool:
        """Whether a release of ours with no answer may still end the tenure ``kv`` shows."""
        up_to = self._up_to.get(kv.key)
        if up_to is None:
            return False
        if kv.mod_revision > up_to:
            del self._up_to[kv.key]  # this tenure, and every later one, is out of its reach
            return False
        return True
