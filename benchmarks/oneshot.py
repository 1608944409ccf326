"""The serverless one-shot alone: fresh processes of ours, python3-etcd3 and bare gRPC.

    python -m benchmarks.oneshot              # starts a throwaway one-member etcd
    python -m benchmarks.oneshot --rounds 40
    python -m benchmarks.oneshot --endpoints 127.0.0.1:2379

The same section ``python -m benchmarks.bench`` runs last (see
:mod:`benchmarks.bench.oneshot`). Prints figures; asserts no timing.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Sequence

from benchmarks.bench.checks import Checks
from benchmarks.bench.config import ONESHOT_ROUNDS
from benchmarks.bench.etcd_metrics import EtcdMetrics
from benchmarks.bench.oneshot import measure_oneshot
from benchmarks.bench.report import oneshot_table, print_table
from etcd_leases.testing import EtcdCluster


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.oneshot", description=__doc__)
    parser.add_argument("--rounds", type=int, default=ONESHOT_ROUNDS, help="interleaved rounds")
    parser.add_argument("--endpoints", help="use this running etcd (host:port, plain HTTP)")
    args = parser.parse_args(argv)
    prefix = f"/etcd-leases-bench/{uuid.uuid4().hex[:8]}/"
    checks = Checks()
    if args.endpoints:
        endpoint = args.endpoints.split(",")[0]
        results = measure_oneshot(endpoint, prefix, EtcdMetrics(endpoint), args.rounds, checks)
    else:
        with EtcdCluster(1) as cluster:
            endpoint = cluster.endpoint_string
            results = measure_oneshot(endpoint, prefix, EtcdMetrics(endpoint), args.rounds, checks)
    print_table(oneshot_table({"oneshot": results}))
    return 1 if checks.errors else 0


if __name__ == "__main__":
    sys.exit(main())
