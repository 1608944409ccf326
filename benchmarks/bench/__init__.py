"""Benchmark of etcd_leases against the floor (bare gRPC) and its peers, on a real etcd.

    python -m benchmarks.bench [--quick] [--out DIR] [--endpoints HOST:PORT]

Prints tables of figures and ratios and writes ``results.json``, ``results.md`` and
``results.png`` into ``--out``. It asserts no timing; it exits 1 only when a
correctness check fails (two winners of a race, a free key not taken...).

Modules: ``config`` (sizes), ``stats``, ``etcd_metrics`` (raft writes and requests
from etcd's /metrics), ``floor`` (bare gRPC), ``calls`` (each contract call against
the floor), ``peers/`` (one module per client compared), ``cycles`` (sequential and
concurrent acquire+release), ``keepalive`` and ``hogs`` (held leases, idle and
loaded host), ``takeover`` (and the race check), ``goals`` (issue 9's targets),
``report`` and ``chart`` (the output files), ``hotpaths`` (workloads to profile).
"""
