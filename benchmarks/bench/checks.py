"""Correctness checks: the one thing that changes the benchmark's exit code."""

from __future__ import annotations


class Checks:
    """Collects failures (two winners, a free key not taken...): printed at once."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            self.error(message)

    def error(self, message: str) -> None:
        print(f"ERROR: {message}", flush=True)
        self.errors.append(message)

    def warn(self, message: str) -> None:
        """A figure worth a second look that the contract does not forbid."""
        print(f"WARNING: {message}", flush=True)
        self.warnings.append(message)
