"""A recording client in a process of its own.

``python -m tests.linearizability.child '<json>'`` runs the standard tasks through one
:class:`EtcdLeaseProvider` from ``start_at`` to ``until`` (monotonic times, which the
processes of one machine share) and writes its history to ``out`` as JSON lines.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from etcd_leases import EtcdLeaseProvider
from tests.linearizability.workload import drive, standard_tasks


async def main(config: dict[str, Any]) -> None:
    await asyncio.sleep(max(0.0, config["start_at"] - time.monotonic()))
    async with EtcdLeaseProvider(
        config["endpoints"], prefix=config["prefix"], timeout=config["timeout"]
    ) as provider:
        tasks = standard_tasks(config["owners"], config["index"])
        history = await drive({config["name"]: (provider, tasks)}, config["until"], config["seed"])
    history.dump(config["out"])


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
