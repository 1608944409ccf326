"""What the command prints while something takes time."""

from __future__ import annotations

import asyncio
import io

from etcd_leases.cli.output import Output, escape


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_a_wait_counts_live_on_a_terminal() -> None:
    terminal = Terminal()
    async with Output(as_json=False, progress=terminal).waiting("waiting for job:42"):
        await asyncio.sleep(0.35)
    shown = terminal.getvalue()
    assert shown.startswith("\rwaiting for job:42 0.0 s")
    assert shown.count("\rwaiting for job:42 ") >= 2  # it counts
    assert shown.endswith("\r\x1b[K")  # and clears its line at the end


async def test_an_event_during_a_wait_replaces_the_live_line() -> None:
    terminal = Terminal()
    output = Output(as_json=False, progress=terminal)
    async with output.waiting("waiting"):
        await asyncio.sleep(0.05)
        output.event("took", "taken")  # to stdout: the live line is cleared first
        assert terminal.getvalue().endswith("\r\x1b[K")


async def test_a_wait_prints_nothing_to_a_file_or_with_json() -> None:
    for output, stream in (
        (Output(as_json=False, progress=(file := io.StringIO())), file),
        (Output(as_json=True, progress=(terminal := Terminal())), terminal),
    ):
        async with output.waiting("waiting"):
            await asyncio.sleep(0.15)
        assert stream.getvalue() == ""


def test_control_characters_are_shown_escaped() -> None:
    assert escape("resource-1\0thread-42") == "resource-1\\x00thread-42"
    assert escape("plain") == "plain"
