"""What the nemesis records of one fault (see nemesis.py and operations.py)."""

from __future__ import annotations

import time
from typing import Any

Fault = dict[str, Any]


def fault(kind: str, start: float, target: str, **details: Any) -> Fault:
    """A fault that began at ``start`` and healed now (the cluster or worker whole again)."""
    return {"kind": kind, "start": start, "heal": time.monotonic(), "target": target, **details}
