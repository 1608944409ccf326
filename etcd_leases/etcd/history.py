"""What a put whose answer was lost did, read from the key's history.

A compare-and-swap sent again after a lost answer tells only what the key holds now:
if the first copy landed and another client changed the key before the next copy
arrived, that copy fails although the first succeeded. The first copy's put is in the
key's history (until compaction), recognisable by its lease and value: a lease carries
one tenure at a time, so after the revision at which its previous tenure (if any) had
ended, a put of ours under it can only be this attempt's.
"""

from __future__ import annotations

import asyncio

from etcd_leases.errors import BackendUnavailable
from etcd_leases.etcd.watch import WatchStream
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb


async def put_landed(
    watches: WatchStream,
    key: bytes,
    value: bytes,
    lease: int,
    *,
    after: int,
    until: int,
    timeout: float,
) -> int | None:
    """The revision at which ``value`` was put on ``key`` under ``lease`` after revision
    ``after``, or ``None`` if it was not, up to the key's first event at or past ``until``.

    Raises BackendUnavailable when that history is compacted, or not read in ``timeout``
    seconds: then nobody can tell.
    """
    if until <= after:
        return None  # the key has not changed since: no put landed
    watcher = watches.watch(key, after + 1)
    try:
        async with asyncio.timeout(timeout):
            async for events in watcher:
                if not events:
                    raise BackendUnavailable(
                        f"etcd: the history of {key!r} that tells whether a write whose "
                        "answer was lost landed is compacted: its outcome is unknown"
                    )
                for event in events:
                    kv = event.kv
                    if event.type == pb.Event.PUT and kv.lease == lease and kv.value == value:
                        return kv.mod_revision
                    if kv.mod_revision >= until:
                        return None
    except TimeoutError:
        raise BackendUnavailable(
            f"etcd: the history of {key!r} was not read in time: whether a write whose "
            "answer was lost landed is unknown"
        ) from None
    finally:
        watcher.cancel()
    raise BackendUnavailable(f"etcd: the watch of {key!r} ended before it told")
