"""Where the threads' inboxes live in etcd: the key layout, and nothing else.

Under the inbox root, beside the lease prefix (``/etcd-leases.inbox/``)::

    seq/<thread>                          "<last seq> <nonce of its send> <send ids used>"
    msg/<thread>/<seq, 20 digits>.<nonce> one message; its value is the payload
    ids/<thread>/<send id>                "<seq> <number> <message key>": a tombstone
    idn/<thread>/<number, 20 digits>      the send id of the thread's number-th tombstone
    att/<thread>/<seq, 20 digits>         its version counts the message's deliveries
    dead/<thread>/<seq, 20 digits>.<nonce> a dead letter: "<attempts>\n<payload>"
    wake/<thread>                         there while the thread is woken (empty value)
    abort/<thread>                        "<token>": the tenure last aborted

where ``<thread>`` is the thread's UTF-8 bytes after their length (``0009/chat:42\\0x``),
so one thread's keys never fall in another's range, whatever bytes names contain, and
the zero-padded seq makes key order seq order.
"""

from __future__ import annotations

SEQ_DIGITS = 20


def inbox_root(lease_prefix: str) -> bytes:
    """Where inboxes go: beside the leases, never under a lease key.

    ``/etcd-leases/`` -> ``/etcd-leases.inbox/``. A prefix without a final ``/``
    (or just ``/``) gets ``<prefix>\\xff.inbox/`` instead: no UTF-8 key has an 0xFF
    byte, so no lease key falls under it either.
    """
    stem = lease_prefix.rstrip("/")
    if lease_prefix.endswith("/") and stem:
        return f"{stem}.inbox/".encode()
    return lease_prefix.encode("utf-8") + b"\xff.inbox/"


class InboxKeys:
    """The etcd keys of every thread's inbox under one root."""

    def __init__(self, lease_prefix: str) -> None:
        self.root = inbox_root(lease_prefix)

    @staticmethod
    def _name(thread: str) -> bytes:
        data = thread.encode("utf-8")
        return b"%04d/" % len(data) + data

    def seq(self, thread: str) -> bytes:
        return self.root + b"seq/" + self._name(thread)

    def all_messages(self) -> bytes:
        """The prefix of every thread's messages."""
        return self.root + b"msg/"

    def all_wakes(self) -> bytes:
        """The prefix of every thread's wake mark."""
        return self.root + b"wake/"

    def wake(self, thread: str) -> bytes:
        return self.all_wakes() + self._name(thread)

    def all_aborts(self) -> bytes:
        """The prefix of every thread's abort key."""
        return self.root + b"abort/"

    def abort(self, thread: str) -> bytes:
        return self.all_aborts() + self._name(thread)

    def messages(self, thread: str, *, below_seq: int | None = None) -> bytes:
        """The prefix of ``thread``'s messages; with ``below_seq``, the end of their
        range that stops before that seq."""
        prefix = self.all_messages() + self._name(thread) + b"/"
        return prefix if below_seq is None else prefix + b"%0*d" % (SEQ_DIGITS, below_seq)

    def message(self, thread: str, seq: int, nonce: str) -> bytes:
        return self.messages(thread) + b"%0*d.%s" % (SEQ_DIGITS, seq, nonce.encode())

    def send_id(self, thread: str, send_id: str) -> bytes:
        return self.root + b"ids/" + self._name(thread) + b"/" + send_id.encode("utf-8")

    def send_id_number(self, thread: str, number: int) -> bytes:
        return self.root + b"idn/" + self._name(thread) + b"/%0*d" % (SEQ_DIGITS, number)

    def deliveries(self, thread: str) -> bytes:
        """The prefix of ``thread``'s delivery counters."""
        return self.root + b"att/" + self._name(thread) + b"/"

    def delivery(self, thread: str, seq: int) -> bytes:
        return self.deliveries(thread) + b"%0*d" % (SEQ_DIGITS, seq)

    def dead_letters(self, thread: str) -> bytes:
        return self.root + b"dead/" + self._name(thread) + b"/"

    def dead_letter(self, thread: str, message_key: bytes) -> bytes:
        """Where a message goes when it dies: its key, under the dead letters."""
        return self.dead_letters(thread) + message_key[len(self.messages(thread)) :]

    def is_message(self, thread: str, key: bytes) -> bool:
        """Whether ``key`` names one of ``thread``'s messages."""
        prefix = self.messages(thread)
        seq, dot, nonce = key[len(prefix) :].partition(b".")
        digits = len(seq) == SEQ_DIGITS and seq.isdigit()
        return key.startswith(prefix) and digits and bool(dot) and bool(nonce)

    def seq_of(self, thread: str, key: bytes) -> int:
        return int(key[len(self.messages(thread)) :][:SEQ_DIGITS])

    def thread_of_wake(self, key: bytes) -> str | None:
        """The thread a wake mark belongs to (``None`` for anything else)."""
        return _thread_named(key[len(self.all_wakes()) :])

    def thread_of_abort(self, key: bytes) -> str | None:
        """The thread an abort key belongs to (``None`` for anything else)."""
        return _thread_named(key[len(self.all_aborts()) :])


def _thread_named(name: bytes) -> str | None:
    """The thread whose ``_name`` is ``name`` (``None`` if it is none)."""
    length, slash, rest = name.partition(b"/")
    if not slash or not length.isdigit() or len(rest) != int(length):
        return None
    return rest.decode("utf-8", errors="replace")


def id_of(key: bytes) -> str:
    """A message's id: its etcd key (a root may hold an 0xFF byte: kept as is)."""
    return key.decode("utf-8", "surrogateescape")


def key_of(message_id: str) -> bytes:
    return message_id.encode("utf-8", "surrogateescape")
