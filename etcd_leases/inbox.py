"""The inbox capability: per-thread message queues that live beside the leases.

The agent-threads recipe (:mod:`etcd_leases.threads`) routes every message sent to a
thread to whichever run holds the thread's lease. It needs, from a backend, a little
more than :class:`~etcd_leases.contract.HoldingProvider`: a durable, ordered, bounded
queue per thread whose writes can be fenced by a tenure. :class:`Inbox` says what;
the in-memory model (:mod:`etcd_leases.memory_inbox`) and etcd
(:mod:`etcd_leases.etcd.inbox`) implement it, and argument checks live here so both
refuse the same inputs before anything is written.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from etcd_leases.contract import HoldingProvider, check_key
from etcd_leases.dead_letters import DeadLetter
from etcd_leases.errors import LeaseError, LeaseTypeError, LeaseValueError
from etcd_leases.send_ids import SendId

#: The largest payload a message may carry: 1 MiB, well below etcd's default request
#: limit of 1.5 MiB (``--max-request-bytes``), which also has to fit the message's keys.
MAX_PAYLOAD_BYTES = 1024 * 1024
#: How many unacknowledged messages a thread's inbox holds before sends are refused.
DEFAULT_MAX_PENDING = 1000


class InboxFull(LeaseError):
    """The thread's inbox holds ``max_pending`` unacknowledged messages: back off."""

    def __init__(self, thread: str, max_pending: int) -> None:
        super().__init__(
            f"the inbox of {thread!r} holds {max_pending} unacknowledged messages, "
            "its limit: retry once its run has caught up"
        )
        self.thread = thread
        self.max_pending = max_pending


@dataclass(frozen=True)
class Message:
    """A message stored in a thread's inbox.

    ``seq`` numbers the thread's messages from 1 in the order their sends were
    acknowledged; ``id`` names the stored message (to acknowledge it). ``duplicate``
    is true in the answer to a send whose send id an earlier send already used: that
    earlier send's message (seq and id; the payload is this send's), nothing stored.
    """

    thread: str
    seq: int
    payload: bytes
    id: str
    duplicate: bool = False
    #: Which delivery this is, when it is first in line in its run (1, 2, ...).
    attempt: int = 1

    @property
    def text(self) -> str:
        """The payload decoded as UTF-8."""
        return self.payload.decode("utf-8")


@dataclass(frozen=True)
class Acked:
    """The answer to an acknowledgement that applied.

    Just after it, ``last_seq`` was the thread's last seq and ``first_waiting`` the
    seq of the first message still waiting (``None``: none). A message numbered up to
    ``last_seq`` and below ``first_waiting`` is gone: a run drops it from its queue
    (``cancel_pending`` deleted it meanwhile).
    """

    first_waiting: int | None
    last_seq: int

    def removed(self, seq: int) -> bool:
        """Whether message ``seq`` was no longer in the inbox just after the ack."""
        return seq <= self.last_seq and (self.first_waiting is None or seq < self.first_waiting)


@runtime_checkable
class Inbox(Protocol):
    """Per-thread queues of messages; fenced by the tenure of a lease key.

    - ``append``: store a message durably (when it returns) at the end of ``thread``'s
      inbox; :class:`InboxFull` if ``max_pending`` messages are already waiting.
      With a ``send_id`` (:mod:`etcd_leases.send_ids`) already used within its window,
      nothing is stored: the earlier send's message comes back, ``duplicate`` set.
      ``wake`` (default) marks the thread *woken* in the same step; ``wake=False``
      stores the message and leaves the mark as it was.
    - ``wake``: mark ``thread`` woken if messages are waiting; whether any were.
    - ``count_woken``: how many messages wait in ``thread``'s inbox if it is woken,
      else 0 (quiet messages alone wake nobody).
    - ``pending``: the messages waiting now, in seq order.
    - ``count_pending``: how many messages are waiting now, without reading them.
    - ``watch``: the messages waiting now (one batch, maybe empty), then each batch of
      new ones as they are appended; seq order throughout, each message once.
    - ``ack``: remove ``message`` only while the tenure ``token`` of ``owner`` holds
      the lease ``key``, atomically; :class:`Acked` when it did, ``None`` when the
      tenure does not hold it. A message whose id is not one of ``message.thread``'s
      is refused (``LeaseValueError``).
    - ``release_if_empty``: free the lease ``key`` only if ``owner``'s tenure ``token``
      still holds it **and** ``thread``'s inbox is empty, in one atomic step (which
      also clears the thread's wake mark); ``False`` (nothing changed) otherwise.
    - ``watch_threads``: each woken thread now, then the thread of every waking
      append and ``wake`` (repeats are possible).
    - ``cancel_pending``: delete, in one atomic step, every message waiting in
      ``thread``'s inbox, except the first in line while a tenure holds the lease
      ``key`` (the message its run is handling); how many were deleted.
    - ``abort``: record an abort of the tenure holding the lease ``key`` now, naming
      its token; whether a tenure held it.
    - ``aborted``: return once an abort of ``thread``'s tenure ``token`` is recorded
      (an abort of another tenure never ends it).
    - ``deliver``: count one more delivery of ``message`` (a run starting with it
      first in line), fenced like ``ack``; the count so far, kept until the message
      is acknowledged or dead-lettered, whoever runs the thread; 0 when the tenure no
      longer holds the key.
    - ``dead_letter``: move ``message`` to its thread's dead letters, fenced like
      ``ack``; ``False`` when the tenure no longer holds the key.
    - ``dead_letters``: the thread's dead letters, in seq order.
    - ``drop_dead_letter``: delete one; whether it was there.
    """

    async def append(
        self,
        thread: str,
        payload: bytes,
        max_pending: int,
        send_id: SendId | None = None,
        wake: bool = True,
    ) -> Message: ...

    async def wake(self, thread: str) -> bool: ...

    async def count_woken(self, thread: str) -> int: ...

    async def pending(self, thread: str) -> list[Message]: ...

    async def count_pending(self, thread: str) -> int: ...

    def watch(self, thread: str) -> AsyncGenerator[list[Message], None]: ...

    async def ack(self, key: str, owner: str, token: int, message: Message) -> Acked | None: ...

    async def release_if_empty(self, key: str, owner: str, token: int, thread: str) -> bool: ...

    def watch_threads(self) -> AsyncGenerator[str, None]: ...

    async def deliver(self, key: str, owner: str, token: int, message: Message) -> int: ...

    async def dead_letter(
        self, key: str, owner: str, token: int, message: Message, attempts: int
    ) -> bool: ...

    async def dead_letters(self, thread: str) -> list[DeadLetter]: ...

    async def drop_dead_letter(self, letter: DeadLetter) -> bool: ...

    async def cancel_pending(self, key: str, thread: str) -> int: ...

    async def abort(self, key: str, thread: str) -> bool: ...

    async def aborted(self, thread: str, token: int) -> None: ...


@runtime_checkable
class InboxProvider(HoldingProvider, Protocol):
    """A provider that can hold leases and keeps the threads' inboxes beside them."""

    @property
    def inbox(self) -> Inbox: ...


def payload_bytes(payload: object, max_bytes: int = MAX_PAYLOAD_BYTES) -> bytes:
    """``payload`` as bytes (a str is UTF-8 encoded); refused if over ``max_bytes``."""
    if isinstance(payload, str):
        try:
            data = payload.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise LeaseValueError(f"payload is not encodable as UTF-8: {exc.reason}") from None
    elif isinstance(payload, bytes | bytearray | memoryview):
        data = bytes(payload)
    else:
        raise LeaseTypeError(f"payload must be bytes or str, not {type(payload).__name__}")
    if len(data) > max_bytes:
        raise LeaseValueError(f"payload is {len(data)} bytes, more than the {max_bytes} allowed")
    return data


def check_append(
    thread: object,
    payload: object,
    max_pending: object,
    send_id: object = None,
    wake: object = True,
) -> bytes:
    """The checks of :meth:`Inbox.append`: a thread named like a key, a bounded payload.

    Returns the payload as bytes, so that it is encoded once.
    """
    check_key(thread, "thread")
    data = payload_bytes(payload)
    check_max_pending(max_pending)
    if send_id is not None and not isinstance(send_id, SendId):
        raise LeaseTypeError(f"send_id must be a SendId, not {type(send_id).__name__}")
    if not isinstance(wake, bool):
        raise LeaseTypeError(f"wake must be a bool, not {type(wake).__name__}")
    return data


def not_in_inbox(message: Message) -> LeaseValueError:
    """The refusal of an ack whose message id is not one of its thread's messages."""
    return LeaseValueError(
        f"message id {message.id!r} is not in the inbox of thread {message.thread!r}"
    )


def check_max_pending(max_pending: object) -> None:
    if isinstance(max_pending, bool) or not isinstance(max_pending, int):
        raise LeaseTypeError(f"max_pending must be an int, not {type(max_pending).__name__}")
    if max_pending < 1:
        raise LeaseValueError(f"max_pending must be at least 1, got {max_pending}")
