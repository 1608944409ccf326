"""The providers users construct: a backend plus the ``hold`` and ``adopt`` recipes."""

from __future__ import annotations

from functools import cached_property

from etcd_leases.etcd.inbox import EtcdInbox
from etcd_leases.etcd.provider import EtcdBackend
from etcd_leases.hold import Holding
from etcd_leases.memory import MemoryBackend
from etcd_leases.memory_inbox import MemoryInbox


class EtcdLeaseProvider(Holding, EtcdBackend):
    """The lease contract on etcd, strongly consistent, with fencing tokens.

    ``EtcdLeaseProvider(endpoints="127.0.0.1:2379", *, prefix="/etcd-leases/",
    timeout=5.0, username=None, password=None, ca_cert=None, cert=None, key=None)``;
    ``async with`` opens and closes it, ``from_env()`` reads etcdctl's variables.
    """

    @cached_property
    def inbox(self) -> EtcdInbox:
        """The agent threads' inboxes, beside the leases (see :mod:`etcd_leases.threads`)."""
        return EtcdInbox(self)


class InMemoryLeaseProvider(Holding, MemoryBackend):
    """The reference model: one process, a monotonic clock, millisecond TTLs."""

    @cached_property
    def inbox(self) -> MemoryInbox:
        """The agent threads' inboxes, beside the leases (see :mod:`etcd_leases.threads`)."""
        return MemoryInbox(self)

    async def close(self) -> None:
        if "inbox" in self.__dict__:
            self.inbox.close()
        await super().close()
