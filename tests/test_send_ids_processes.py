"""Idempotent sends across processes: retriers in three processes send the same ids,
a worker process serves; each id is stored, and handled, exactly once."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from pathlib import Path

from etcd_leases.testing import EtcdCluster
from tests.conftest import unique_prefix
from tests.test_threads_processes import processes, read_history

IDS = 60
RETRIERS = 3


async def test_a_send_id_is_stored_and_handled_once_across_processes(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    with processes(",".join(etcd.endpoints), unique_prefix(), tmp_path) as procs:
        procs.start("worker", "worker")
        for i in range(RETRIERS):
            procs.start("retrier", f"retrier-{i}", str(IDS))
        deadline = time.monotonic() + 120
        while True:
            history = read_history(tmp_path)
            done = sum(r["ev"] == "done" for r in history)
            handled = {r["payload"] for r in history if r["ev"] == "acked"}
            if done == RETRIERS and len(handled) == IDS:
                break
            assert time.monotonic() < deadline, f"{done} retriers done, {len(handled)} handled"
            await asyncio.sleep(0.2)
    sends = [r for r in history if r["ev"] == "sent"]
    assert len(sends) == 2 * IDS * RETRIERS
    stored = Counter(r["send_id"] for r in sends if not r["duplicate"])
    assert stored == Counter({f"req-{i}": 1 for i in range(IDS)})
    seqs: dict[str, set[int]] = defaultdict(set)
    for r in sends:
        seqs[r["send_id"]].add(r["seq"])
    assert all(len(found) == 1 for found in seqs.values()), "a duplicate named another seq"
    handlings = Counter(r["payload"] for r in history if r["ev"] == "handled")
    assert set(handlings.values()) == {1}, "an id handled twice"
