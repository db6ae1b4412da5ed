"""``python -m bench.overshoot``: how far fast enforcement overshoots a hard limit across nodes.

Three nodes on one redis-server and one DynamoDB Local table, gossip tick ``T``. A hard limit
``L`` is set on one counter, the counter is warm on every node, then every node is driven by
client threads tracking 1 unit at a time as fast as they can until their node refuses; the
units acknowledged beyond ``L`` are the overshoot. docs/quotas.md bounds it by
``(N - 1) * r * (T + d)`` (``r`` the per-node admission rate, ``d`` the bus delivery time) and
by ``(N - 1) * L``; the run prints both beside the measurement.

Usage: ``python -m bench.overshoot [--ticks 25,100,1000] [--limit 20000] [--clients 2] [--strict]``;
scenario 10 of ``python -m bench`` (:mod:`bench.quotas`) runs it beside its other rows.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

from bench.harness import Services, node_status
from bench.scale import cluster_env, start_cluster
from tests.support.cluster_harness import Conn
from tests.support.nodes import NodeProcess

TENANT, FEATURE = "acme", "api"
#: ``unavailable`` answers a client retries before it gives up (see :func:`_drive`).
MAX_RETRIES = 1000


def _drive(
    node: NodeProcess, go: threading.Event, out: list[int], i: int, retried: list[int]
) -> None:
    """Track 1 unit at a time until the node refuses; ``out[i]`` = units acknowledged.

    ``unavailable`` (a strict share that kept running out under the other clients' calls,
    nothing counted) is retried, at most :data:`MAX_RETRIES` times; ``retried[i]`` counts
    them."""
    conn = Conn(node.socket)
    n = 0
    try:
        go.wait()
        while True:
            error, _ = conn.call("track", TENANT, FEATURE, 1)
            if error is not None:
                if error["code"] == "unavailable" and retried[i] < MAX_RETRIES:
                    retried[i] += 1
                    continue
                if error["code"] != "limit_exceeded":
                    raise RuntimeError(f"unexpected error {error}")
                break
            n += 1
    finally:
        out[i] = n
        conn.close()


def measure(
    tick_ms: int,
    limit: int,
    clients: int,
    n_nodes: int = 3,
    *,
    enforcement: str = "fast",
    svc: Services | None = None,
) -> dict[str, Any]:
    """One run at one tick; the overshoot and the bound's terms. ``enforcement``: the
    limit's (``fast`` or ``strict``); ``svc``: the run's servers (else its own)."""
    if svc is None:
        with Services() as own:
            return measure(tick_ms, limit, clients, n_nodes, enforcement=enforcement, svc=own)
    _, env, _ = cluster_env(svc, f"over{tick_ms}")
    env["METER_GOSSIP_INTERVAL_MS"] = str(tick_ms)
    nodes = start_cluster(svc, [f"o{i}" for i in range(n_nodes)], env)
    try:
        return _burst(nodes, tick_ms, limit, clients, enforcement)
    finally:
        for p in nodes:
            svc.stop_node(p)


def _burst(
    nodes: list[NodeProcess], tick_ms: int, limit: int, clients: int, enforcement: str
) -> dict[str, Any]:
    n_nodes = len(nodes)
    for p in nodes:
        p.call("track", TENANT, FEATURE, 0)  # warm (seeded) on every node
    spec = {"limit": limit, "kind": "hard", "enforcement": enforcement}
    version = nodes[0].call("set_limit", TENANT, FEATURE, spec)["version"]
    deadline = time.monotonic() + 10
    while not all(p.call("limits", TENANT)["version"] >= version for p in nodes):
        if time.monotonic() > deadline:
            raise RuntimeError("the limit did not reach every node")
        time.sleep(0.01)
    strict0 = [node_status(p)["limits"]["strict"] for p in nodes]
    go = threading.Event()
    acked = [0] * (n_nodes * clients)
    retried = [0] * (n_nodes * clients)
    threads = [
        threading.Thread(target=_drive, args=(nodes[i % n_nodes], go, acked, i, retried))
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
    statuses = [node_status(p) for p in nodes]
    lags = [
        peer.get("lag_p99_ms") or 0.0
        for st in statuses
        for peer in (st["cluster"].get("peers") or {}).values()
    ]
    d_s = (max(lags) if lags else 0.0) / 1000
    rate = total / n_nodes / elapsed if elapsed > 0 else 0.0
    bound = min((n_nodes - 1) * rate * (tick_ms / 1000 + d_s), (n_nodes - 1) * limit)
    strict = {
        k: sum(st["limits"]["strict"][k] - s0[k] for st, s0 in zip(statuses, strict0, strict=True))
        for k in ("writes", "conflicts", "refused")
    }
    return {
        "nodes": n_nodes,
        "tick_ms": tick_ms,
        "limit": limit,
        "enforcement": enforcement,
        "clients_per_node": clients,
        "admitted": total,
        "admitted_per_node": per_node,
        "overshoot": total - limit,
        "seconds": round(elapsed, 3),
        "rate_per_node": round(rate),
        "d_ms": round(d_s * 1000, 1),
        "bound": round(bound),
        "retried_unavailable": sum(retried),
        "strict_writes": strict["writes"],
        "strict_conflicts": strict["conflicts"],
        "strict_refused": strict["refused"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overshoot", description=__doc__)
    p.add_argument("--ticks", default="25,100,1000", help="gossip ticks in ms, comma-separated")
    p.add_argument("--limit", type=int, default=20_000)
    p.add_argument("--clients", type=int, default=2, help="client threads per node")
    p.add_argument("--strict", action="store_true", help="a strict limit instead of a fast one")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    how = "strict" if args.strict else "fast"
    with Services() as svc:
        rows = [
            measure(int(t), args.limit, args.clients, enforcement=how, svc=svc)
            for t in args.ticks.split(",")
        ]
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
