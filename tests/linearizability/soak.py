"""A recorded run: child processes drive the workload while members are faulted.

Also the long check, from the repository's root::

    python -m tests.linearizability.soak --seconds 300 --runs 5 [--shared-owners]
        [--binary /usr/bin/etcd] [--no-faults] [--no-recipes] [--call-timeout 2]
        [--keep DIR]

Each run starts a three-member cluster (in network namespaces, for partitions, when
run as root), records every call of three processes (the plain calls, and those of
``hold``, ``adopt`` and an election, with each holder's belief that it holds), checks
the history and prints a violation's printout (see ``report``); it exits 1 if any run
was not linearizable (or could not be decided in time). ``--keep`` writes the
histories of such runs as JSON lines, which ``History.load`` reads back to check again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from etcd_leases.etcd.version import has_bug_15247
from etcd_leases.testing import EtcdCluster, etcd_version
from tests.chaos.partitions import Partitions
from tests.chaos.test_chaos import network
from tests.linearizability.checker import CheckResult, check
from tests.linearizability.faults import Fault, Nemesis, stall_spans
from tests.linearizability.history import History
from tests.linearizability.report import explain
from tests.linearizability.workload import TTLS_MS

STARTUP = 3.0  # s the children get to import and connect before the run begins
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Run:
    history: History
    faults: list[Fault]
    result: CheckResult
    began: float

    def summary(self) -> str:
        lost = sum(not op.answered for op in self.history.ops)
        return (
            f"{len(self.history.ops)} calls, {lost} without an answer, "
            f"{len(self.faults)} faults; linearizable: {self.result.ok}; "
            f"keys so only with bug 15247's early expiries: {list(self.result.early)}"
        )

    def fault_times(self) -> str:
        """Each fault, the member (or worker pid) it struck, and its span (s from the
        run's start): a violation is read beside them."""
        return "\n".join(
            f"  {fault.kind} {fault.member}: {fault.start - self.began:.3f} - "
            f"{fault.heal - self.began:.3f}"
            for fault in self.faults
        )


async def _start_children(
    cluster: EtcdCluster,
    owners: Sequence[Sequence[str]],
    start_at: float,
    until: float,
    out: Path,
    call_timeout: float,
    recipes: bool,
) -> list[asyncio.subprocess.Process]:
    endpoints, prefix = cluster.endpoints, f"/lin-{time.time_ns()}/"
    children = []
    for index, its_owners in enumerate(owners):
        config = {
            "endpoints": endpoints[index:] + endpoints[:index],
            "prefix": prefix,
            "timeout": call_timeout,
            "name": f"p{index}",
            "owners": list(its_owners),
            "index": index,
            "start_at": start_at,
            "until": until,
            "seed": int(start_at),
            "out": str(out / f"p{index}.jsonl"),
            "recipes": recipes,
        }
        children.append(
            await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.linearizability.child", json.dumps(config), cwd=ROOT
            )
        )
    return children


async def _histories(children: list[asyncio.subprocess.Process], out: Path) -> History:
    try:
        codes = [await child.wait() for child in children]
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
    assert codes == [0] * len(children), f"a child failed: {codes}"
    history = History()
    for index in range(len(children)):
        history.load(str(out / f"p{index}.jsonl"))
    return history


async def recorded_run(
    cluster: EtcdCluster,
    binary: str,
    owners: Sequence[Sequence[str]],
    seconds: float,
    out: Path,
    faults: bool = True,
    call_timeout: float = 2.0,
    partitions: Partitions | None = None,
    recipes: bool = False,
) -> Run:
    """One process per entry of ``owners`` (calling as those owners) for ``seconds``;
    with ``recipes`` each also holds keys and campaigns (see ``recipes``). Faults: the
    members' (with ``partitions``, the cluster's namespaces, partitions too) and the
    processes frozen past their TTLs."""
    start_at = time.monotonic() + STARTUP
    until = start_at + seconds
    children = await _start_children(cluster, owners, start_at, until, out, call_timeout, recipes)
    pids = [child.pid for child in children]
    nemesis = Nemesis(cluster, int(start_at), partitions, pids, max(TTLS_MS) / 1000)

    async def inject() -> None:
        await asyncio.sleep(STARTUP)
        if faults:
            await nemesis.run(until)

    history, _ = await asyncio.gather(_histories(children, out), inject())
    spans = stall_spans(nemesis.faults) if has_bug_15247(etcd_version(binary)) else []
    result = check(history, timeout=30, early=spans)
    return Run(history, nemesis.faults, result, start_at)


@contextlib.contextmanager
def partitioned_cluster(binary: str | None) -> Iterator[tuple[EtcdCluster, Partitions | None]]:
    """Three members, each in a network namespace of its own where this machine allows
    it (root and ``ip``; ``ETCD_LEASES_REQUIRE_PARTITIONS=1`` makes it a must), so that
    runs partition them; else on 127.0.0.1, said loudly."""
    with network(3) as (partitions, where):
        if partitions is None:
            print(f"!!! NO NETWORK PARTITIONS IN THIS RUN: {where} !!!", flush=True)
        with EtcdCluster(
            3,
            binary=binary,
            hosts=partitions.hosts if partitions else (),
            command_prefixes=partitions.command_prefixes if partitions else (),
        ) as cluster:
            yield cluster, partitions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--binary", default=None, help="etcd binary (default: found on PATH)")
    parser.add_argument("--shared-owners", action="store_true", help="same owner ids everywhere")
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--no-recipes", action="store_true", help="no hold, adopt or election")
    parser.add_argument("--call-timeout", type=float, default=2.0, help="the providers' timeout")
    parser.add_argument("--keep", type=Path, help="write each failed run's history here")
    args = parser.parse_args()
    own = [[f"p{index}-o{number}" for number in range(3)] for index in range(3)]
    owners = [["o0", "o1", "o2"]] * 3 if args.shared_owners else own
    failed = 0
    for number in range(args.runs):
        with (
            partitioned_cluster(args.binary) as (cluster, partitions),
            tempfile.TemporaryDirectory() as out,
        ):
            run = asyncio.run(
                recorded_run(
                    cluster,
                    cluster.binary,
                    owners,
                    args.seconds,
                    Path(out),
                    not args.no_faults,
                    args.call_timeout,
                    partitions,
                    not args.no_recipes,
                )
            )
        print(f"run {number}: {run.summary()}", flush=True)
        if run.result.ok is not True:
            failed += 1
            print(f"faults:\n{run.fault_times()}", flush=True)
            print(explain(run.result, origin=run.began), flush=True)
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                run.history.dump(str(args.keep / f"run{number}.jsonl"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
