"""What commands print: a line for people, or JSON for scripts (``--json``).

Results go to stdout; progress and errors to stderr, so ``--json`` output stays
parseable. Streams (``watch``, ``run``, ``elect``, ``demo``) print one JSON object
per line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TextIO


def escape(text: str) -> str:
    """``text`` with control characters (a NUL in a key, say) shown as escapes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def clock() -> str:
    """The wall-clock time of an event, to the millisecond."""
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"


class Output:
    """Prints results and events as text or JSON."""

    def __init__(self, as_json: bool, progress: TextIO | None = None) -> None:
        self.as_json = as_json
        self._progress = sys.stderr if progress is None else progress
        self._counting = False  # a live line is on the terminal; lines go over it

    @asynccontextmanager
    async def waiting(self, text: str) -> AsyncIterator[None]:
        """On a terminal, ``text`` and the seconds waited so far, live, until the block ends."""
        stream = self._progress
        if self.as_json or not stream.isatty():
            yield
            return
        started = time.monotonic()
        self._counting = True

        async def count() -> None:
            while True:
                stream.write(f"\r{text} {time.monotonic() - started:.1f} s\x1b[K")
                stream.flush()
                await asyncio.sleep(0.1)

        counter = asyncio.ensure_future(count())
        try:
            yield
        finally:
            counter.cancel()
            await asyncio.gather(counter, return_exceptions=True)
            self._clear()  # the line goes; the events say what happened
            self._counting = False

    def _clear(self) -> None:
        if self._counting:
            self._progress.write("\r\x1b[K")
            self._progress.flush()

    def result(self, text: str, **data: Any) -> None:
        """One result: ``text`` for people, ``data`` as one JSON object."""
        self._clear()
        print(json.dumps(data) if self.as_json else text, flush=True)

    def table(
        self, headers: list[str], rows: list[list[str]], records: list[dict[str, Any]]
    ) -> None:
        """Aligned columns for people; a JSON array of ``records`` for scripts."""
        if self.as_json:
            print(json.dumps(records), flush=True)
            return
        widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
        for row in [headers, *rows]:
            print(
                "  ".join(
                    cell.ljust(width) for cell, width in zip(row, widths, strict=True)
                ).rstrip()
            )
        sys.stdout.flush()

    def event(self, event: str, text: str, **data: Any) -> None:
        """A timestamped line of a stream; JSON: ``{"time", "event", ...data}``."""
        self._clear()
        if self.as_json:
            print(json.dumps({"time": time.time(), "event": event, **data}), flush=True)
        else:
            print(f"{clock()}  {text}", flush=True)

    def heading(self, text: str) -> None:
        """A section title of a narration, for people only."""
        self._clear()
        if not self.as_json:
            print(f"\n{text}", flush=True)

    def note(self, text: str) -> None:
        """Progress for people, on stderr (kept out of JSON output)."""
        self._clear()
        if not self.as_json:
            print(f"{clock()}  {text}", file=sys.stderr, flush=True)
