"""The probes' endpoint of ``run`` and ``elect`` (``--metrics-port``): ``/metrics``,
``/healthz`` (liveness) and ``/readyz`` (readiness).

Served by the asyncio event loop that keeps the lease and supervises the command,
not by a thread of its own: a thread would answer on while the loop is stuck, and
with it the renewals and the supervision. A stuck loop answers nothing, so the
kubelet's probe fails on its timeout.

- ``/healthz`` answers 200 unless this process holds its lease (leads) and the lease
  was lost more than ``--liveness-timeout`` ago while the term still goes on: the
  work would run on without a lease. client-go's ``HealthzAdaptor`` is the model
  (healthy unless the leader's renewal is overdue by more than a timeout); a
  candidate that does not lead is healthy.
- ``/readyz`` answers 200 while etcd answered the last check, a linearizable read
  made every :data:`CHECK_EVERY_S`, else 503 (etcd unreachable, or no quorum).
- ``/metrics`` is the Prometheus text of the default registry, without ``_created``
  series.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import prometheus_client

from etcd_leases.hold import HeldLease
from etcd_leases.metrics import MeteredProvider

#: etcd is checked this often, and is unreachable if a check takes longer.
CHECK_EVERY_S = 2.0
CHECK_TIMEOUT_S = 2.0
# A client that has not sent its request by then is dropped.
_REQUEST_TIMEOUT_S = 5.0


class Health:
    """What the probes ask: is the loop turning, is a held lease still valid, does etcd answer.

    ``key`` is read to check etcd (the election's seat, or the held key);
    ``liveness_timeout`` is how long a lost lease may go on being held before
    ``/healthz`` fails.
    """

    def __init__(self, metered: MeteredProvider, key: str, liveness_timeout: float) -> None:
        self.metered = metered
        self.key = key
        self.liveness_timeout = liveness_timeout
        self.etcd_answers = False
        self._lease: HeldLease | None = None
        self._lost_at: float | None = None
        self._watch: asyncio.Task[None] | None = None
        self._checker: asyncio.Task[None] | None = None
        self._server: asyncio.Server | None = None

    def holding(self, lease: HeldLease | None) -> None:
        """This process holds ``lease`` now (a term began), or nothing (it ended)."""
        if self._watch is not None:
            self._watch.cancel()
        self._lease, self._lost_at, self._watch = lease, None, None
        if lease is not None:
            self._watch = asyncio.get_running_loop().create_task(self._note_loss(lease))

    async def _note_loss(self, lease: HeldLease) -> None:
        await lease.lost.wait()
        self._lost_at = time.monotonic()

    def overdue(self) -> float:
        """Seconds the held lease has been lost while still held; 0 if it is not."""
        if self._lease is None or self._lost_at is None:
            return 0.0
        return time.monotonic() - self._lost_at

    def live(self) -> tuple[bool, str]:
        overdue = self.overdue()
        if overdue > self.liveness_timeout:
            assert self._lease is not None
            return False, (
                f"{self._lease.owner} still holds {self._lease.key} {overdue:.1f} s after "
                f"losing its lease ({self._lease.lost_reason}); --liveness-timeout "
                f"{self.liveness_timeout:g} s"
            )
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        if self.etcd_answers:
            return True, "ok"
        return False, f"etcd did not answer a read within {CHECK_TIMEOUT_S:g} s"

    async def serve(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port) and check etcd in the background;
        the port. Raises OSError if it cannot listen."""
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        self._server = await asyncio.start_server(self._answer, host, port)
        self._checker = asyncio.get_running_loop().create_task(self._check_etcd())
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def _check_etcd(self) -> None:
        while True:
            self.etcd_answers = await self.metered.etcd_answers(self.key, CHECK_TIMEOUT_S)
            await asyncio.sleep(CHECK_EVERY_S)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            method, path, *_ = head.decode("latin-1").split(" ", 2)
            status, body, kind = self._response(method, path)
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # not HTTP (ValueError: a bad request line or one too long), or gone
        finally:
            writer.close()

    def _response(self, method: str, path: str) -> tuple[str, bytes, str]:
        text = "text/plain; charset=utf-8"
        if method != "GET":
            return "405 Method Not Allowed", b"GET only\n", text
        path = path.split("?", 1)[0]
        if path == "/metrics":
            metrics = prometheus_client.generate_latest()
            return "200 OK", metrics, prometheus_client.CONTENT_TYPE_LATEST
        if path in ("/healthz", "/readyz"):
            ok, why = self.live() if path == "/healthz" else self.ready()
            return ("200 OK" if ok else "503 Service Unavailable"), f"{why}\n".encode(), text
        return "404 Not Found", b"/metrics, /healthz or /readyz\n", text

    async def aclose(self) -> None:
        """Stop serving and checking (``contextlib.aclosing(health)`` calls it)."""
        self.holding(None)
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
