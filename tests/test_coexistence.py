"""Our generated messages live beside another etcd client's in one process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from etcd_leases.testing import EtcdCluster

SCRIPT = """
import asyncio, sys
{imports}

async def main(host, port):
    other = etcd3.client(host=host, port=int(port))
    other.put("/other/plain", "from-etcd3")
    async with etcd_leases.EtcdLeaseProvider(f"{{host}}:{{port}}", prefix="/mix/") as ours:
        result = await ours.acquire_lease("job", "worker-1", 5000)
        assert result.acquired, result
    value, meta = other.get("/mix/job")
    assert value == b"worker-1", value
    assert other.get("/other/plain")[0] == b"from-etcd3"
    other.delete("/mix/job")
    print("both clients work")

asyncio.run(main(*sys.argv[1].split(":")))
"""


@pytest.mark.parametrize(
    "imports",
    ["import etcd3\nimport etcd_leases", "import etcd_leases\nimport etcd3"],
    ids=["etcd3-first", "etcd_leases-first"],
)
def test_imports_and_works_beside_python_etcd3(etcd: EtcdCluster, imports: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(imports=imports), etcd.endpoints[0]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "both clients work" in done.stdout
