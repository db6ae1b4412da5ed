"""Scenario 14, last part (issue 27): gossip on a Redis Cluster against one redis-server.

Two fleets of 3 real nodes each, on tables of the run's DynamoDB Local and the same sharded
gossip (``gossip_shards`` :data:`SHARDS`): one on the run's redis-server, the other on a Redis
Cluster of 3 masters with a replica each (:class:`~tests.support.redis_cluster.RedisCluster`,
sharded pub/sub). Rounds alternate between them; each times how long a unit tracked on one node
takes to show on the other two (:func:`~tests.support.cluster_harness.measure_visibility`). The
row is the cluster's p99 over the single server's, every round's samples pooled.
"""

from __future__ import annotations

import time
from typing import Any

from bench.harness import Progress, Row, Services, Sizes, cpu_seconds, percentile
from bench.scale import cluster_env, start_cluster
from tests.support.cluster_harness import measure_visibility
from tests.support.nodes import NodeProcess
from tests.support.redis_cluster import RedisCluster

SCENARIO = "14 gossip fan-out (simulated peers)"
SHARDS = 8
#: The issue's bound on the cluster's convergence p99 against one server's.
BOUND = 1.2


def cluster_rows(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    fs = sizes.fanout
    tick_s = fs.tick_ms / 1000
    got: dict[str, list[float]] = {"server": [], "cluster": []}
    anomalies: dict[str, list[Any]] = {"server": [], "cluster": []}
    #: The fleet's CPU seconds and the wall seconds of its rounds (what the polls cost too).
    cpu: dict[str, list[float]] = {"server": [0.0, 0.0], "cluster": [0.0, 0.0]}
    fleets: dict[str, list[NodeProcess]] = {}
    with RedisCluster(svc.workdir / "redis-cluster") as rc:
        rc.start()
        progress(f"a Redis Cluster of 3 masters + 3 replicas started in {rc.start_seconds:.1f} s")
        try:
            for name, extra in (
                ("server", {}),
                ("cluster", {"METER_REDIS_URL": "", "METER_REDIS_CLUSTER_NODES": rc.nodes_arg}),
            ):
                _, env, _ = cluster_env(svc, f"rc{name}")
                env.update(METER_GOSSIP_SHARDS=str(SHARDS),
                           METER_GOSSIP_INTERVAL_MS=str(fs.tick_ms), **extra)  # fmt: skip
                fleets[name] = start_cluster(svc, [f"rc{name}{i}" for i in range(3)], env)
            for r in range(fs.cluster_rounds):
                for name in ("server", "cluster") if r % 2 == 0 else ("cluster", "server"):
                    pids = [p.proc.pid for p in fleets[name] if p.proc is not None]
                    cpu0, t0 = sum(cpu_seconds(pid) for pid in pids), time.monotonic()
                    m = measure_visibility(fleets[name], "rc", fs.cluster_samples, tick_s)
                    cpu[name][0] += sum(cpu_seconds(pid) for pid in pids) - cpu0
                    cpu[name][1] += time.monotonic() - t0
                    got[name] += m["latencies_ms"]
                    anomalies[name] += m["anomalies"]
                    progress(f"3 nodes on the {name}: p99 {m['p99_ms']:.0f} ms (round {r + 1})")
        finally:
            for nodes in fleets.values():
                for p in nodes:
                    svc.stop_node(p)
    server, cluster = percentile(got["server"], 99), percentile(got["cluster"], 99)
    ratio = cluster / server
    detail = {
        "shards": SHARDS,
        "tick_ms": fs.tick_ms,
        "samples": {k: len(v) for k, v in got.items()},
        "p50_ms": {k: round(percentile(v, 50), 2) for k, v in got.items()},
        "anomalies": anomalies,
        "node_cpu_share": {k: round(c / w / 3 * 100, 1) for k, (c, w) in cpu.items() if w},
    }
    sound = not anomalies["server"] and not anomalies["cluster"]
    return [
        Row(SCENARIO, f"convergence p99, 3 nodes on a Redis Cluster vs on one redis-server, "
            f"K = {SHARDS}", "ms", cluster, server, ratio, f"<= {BOUND}x",
            sound and ratio <= BOUND, detail),
    ]  # fmt: skip
