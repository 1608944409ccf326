"""A register outside etcd that checks fencing tokens itself, over TCP on 127.0.0.1.

It stands for any resource a lease protects (a database row, a file, an API): it
accepts a write only if its token is at least the highest it has accepted for the
key, and logs every decision for the checker. One JSON line per request
(``{"key", "token", "worker", "seq"}``), one line back: ``ok`` or ``stale``.
"""

from __future__ import annotations

import asyncio
import json
import socketserver
import threading
import time
from typing import Any


class _Handler(socketserver.StreamRequestHandler):
    server: OutsideRegister

    def handle(self) -> None:
        for line in self.rfile:
            request = json.loads(line)
            accepted = self.server.decide(request)
            self.wfile.write(b"ok\n" if accepted else b"stale\n")


class OutsideRegister(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self._lock = threading.Lock()
        self._highest: dict[str, int] = {}
        #: Every decision, in the order taken.
        self.log: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def decide(self, request: dict[str, Any]) -> bool:
        key, token = request["key"], int(request["token"])
        with self._lock:
            accepted = token >= self._highest.get(key, 0)
            if accepted:
                self._highest[key] = token
            self.log.append({**request, "accepted": accepted, "at": time.monotonic()})
        return accepted

    def __enter__(self) -> OutsideRegister:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(10)


async def write(port: int, key: str, token: int, worker: str, seq: int) -> bool:
    """One write to the register (from a worker): whether it was accepted."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        request = {"key": key, "token": token, "worker": worker, "seq": seq}
        writer.write(json.dumps(request).encode() + b"\n")
        await writer.drain()
        return (await reader.readline()).strip() == b"ok"
    finally:
        writer.close()
        await writer.wait_closed()
