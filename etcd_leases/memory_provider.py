"""The in-memory provider users construct: the reference model plus ``hold`` and ``adopt``."""

from __future__ import annotations

from functools import cached_property

from etcd_leases.hold import Holding
from etcd_leases.memory import MemoryBackend
from etcd_leases.memory_inbox import MemoryInbox


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
