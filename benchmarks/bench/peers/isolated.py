"""A peer run in a child process of its own, driven over its stdin and stdout.

aetcd and python3-etcd3 each register etcd's ``.proto`` files (``auth.proto``,
``kv.proto``...) in protobuf's default descriptor pool under the same names, so
the two cannot be imported into one process. The one imported second runs here,
in a child, which answers one JSON line per request. Its CPU is read from /proc.

    python -m benchmarks.bench.peers.isolated MODULE CLASS ENDPOINT PREFIX
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from . import CorrectnessError, Peer, Skipped

# Where ``benchmarks`` is importable from, wherever the benchmark was started.
REPOSITORY = Path(__file__).resolve().parents[3]
# Big enough for the keys of the largest concurrency level.
LINE_LIMIT = 1 << 22


class IsolatedPeer(Peer):
    def __init__(self, peer_type: type[Peer], endpoint: str, prefix: str) -> None:
        self._args = [peer_type.__module__, peer_type.__name__, endpoint, prefix]
        self.name = peer_type.name
        self.does = peer_type.does
        self._child: asyncio.subprocess.Process | None = None

    async def open(self) -> None:
        self._child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", __name__, *self._args,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=LINE_LIMIT,
            cwd=REPOSITORY,
        )  # fmt: skip
        self.pid = self._child.pid
        await self._answer()

    async def _answer(self) -> dict[str, Any]:
        assert self._child is not None and self._child.stdout is not None
        line = await self._child.stdout.readline()
        if not line:
            raise Skipped(f"its child process exited ({await self._child.wait()})")
        answer: dict[str, Any] = json.loads(line)
        if "skipped" in answer:
            raise Skipped(answer["skipped"])
        if "correctness" in answer:
            raise CorrectnessError(answer["correctness"])
        return answer

    async def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._child is not None and self._child.stdin is not None
        self._child.stdin.write(json.dumps(request).encode() + b"\n")
        await self._child.stdin.drain()
        return await self._answer()

    async def timed_cycles(self, keys: list[str]) -> list[float]:
        samples: list[float] = (await self._ask({"op": "timed", "keys": keys}))["samples"]
        return samples

    async def cycles_until(self, keys: list[str], seconds: float) -> int:
        answer = await self._ask({"op": "until", "keys": keys, "seconds": seconds})
        return int(answer["done"])

    async def close(self) -> None:
        if self._child is None:
            return
        if self._child.returncode is None:
            self._child.kill()  # by its pid: the one process we started
        await self._child.wait()


async def serve(peer: Peer) -> None:
    """The child's side: open the peer, then one answer per request line until EOF."""

    def send(answer: dict[str, Any]) -> None:
        print(json.dumps(answer), flush=True)

    try:
        await peer.open()
    except Skipped as exc:
        send({"skipped": str(exc)})
        return
    send({"ready": True})
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            request = json.loads(line)
            try:
                if request["op"] == "timed":
                    send({"samples": await peer.timed_cycles(request["keys"])})
                else:
                    send({"done": await peer.cycles_until(request["keys"], request["seconds"])})
            except CorrectnessError as exc:
                send({"correctness": str(exc)})
    finally:
        await peer.close()


def main() -> None:
    module, class_name, endpoint, prefix = sys.argv[1:5]
    peer_type = getattr(importlib.import_module(module), class_name)
    asyncio.run(serve(peer_type(endpoint, prefix)))


if __name__ == "__main__":
    main()
