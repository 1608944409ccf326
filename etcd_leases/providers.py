"""The providers users construct: a backend plus the ``hold`` and ``adopt`` recipes."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

from etcd_leases.etcd.provider import EtcdBackend
from etcd_leases.hold import Holding

if TYPE_CHECKING:
    from etcd_leases.etcd.inbox import EtcdInbox
    from etcd_leases.memory_provider import InMemoryLeaseProvider


class EtcdLeaseProvider(Holding, EtcdBackend):
    """The lease contract on etcd, strongly consistent, with fencing tokens.

    ``EtcdLeaseProvider(endpoints="127.0.0.1:2379", *, prefix="/etcd-leases/",
    timeout=5.0, username=None, password=None, ca_cert=None, cert=None, key=None)``;
    ``async with`` opens and closes it, ``from_env()`` reads etcdctl's variables.
    """

    @cached_property
    def inbox(self) -> EtcdInbox:
        """The agent threads' inboxes, beside the leases (see :mod:`etcd_leases.threads`)."""
        # Imported here: a process that only takes keys never loads the inbox.
        from etcd_leases.etcd.inbox import EtcdInbox

        return EtcdInbox(self)


def __getattr__(name: str) -> Any:
    # InMemoryLeaseProvider lives in memory_provider, so that the etcd provider does
    # not load the in-memory backend; still importable from here.
    if name == "InMemoryLeaseProvider":
        from etcd_leases.memory_provider import InMemoryLeaseProvider

        return InMemoryLeaseProvider
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EtcdLeaseProvider", "InMemoryLeaseProvider"]
