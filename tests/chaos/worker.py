"""A chaos worker, run as a child process: ``python -m tests.chaos.worker '<json config>'``.

It competes with the other workers for a few keys with ``hold``, and while it holds
one it writes to two registers with its fencing token: ``lease.put`` into etcd and a
write to the register outside etcd (sent even when its own clock says the tenure is
over, as a paused process would: the register must refuse it). Each tenure ends by
a release or, now and then, a transfer to ``<name>-heir``, then the key is read back.
Every operation goes to a JSONL file, one line each, flushed (see checker.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from etcd_leases import EtcdLeaseProvider, HeldLease, LeaseError, LeaseHeld, LeaseLost
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb
from tests.chaos import register
from tests.stall import SentWrites, every_tenure_lost

WAIT_FOR_KEY = 3.0  # seconds a worker waits for a taken key before trying another


@dataclass(frozen=True)
class Config:
    endpoints: list[str]
    prefix: str
    name: str
    keys: list[str]
    register_port: int
    log_path: str
    ttl_ms: int
    seconds: float
    seed: int


class Worker:
    def __init__(self, config: Config, provider: EtcdLeaseProvider, log: TextIO) -> None:
        self.config = config
        self.provider = provider
        self.log = log
        self.random = random.Random(config.seed)
        self.stop = asyncio.Event()
        #: The tenure under way and the etcd lease its key was put on, once read.
        self.held: list[tuple[HeldLease, int]] = []

    def record(self, op: str, key: str, token: int | None, **fields: Any) -> None:
        line = {"op": op, "worker": self.config.name, "key": key, "token": token, **fields}
        self.log.write(json.dumps(line) + "\n")
        self.log.flush()

    async def run(self) -> None:
        deadline = time.monotonic() + self.config.seconds
        while time.monotonic() < deadline and not self.stop.is_set():
            key = self.random.choice(self.config.keys)
            start = time.monotonic()
            try:
                await self.tenure(key, start)
            except LeaseHeld:
                self.record("acquire", key, None, start=start, end=time.monotonic(), outcome="held")
            except LeaseError as exc:
                outcome = f"error: {type(exc).__name__}: {exc}"
                self.record("tenure", key, None, start=start, end=time.monotonic(), outcome=outcome)
            await asyncio.sleep(self.random.uniform(0, 0.2))

    async def tenure(self, key: str, start: float) -> None:
        # Until its lease is read, a revoke may end the new tenure: none is excused.
        self.held = []
        hold = self.provider.hold(key, self.config.name, self.config.ttl_ms, wait=WAIT_FOR_KEY)
        async with hold as lease:
            end = time.monotonic()
            lease_id = await self.lease_of(key, lease.token)
            self.held = [(lease, lease_id)]
            self.record(
                "acquire", key, lease.token, start=start, end=end, outcome="ok", lease=lease_id
            )
            watching = asyncio.create_task(self.watch_loss(lease))
            await self.work(lease)
            if self.random.random() < 0.15:
                await self.transfer(lease)
            else:
                await self.release(lease)
        await asyncio.wait_for(watching, 5)

    async def lease_of(self, key: str, token: int) -> int:
        """The etcd lease the tenure's put carried (0 if unknown): the checker excuses
        etcd bug 15247 only for a lease this library never revoked. Read as of the
        put's revision, since the key may be gone already (the bug deletes it early)."""
        request = pb.RangeRequest(key=self.provider.etcd_key(key), revision=token)
        try:
            found = await self.provider.client.call(
                "/etcdserverpb.KV/Range", request, pb.RangeResponse
            )
        except LeaseError:  # compacted past the put, say: unknown
            return 0
        kvs = [kv for kv in found.kvs if kv.mod_revision == token]
        return kvs[0].lease if kvs else 0

    async def release(self, lease: HeldLease) -> None:
        """Release with the contract's call, whose return is the acknowledgement (the
        block's exit then finds the key free; it never says whether its own release
        happened)."""
        start = time.monotonic()
        try:
            await self.provider.release_lease(lease.key, self.config.name)
            outcome = "ok"
        except LeaseError as exc:
            outcome = f"error: {type(exc).__name__}: {exc}"
        end = time.monotonic()
        self.record("release", lease.key, lease.token, start=start, end=end, outcome=outcome)
        if outcome == "ok":
            owner = await self.provider.get_lease_owner(lease.key)
            self.record("read_owner", lease.key, lease.token, after="release", owner=owner, to=None)

    async def work(self, lease: HeldLease) -> None:
        key, token = lease.key, lease.token
        for seq in range(self.random.randint(2, 6)):
            # The time first: if the process is frozen in between, remaining() is read late.
            start = time.monotonic()
            remaining = lease.remaining()
            accepted = await register.write(
                self.config.register_port, key, token, self.config.name, seq
            )
            outcome = "ok" if accepted else "rejected"
            self.record(
                "ext_write", key, token, start=start, end=time.monotonic(),
                remaining=remaining, outcome=outcome, seq=seq,
            )  # fmt: skip
            start = time.monotonic()
            remaining = lease.remaining()
            value = json.dumps({"worker": self.config.name, "token": token, "seq": seq})
            try:
                outcome = (
                    "ok"
                    if await lease.put(self.config.prefix + "register/" + key, value)
                    else "rejected"
                )
            except LeaseError as exc:
                outcome = f"error: {type(exc).__name__}: {exc}"
            self.record(
                "etcd_write", key, token, start=start, end=time.monotonic(),
                remaining=remaining, outcome=outcome, seq=seq,
            )  # fmt: skip
            if remaining <= 0:
                return
            await asyncio.sleep(self.random.uniform(0.05, 0.25))

    async def transfer(self, lease: HeldLease) -> None:
        if lease.lost.is_set():
            return
        heir, start = self.config.name + "-heir", time.monotonic()
        try:
            await lease.transfer(heir)
            outcome = "ok"
        except LeaseLost:
            outcome = "lost"
        end = time.monotonic()
        self.record(
            "transfer", lease.key, lease.token, start=start, end=end, outcome=outcome, to=heir
        )
        if outcome == "ok":
            owner = await self.provider.get_lease_owner(lease.key)
            self.record(
                "read_owner", lease.key, lease.token, after="transfer", owner=owner, to=heir
            )

    async def watch_loss(self, lease: HeldLease) -> None:
        """Record when the tenure ends, and what the holder's own clock still promised."""
        deadline = time.monotonic() + lease.remaining()
        while not lease.lost.is_set():
            now, remaining = time.monotonic(), lease.remaining()
            if remaining > 0:
                deadline = now + remaining
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lease.lost.wait(), 0.05)
        self.record(
            "lost", lease.key, lease.token, at=time.monotonic(),
            reason=lease.lost_reason or "", deadline=deadline,
        )  # fmt: skip


async def main(config: Config, log: TextIO) -> None:
    async with EtcdLeaseProvider(config.endpoints, prefix=config.prefix) as provider:
        worker = Worker(config, provider, log)
        prefix = provider.etcd_key("")

        def sent(what: str, which: int | bytes, at: float) -> None:
            # Every revoke and delete this worker's library sends, for the checker.
            if isinstance(which, bytes):
                key = which[len(prefix) :].decode(errors="replace")
                worker.record("sent_delete", key, None, at=at)
            else:
                op = "sent_revoke_after_loss" if what == "revoke after loss" else "sent_revoke"
                worker.record(op, "", None, at=at, lease=which)

        client = provider.client
        writes = SentWrites(
            listener=sent, known_lost=lambda lease_id: every_tenure_lost(worker.held, lease_id)
        )
        setattr(client, "call", writes.wrap(client.call))  # noqa: B010
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop.set)
        await worker.run()


if __name__ == "__main__":
    # The library's warnings (a release that could not be sent, ...) go to the .out file.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    config = Config(**json.loads(sys.argv[1]))
    with open(config.log_path, "a", encoding="utf-8") as log:
        asyncio.run(main(config, log))
