"""Filling etcd's backend up to its quota (alarm NOSPACE), and what an operator does after.

The filler's values go through the gRPC gateway's JSON API: they are too big for an
``etcdctl`` argument (Linux allows 128 KiB per argument) and few puts fill the quota fast.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

from etcd_leases.testing import EtcdCluster, EtcdMember

FILLER = "/chaos-filler/"
VALUE_BYTES = 512 * 1024
NO_SPACE = "database space exceeded"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # members are local


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _put(member: EtcdMember, key: str, value: bytes) -> str:
    """Put through ``member``'s gateway; etcd's error text, or "" when it was written."""
    body = json.dumps({"key": _b64(key.encode()), "value": _b64(value)}).encode()
    request = urllib.request.Request(f"{member.client_url}/v3/kv/put", data=body)
    try:
        with _OPENER.open(request, timeout=10) as response:
            response.read()
            return ""
    except urllib.error.HTTPError as exc:
        with exc:
            return str(json.loads(exc.read()).get("error", exc))


def fill(cluster: EtcdCluster, quota_bytes: int) -> int:
    """Put big values under :data:`FILLER` until etcd refuses one for want of space;
    returns the bytes written."""
    written = 0
    for i in range(2 * quota_bytes // VALUE_BYTES + 8):
        error = _put(cluster.leader(), f"{FILLER}{i}", bytes(VALUE_BYTES))
        if NO_SPACE in error:
            return written
        if error:
            raise RuntimeError(f"filler put refused: {error}")
        written += VALUE_BYTES
    raise RuntimeError(f"etcd took {written} bytes without raising NOSPACE")


def recover(cluster: EtcdCluster) -> None:
    """What the etcd docs tell an operator: free space, compact, defragment every member,
    then disarm the alarm."""
    cluster.etcdctl("del", "--prefix", FILLER)
    cluster.compact()
    for member in cluster.members:
        member.defragment()
    cluster.disarm_alarms()
