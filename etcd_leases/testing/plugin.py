"""The pytest plugin (``pytest11`` entry point ``etcd_leases.testing.plugin``): fixtures.

``etcd_binary`` (session)
    The etcd binary used by the other fixtures; :func:`find_etcd_binary` by default.
    Override it in a ``conftest.py`` (for example parametrized over
    :func:`find_etcd_binaries`) to run against other versions.
``etcd_member`` (session)
    A started one-member :class:`EtcdCluster`, shared by the whole session.
``etcd_cluster`` (function)
    A fresh three-member :class:`EtcdCluster` for every test, so that faults
    injected by one test (killed or paused members) cannot leak into the next.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from etcd_leases.testing.binaries import find_etcd_binary
from etcd_leases.testing.cluster import EtcdCluster


@pytest.fixture(scope="session")
def etcd_binary() -> str:
    """The etcd binary used by the other fixtures (:func:`find_etcd_binary`)."""
    return find_etcd_binary()


@pytest.fixture(scope="session")
def etcd_member(etcd_binary: str) -> Iterator[EtcdCluster]:
    """A started one-member :class:`EtcdCluster`, shared by the session."""
    with EtcdCluster(1, binary=etcd_binary) as cluster:
        yield cluster


@pytest.fixture
def etcd_cluster(etcd_binary: str) -> Iterator[EtcdCluster]:
    """A fresh, started three-member :class:`EtcdCluster` for each test."""
    with EtcdCluster(3, binary=etcd_binary) as cluster:
        yield cluster
