"""The server's version is read on connect; etcd bug 15247 is warned of, once a process."""

from __future__ import annotations

import logging

import pytest

from etcd_leases import EtcdLeaseProvider
from etcd_leases.etcd import version as version_module
from etcd_leases.etcd.version import has_bug_15247
from etcd_leases.testing import EtcdCluster, etcd_version


@pytest.mark.parametrize(
    ("version", "affected"),
    [
        ("3.3.27", True),
        ("3.4.23", True),
        ("3.4.30", True),
        ("3.4.31", False),
        ("3.5.1", True),
        ("3.5.12", True),
        ("3.5.13", False),
        ("3.6.0", False),
        ("not a version", False),
    ],
)
def test_versions_with_bug_15247(version: str, affected: bool) -> None:
    assert has_bug_15247(version) is affected


async def test_version_is_read_on_connect_and_warned_of_once(
    etcd: EtcdCluster,
    etcd_binary: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(version_module, "_warned", set())  # as in a new process
    version = etcd_version(etcd_binary)
    for _ in range(2):  # a second provider of the same process does not repeat it
        async with EtcdLeaseProvider(etcd.endpoints, prefix="/version-test/") as provider:
            for _ in range(3):
                await provider.get_lease_owner("k")
            assert provider.client.server_version == version
    warnings = [r for r in caplog.records if "bug 15247" in r.getMessage()]
    assert len(warnings) == (1 if has_bug_15247(version) else 0)
    assert all(r.levelno == logging.WARNING for r in warnings)
    # It names the version and the member that answered it.
    assert all(f"etcd {version} at {etcd.endpoints[0]} has" in r.getMessage() for r in warnings)
