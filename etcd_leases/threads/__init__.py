"""Agent threads on the lease: route every follow-up to the owner's run, durably.

See :class:`Threads` (send, run, serve) and :class:`ThreadMessages` (a run's messages).
"""

from etcd_leases.dead_letters import DeadLetter
from etcd_leases.inbox import InboxFull, Message
from etcd_leases.threads.messages import ThreadMessages
from etcd_leases.threads.run import Handler
from etcd_leases.threads.threads import Threads

__all__ = ["DeadLetter", "Handler", "InboxFull", "Message", "ThreadMessages", "Threads"]
