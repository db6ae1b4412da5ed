"""``python -m bench.overshoot``: how far fast enforcement overshoots a hard limit across nodes.

Three nodes on one redis-server and one DynamoDB Local table, gossip tick ``T``. A hard limit
``L`` is set on one counter, the counter is warm on every node, then every node is driven by
client threads tracking 1 unit at a time as fast as they can until their node refuses; the
units acknowledged beyond ``L`` are the overshoot. docs/quotas.md bounds it by
``(N - 1) * r * (T + d)`` (``r`` the per-node admission rate, ``d`` the bus delivery time) and
by ``(N - 1) * L``; the run prints both beside the measurement.

Usage: ``python -m bench.overshoot [--ticks 25,100,1000] [--limit 20000] [--clients 2]``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

from bench.scale import cluster_env, start_cluster, status
from bench.services import Services
from tests.cluster_harness import Conn
from tests.nodes import NodeProcess

TENANT, FEATURE = "acme", "api"


def _drive(node: NodeProcess, go: threading.Event, out: list[int], i: int) -> None:
    """Track 1 unit at a time until the node refuses; ``out[i]`` = units acknowledged."""
    conn = Conn(node.socket)
    n = 0
    try:
        go.wait()
        while True:
            error, _ = conn.call("track", TENANT, FEATURE, 1)
            if error is not None:
                if error["code"] != "limit_exceeded":
                    raise RuntimeError(f"unexpected error {error}")
                break
            n += 1
    finally:
        out[i] = n
        conn.close()


def measure(tick_ms: int, limit: int, clients: int, n_nodes: int = 3) -> dict[str, Any]:
    """One run at one tick; the overshoot and the bound's terms."""
    with Services() as svc:
        _, env, _ = cluster_env(svc, f"over{tick_ms}")
        env["METER_GOSSIP_INTERVAL_MS"] = str(tick_ms)
        nodes = start_cluster(svc, [f"o{i}" for i in range(n_nodes)], env)
        for p in nodes:
            p.call("track", TENANT, FEATURE, 0)  # warm (seeded) on every node
        version = nodes[0].call("set_limit", TENANT, FEATURE, {"limit": limit})["version"]
        deadline = time.monotonic() + 10
        while not all(p.call("limits", TENANT)["version"] >= version for p in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the limit did not reach every node")
            time.sleep(0.01)
        go = threading.Event()
        acked = [0] * (n_nodes * clients)
        threads = [
            threading.Thread(target=_drive, args=(nodes[i % n_nodes], go, acked, i))
            for i in range(n_nodes * clients)
        ]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        go.set()
        for t in threads:
            t.join(120)
        elapsed = time.monotonic() - t0
        total = sum(acked)
        per_node = [sum(acked[i::n_nodes]) for i in range(n_nodes)]
        # Views converge on the true total (every acknowledged unit, gossiped).
        deadline = time.monotonic() + 10
        while not all(p.call("usage", TENANT, FEATURE) == total for p in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("views did not converge on the acknowledged total")
            time.sleep(0.01)
        lags = [
            peer.get("lag_p99_ms") or 0.0
            for p in nodes
            for peer in (status(p)["cluster"].get("peers") or {}).values()
        ]
        d_s = (max(lags) if lags else 0.0) / 1000
        rate = total / n_nodes / elapsed if elapsed > 0 else 0.0
        bound = min((n_nodes - 1) * rate * (tick_ms / 1000 + d_s), (n_nodes - 1) * limit)
        for p in nodes:
            svc.stop_node(p)
        return {
            "nodes": n_nodes,
            "tick_ms": tick_ms,
            "limit": limit,
            "clients_per_node": clients,
            "admitted": total,
            "admitted_per_node": per_node,
            "overshoot": total - limit,
            "seconds": round(elapsed, 3),
            "rate_per_node": round(rate),
            "d_ms": round(d_s * 1000, 1),
            "bound": round(bound),
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overshoot", description=__doc__)
    p.add_argument("--ticks", default="25,100,1000", help="gossip ticks in ms, comma-separated")
    p.add_argument("--limit", type=int, default=20_000)
    p.add_argument("--clients", type=int, default=2, help="client threads per node")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [measure(int(t), args.limit, args.clients) for t in args.ticks.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'tick ms':>8} {'admitted':>9} {'overshoot':>9} {'rate/node':>9} {'d ms':>6} "
          f"{'bound':>7}  per node")  # fmt: skip
    for r in rows:
        print(f"{r['tick_ms']:>8} {r['admitted']:>9} {r['overshoot']:>9} {r['rate_per_node']:>9} "
              f"{r['d_ms']:>6} {r['bound']:>7}  {r['admitted_per_node']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
