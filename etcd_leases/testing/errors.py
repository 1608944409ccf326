"""What goes wrong when starting etcd or running etcdctl."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from etcd_leases.testing.member import EtcdMember

_LOG_TAIL_LINES = 40
_PORT_CONFLICT_MARKERS = ("address already in use", "Only one usage of each socket address")


class EtcdStartError(RuntimeError):
    """An etcd member did not become healthy (it exited, or timed out).

    The message contains the last lines of the member's log.
    """

    def __init__(self, member: EtcdMember, reason: str, log_text: str) -> None:
        self.member_name = member.name
        self.log_path = member.log_path
        self.log_tail = _tail(log_text, _LOG_TAIL_LINES)
        #: True if the log says a port was already in use.
        self.port_conflict = any(marker in log_text for marker in _PORT_CONFLICT_MARKERS)
        super().__init__(
            f"etcd member {member.name!r} ({member.binary}, client {member.client_url}, "
            f"peer {member.peer_url}) {reason}; last lines of {member.log_path}:\n"
            f"{self.log_tail}"
        )


class EtcdctlError(RuntimeError):
    """An ``etcdctl`` command exited with a non-zero status."""

    def __init__(self, command: Sequence[str], returncode: int, stdout: str, stderr: str) -> None:
        self.command = list(command)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(
            f"etcdctl exited with status {returncode}: {' '.join(self.command)}\n"
            f"{stderr.strip() or stdout.strip()}"
        )


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])
