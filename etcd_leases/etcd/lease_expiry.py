"""Whether a lease whose keep-alive went unanswered has expired on etcd's leader.

etcd answers the keep-alive of an expired lease only once it has revoked the lease
(its lessor waits for the revoke to apply), and it revokes expired leases at most
1,000 a second, each a raft write: behind a mass expiry or a slow disk, that answer
comes seconds after the client's timeout, though the leader knew at once. Its
LeaseTimeToLive answers from the leader's lessor without waiting: a negative TTL is a
lease past its expiry, or gone.

That answer is believed only when a linearizable read made after it finds the same
raft term. A leader resumed after a freeze still answers from its own clock, by which
every lease expired, while the leader elected meanwhile has extended them all; by the
time a read is confirmed by a quorum, the resumed one has learnt the newer term. The
same term means the answer came from the term's leader, still leading.
"""

from __future__ import annotations

from etcd_leases.errors import BackendUnavailable
from etcd_leases.etcd.client import EtcdClient


async def expired_on_the_leader(client: EtcdClient, lease_id: int, key: bytes) -> bool:
    """Whether etcd's leader has ``lease_id`` past its expiry (or no longer has it).

    ``key`` is one the caller may read (etcd's auth checks the confirming read).
    ``False`` when etcd does not answer: then nobody knows.
    """
    try:
        answer = await client.time_to_live(lease_id)
        # A TTL is rounded toward zero: 0 may still have most of a second to live.
        if answer.TTL >= 0:
            return False
        return await client.raft_term(key) == answer.header.raft_term
    except BackendUnavailable:
        return False
