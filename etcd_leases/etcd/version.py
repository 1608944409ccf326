"""The etcd server's version, and the known etcd bugs that change our guarantees."""

from __future__ import annotations

import logging
import re

_log = logging.getLogger(__name__)

# etcd bug 15247: a leader that stalls (SIGSTOP, slow disk, CPU starvation) and resumes
# still revokes the leases it thinks expired, after a new leader was elected; held keys
# are deleted early. Fixed by etcd PR 16822 in 3.6.0; backported to 3.5.13 (PR 17425,
# etcd's CHANGELOG-3.5) and 3.4.31 (PR 17465, by the changelogs).
_FIXED_15247 = {(3, 4): (3, 4, 31), (3, 5): (3, 5, 13)}


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a version such as ``"3.5.1"``; ``None`` if unreadable."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    if match is None:
        return None
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def has_bug_15247(version: str) -> bool:
    """True for an etcd that may delete held keys early after its leader stalls."""
    parsed = parse_version(version)
    if parsed is None or parsed[:2] >= (3, 6):
        return False
    fixed = _FIXED_15247.get((parsed[0], parsed[1]))
    return fixed is None or parsed < fixed


BUG_15247 = (
    "etcd bug 15247: after its leader stalls and resumes, it may delete held keys before "
    "their TTL ran out (holders hear of it from the key's watch at once; fencing tokens "
    "keep writes safe). Fixed in etcd 3.4.31, 3.5.13 and 3.6.0."
)

# Versions already warned of: once per process is enough to be found in its log, and
# a process with several providers (or connections) would otherwise repeat it.
_warned: set[str] = set()


def known_bugs(version: str) -> list[str]:
    """What the etcd ``version`` is known to get wrong that changes our guarantees."""
    return [BUG_15247] if has_bug_15247(version) else []


def warn_if_affected(version: str, endpoint: str) -> None:
    """Log the warning a user of an affected etcd needs, once per process and version."""
    if has_bug_15247(version) and version not in _warned:
        _warned.add(version)
        _log.warning("etcd %s at %s has %s", version, endpoint, BUG_15247)
