"""etcd unreachable for a while: finished work is kept, observers survive, users are told.

Each test freezes (SIGSTOP) its own single-member etcd (issue 6, defects 4 and 6).
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from etcd_leases import Election, EtcdLeaseProvider, HeldLease, LeaseError
from etcd_leases.testing import EtcdCluster
from etcd_leases.threads import ThreadMessages, Threads
from tests.conftest import eventually


async def test_leaving_a_hold_while_etcd_is_frozen_does_not_raise(
    etcd_binary: str, caplog: pytest.LogCaptureFixture
) -> None:
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        async with EtcdLeaseProvider(etcd.endpoints, timeout=1.0) as provider:
            async with provider.hold("job", "alice", 10_000) as lease:
                etcd.members[0].pause()
                # The work finishes inside the tenure; only the release cannot get through.
                assert lease.remaining() > 0
            etcd.members[0].resume()
            assert lease.lost.is_set()
    assert any(
        record.levelno == logging.WARNING and "could not release 'job'" in record.getMessage()
        for record in caplog.records
    )


async def test_new_leader_callbacks_survive_an_outage_as_run_starts(etcd_binary: str) -> None:
    """The observer's first read failed and it died for good: no callback ever fired."""
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        async with EtcdLeaseProvider(etcd.endpoints, timeout=1.0) as provider:
            leaders: asyncio.Queue[str | None] = asyncio.Queue()

            async def lead(lease: HeldLease) -> None:
                await asyncio.Event().wait()

            etcd.members[0].pause()
            runner = asyncio.create_task(
                Election(provider, "seat", "alice", 2000).run(lead, on_new_leader=leaders.put)
            )
            try:
                await asyncio.sleep(2.5)
                etcd.members[0].resume()
                deadline = time.monotonic() + 15
                while (await asyncio.wait_for(leaders.get(), 15)) != "alice":
                    assert time.monotonic() < deadline
            finally:
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)


async def test_a_candidate_logs_while_etcd_is_unreachable(
    etcd_binary: str, caplog: pytest.LogCaptureFixture
) -> None:
    """It retried for 30 s without a word: the user must learn of trouble from logs."""
    caplog.set_level(logging.INFO, logger="etcd_leases")
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        async with EtcdLeaseProvider(etcd.endpoints, timeout=0.5) as provider:
            etcd.members[0].pause()
            stop = asyncio.Event()

            async def lead(lease: HeldLease) -> None:
                stop.set()

            runner = asyncio.create_task(
                Election(provider, "seat", "alice", 2000).run(lead, stop=stop)
            )
            try:
                await asyncio.sleep(2.0)
                warnings = [
                    r.getMessage()
                    for r in caplog.records
                    if r.name.startswith("etcd_leases") and r.levelno == logging.WARNING
                ]
                assert any("'seat'" in message for message in warnings), warnings
                etcd.members[0].resume()
                await asyncio.wait_for(runner, 15)  # it leads once etcd is back
            finally:
                etcd.members[0].resume()
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)


async def test_a_lost_lease_and_the_silence_before_are_logged(
    etcd_binary: str, caplog: pytest.LogCaptureFixture
) -> None:
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        async with (
            EtcdLeaseProvider(etcd.endpoints, timeout=1.0) as provider,
            provider.hold("job", "alice", 2000) as lease,
        ):
            etcd.members[0].pause()
            try:
                await asyncio.wait_for(lease.lost.wait(), 10)
                await eventually(  # the loss's log line, from the lease's own task
                    lambda: any("'alice' lost 'job'" in r.getMessage() for r in caplog.records),
                    "the loss logged",
                )
            finally:
                etcd.members[0].resume()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("etcd has answered no keep-alive for" in message for message in warnings), warnings
    assert any(
        "'alice' lost 'job'" in message and "deadline passed" in message for message in warnings
    ), warnings


async def test_a_serving_worker_runs_a_thread_again_once_etcd_is_back(
    etcd_binary: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A run that failed for want of etcd (its handler's own read, here) is tried again
    by the worker, unprompted: the message is not left until someone wakes the thread."""
    with EtcdCluster(1, binary=etcd_binary) as etcd:
        async with EtcdLeaseProvider(etcd.endpoints, timeout=1.0) as provider:
            acked: list[str] = []
            reads_failed: list[LeaseError] = []

            async def reads_etcd(thread: str, lease: HeldLease, messages: ThreadMessages) -> None:
                async for message in messages:
                    if not reads_failed:
                        etcd.members[0].pause()
                        try:
                            await provider.get_lease_owner("elsewhere")
                        except LeaseError as exc:
                            reads_failed.append(exc)
                            raise
                        finally:
                            etcd.members[0].resume()
                    await messages.ack(message)
                    acked.append(message.text)

            threads = Threads(provider, reads_etcd, ttl_ms=10_000)
            await threads.send("t", "m")
            stop = asyncio.Event()
            serving = asyncio.create_task(threads.serve(stop))
            try:
                await eventually(lambda: acked == ["m"], "the message ran again", timeout=20)
            finally:
                etcd.members[0].resume()
                stop.set()
                await serving
    assert len(reads_failed) == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "etcd_leases.threads"]
    assert any("'t'" in w and "trying again" in w for w in warnings), warnings
