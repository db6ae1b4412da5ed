"""Measure gossip convergence with real nodes (a helper for ``bench/``, not a test).

``measure(n_nodes, ticks, samples)`` starts its own redis-server and DynamoDB Local on free
loopback ports, creates a table, starts ``n_nodes`` real ``meter serve`` processes with a gossip
interval of ``ticks`` ms, and times how long a tracked unit takes to be visible on every other
node. Returns ``{"p50_ms", "p99_ms", "max_ms", "samples", "tick_ms", "nodes", "anomalies"}``.

    .venv/bin/python -m tests.support.measure_convergence [n_nodes] [tick_ms] [samples]
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import uuid
from typing import Any

from storage.dynamodb import DynamoDBStorage
from tests.support.cluster_harness import measure_visibility, node_env, start_nodes
from tests.support.dynamodb_local import DynamoDBLocal, ensure_installed
from tests.support.nodes import NodeProcess, short_tmpdir
from tests.support.redis_server import RedisServer


async def _create_table(endpoint: str, name: str) -> None:
    store = DynamoDBStorage(name, endpoint_url=endpoint)
    await store.open()
    try:
        await store.init_schema()
    finally:
        await store.close()


def measure(n_nodes: int = 3, ticks: int = 100, samples: int = 200) -> dict[str, Any]:
    """p50/p99 (ms) from ``track`` on one node to the unit being visible on all the others."""
    workdir = short_tmpdir("mconv-")
    nodes: list[NodeProcess] = []
    with RedisServer() as redis_server, DynamoDBLocal(ensure_installed()) as ddb:
        table = f"meter_conv_{uuid.uuid4().hex[:8]}"
        asyncio.run(_create_table(ddb.endpoint, table))
        env = node_env(
            redis_url=redis_server.url,
            dynamodb_endpoint=ddb.endpoint,
            table=table,
            cluster=f"conv-{uuid.uuid4().hex[:8]}",
            METER_GOSSIP_INTERVAL_MS=str(ticks),
            METER_FLUSH_INTERVAL_MS="1000",
            METER_LOG_LEVEL="WARNING",
        )
        try:
            nodes = start_nodes(workdir, n_nodes, env)
            result = measure_visibility(nodes, "conv", samples, ticks / 1000)
        finally:
            for p in nodes:
                p.stop()
            shutil.rmtree(workdir, ignore_errors=True)
    result["tick_ms"] = ticks
    result["nodes"] = n_nodes
    result["target_p99_ms"] = ticks + 20
    return result


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:4]]
    print(json.dumps(measure(*args), indent=2))
