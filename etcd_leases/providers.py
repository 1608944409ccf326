"""The providers users construct: a backend plus the ``hold`` and ``adopt`` recipes."""

from __future__ import annotations

from etcd_leases.etcd.provider import EtcdBackend
from etcd_leases.hold import Holding
from etcd_leases.memory import MemoryBackend


class EtcdLeaseProvider(Holding, EtcdBackend):
    """The lease contract on etcd, strongly consistent, with fencing tokens.

    ``EtcdLeaseProvider(endpoints="127.0.0.1:2379", *, prefix="/etcd-leases/",
    timeout=5.0, username=None, password=None, ca_cert=None, cert=None, key=None)``;
    ``async with`` opens and closes it, ``from_env()`` reads etcdctl's variables.
    """


class InMemoryLeaseProvider(Holding, MemoryBackend):
    """The reference model: one process, a monotonic clock, millisecond TTLs."""
