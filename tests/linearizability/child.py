"""A recording client in a process of its own.

``python -m tests.linearizability.child '<json>'`` runs the standard tasks through one
:class:`EtcdLeaseProvider` from ``start_at`` to ``until`` (monotonic times, which the
processes of one machine share), with ``recipes`` also two holders and an election
candidate on the same provider (:mod:`tests.linearizability.recipes`), and writes its
history to ``out`` as JSON lines.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from etcd_leases import EtcdLeaseProvider
from tests.linearizability.history import History
from tests.linearizability.recipes import drive_recipes
from tests.linearizability.workload import drive, standard_tasks


async def main(config: dict[str, Any]) -> None:
    await asyncio.sleep(max(0.0, config["start_at"] - time.monotonic()))
    name, until, seed = config["name"], config["until"], config["seed"]
    history = History()
    async with EtcdLeaseProvider(
        config["endpoints"], prefix=config["prefix"], timeout=config["timeout"]
    ) as provider:
        tasks = standard_tasks(config["owners"], config["index"])
        calls = drive({name: (provider, tasks)}, until, seed, history)
        if config.get("recipes"):
            await asyncio.gather(calls, drive_recipes(provider, history, name, until, seed))
        else:
            await calls
    history.dump(config["out"])


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
