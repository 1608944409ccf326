"""Lease IDs chosen by the client, so that a grant whose answer was lost can be retried.

They are random 62-bit ints whose top 16 bits mark session leases (shared by many
keys), so that any process can tell them from the lease of a single tenure.
"""

from __future__ import annotations

import random

__all__ = ["is_session_lease", "new_lease_id"]

_MARK_SHIFT = 46
_SESSION_MARK = 0x5E55
# The OS's randomness, as the secrets module uses (which would import hashlib and hmac,
# a few ms at start-up that a one-shot process pays).
_random = random.SystemRandom()


def new_lease_id(*, session: bool = False) -> int:
    """A random positive int64; lets a grant whose answer was lost be retried safely."""
    mark = _SESSION_MARK
    while not session and mark == _SESSION_MARK:
        mark = _random.getrandbits(62 - _MARK_SHIFT)
    return (mark << _MARK_SHIFT) | (_random.getrandbits(_MARK_SHIFT - 1) + 1)


def is_session_lease(lease_id: int) -> bool:
    """Whether ``lease_id`` is a session lease (see :mod:`etcd_leases.etcd.session`)."""
    return lease_id >> _MARK_SHIFT == _SESSION_MARK
