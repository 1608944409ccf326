"""A Redis lock the way Mastra's Redis backend does it: ``SET NX PX``, owner-checked ``DEL``.

Against a ``redis-server`` this peer starts itself on 127.0.0.1 and a free port,
with no persistence (Mastra's default deployment), and kills by its pid at the
end. No consensus and no fsync: it shows what a lease costs without them.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from typing import Any

from etcd_leases.testing import free_ports

from ..config import TTL_MS
from . import AsyncPeer, CorrectnessError, Skipped

NAME = "Redis SET NX PX + Lua DEL"

# Deletes the key only while it still holds our token, in one step.
RELEASE_SCRIPT = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""


class RedisLock(AsyncPeer):
    name = NAME
    does = "SET key token NX PX ttl; EVALSHA get-compare-del: 2 round trips, no fsync"

    def __init__(self, endpoint: str, prefix: str) -> None:
        self._prefix = prefix
        self._server: asyncio.subprocess.Process | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._redis: Any = None
        self._release: Any = None

    async def open(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise Skipped("no redis-server on PATH (apt-get install redis-server)")
        try:
            import redis.asyncio
        except ImportError as exc:
            raise Skipped(f"redis-py is not installed ({exc})") from None
        (port,) = free_ports(1)
        self._workdir = tempfile.TemporaryDirectory(prefix="bench-redis-")
        self._server = await asyncio.create_subprocess_exec(
            binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
            "--appendonly", "no", "--dir", self._workdir.name,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        # One connection per concurrent task, as many as the largest level has.
        self._redis = redis.asyncio.Redis(host="127.0.0.1", port=port, max_connections=1024)
        await self._wait_ready()
        self._release = self._redis.register_script(RELEASE_SCRIPT)

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                await self._redis.ping()
                return
            except Exception as exc:  # redis' ConnectionError, while it starts
                if time.monotonic() > deadline:
                    raise Skipped(f"redis-server did not answer in 10 s ({exc})") from None
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
        if self._server is not None:
            self._server.kill()  # by its pid: the one process we started
            await self._server.wait()
        if self._workdir is not None:
            self._workdir.cleanup()

    async def cycle(self, key: str) -> None:
        name, token = self._prefix + key, "bench"
        if not await self._redis.set(name, token, nx=True, px=TTL_MS):
            raise CorrectnessError(f"{NAME}: could not take the free key {key!r}")
        if await self._release(keys=[name], args=[token]) != 1:
            raise CorrectnessError(f"{NAME}: the holder's release deleted nothing for {key!r}")
