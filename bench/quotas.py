"""Scenario 10, ``quotas``: what strict limits cost, and what fast limits overshoot.

Every part runs real node processes on one DynamoDB Local table per cluster and one
redis-server (the gossip bus), as scenario 8 and :mod:`bench.overshoot` do; the nodes' flush
is deferred as there (:data:`bench.scale.DEFERRED_FLUSH`), so the only storage writes during
a load are the strict budgets' (``status.limits.strict.writes``).

1. **Strict ``track`` throughput against fast, far from the limit**, on 1 node and on 3. Each
   side is one counter (``q-strict/f`` and ``q-fast/f``) with a hard limit of 10^15, strict
   on one and fast on the other, so a strict share is granted at ``strict_share_max`` and
   never nears the limit; every connection of the load generator (spread over the nodes)
   tracks 1 unit on its side's counter. Both sides run on the same nodes, in turn
   (alternating which goes first), after an unmeasured warm-up of each. A strict counter
   shared by every connection of every node is its worst case: every node writes the same
   budget record. Target: strict >= 0.8x fast.
2. **Storage writes per 1,000 admitted units** in strict mode: the strict writes of every
   node over the rounds above (renewals of leases included, as they happen during the fast
   side's turn too) per 1,000 units the strict counter gained; and for a burst of 3 nodes x
   ``burst_clients`` clients, each tracking 1 unit at a time until refused, to a strict limit
   of ``burst_limit`` (which must admit exactly the limit).
3. **Fast overshoot**: :func:`bench.overshoot.measure` on 3 nodes at each gossip tick of
   ``overshoot_ticks``, judged against the bound of docs/quotas.md, with AuroraMeter's
   published figures beside it; and the same burst under a strict limit (overshoot 0).
4. **Strict call latency near the limit** against the seeds' design (one conditional
   ``UpdateItem`` per call, a ``TransactWriteItems`` for the hierarchy), flat and
   hierarchical, side by side on the same DynamoDB Local (:mod:`bench.strict_latency`).
   Target: p99 and max at most 1.0x the seeds' design's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from bench.harness import (
    ALTERNATING,
    Progress,
    QuotaSizes,
    Row,
    Services,
    Sizes,
    in_turn,
    median,
    node_status,
    ratios,
)
from bench.loadgen import Load, LoadResult, run_load
from bench.overshoot import measure
from bench.scale import cluster_env, start_cluster
from bench.strict_latency import near_limit
from tests.support.nodes import NodeProcess

QUOTAS = "10 quotas (DynamoDB Local, 1 or 3 nodes)"
#: A limit the bench never nears: strict shares are granted at ``strict_share_max``.
FAR = 10**15
#: The two sides' counters (one each, shared by every connection).
STRICT_TENANT, FAST_TENANT, FEATURE = "q-strict", "q-fast", "f"
#: Credit-metered (1 credit a unit, 10^15 credits granted) against plain (no limit at all).
CREDIT_TENANT, PLAIN_TENANT = "q-credit", "q-plain"
#: Credit-metered throughput at least this many times plain (issue 10).
CREDIT_TARGET = 0.8
#: Strict throughput at least this many times fast.
THROUGHPUT_TARGET = 0.8
#: Seconds of unmeasured load on each side before the first round (seeding, first grants).
WARMUP_S = 1.0
#: What AuroraMeter publishes for its fast mode's overshoot (3 nodes: N - 1 = 2).
AURORA_1S = "(N-1) x limit at a 1 s tick"
AURORA_25MS = (880, 4_812)


#: Shortest measured round (see the throughput part).
MIN_ROUND_S = 0.5


def _set_limit(nodes: list[NodeProcess], tenant: str, spec: dict[str, Any]) -> None:
    """Set a limit through the first node and wait until every node enforces it."""
    version = nodes[0].call("set_limit", tenant, FEATURE, spec)["version"]
    deadline = time.monotonic() + 10
    while not all(p.call("limits", tenant)["version"] >= version for p in nodes):
        if time.monotonic() > deadline:
            raise RuntimeError("the limit did not reach every node")
        time.sleep(0.01)


def _usage(nodes: list[NodeProcess], tenant: str) -> int:
    """The counter's total once every node's view agrees (gossip delivered), or the largest
    view after 15 s: pub/sub is at-most-once and the flush is deferred here, so a frame lost
    on a loaded machine leaves one view short (resync reads storage, which does not hold the
    units yet) until the nodes stop; a view is never above the total (each node's own units
    are in its view, its peers' only once delivered)."""
    deadline = time.monotonic() + 15
    while True:
        views = {int(p.call("usage", tenant, FEATURE) or 0) for p in nodes}
        if len(views) == 1 or time.monotonic() > deadline:
            return max(views)
        time.sleep(0.02)


def _strict(nodes: list[NodeProcess]) -> dict[str, int]:
    """``status.limits.strict`` counters summed over the nodes."""
    out = dict.fromkeys(("writes", "conflicts", "refused", "errors"), 0)
    for p in nodes:
        st = node_status(p)["limits"]["strict"]
        for k in out:
            out[k] += int(st[k])
    return out


def _loads(nodes: list[NodeProcess]) -> Callable[[str, int, int, float], Load]:
    """A maker of loads tracking on one tenant's counter from connections spread over
    ``nodes``."""
    paths = [str(p.socket) for p in nodes]

    def load(tenant: str, conns: int, depth: int, seconds: float) -> Load:
        return Load(
            "meter", paths[0], "track", conns, depth, duration=seconds, tenant=tenant,
            paths=tuple(paths[1:]),
        )  # fmt: skip

    return load


def _warm_up(
    nodes: list[NodeProcess], tenants: tuple[str, str], what: str, progress: Progress
) -> None:
    """Unmeasured load on each side first (seeding, first grants or fundings)."""
    progress(f"quotas: {len(nodes)} node(s): warming up {what}")
    load = _loads(nodes)
    for tenant in tenants:
        run_load(load(tenant, max(len(nodes), 2), 1, WARMUP_S))


def _rounds(
    nodes: list[NodeProcess],
    tenants: tuple[str, str],
    what: str,
    shape: tuple[int, int],
    sizes: Sizes,
    progress: Progress,
) -> tuple[list[LoadResult], list[LoadResult]]:
    """``sizes.rounds`` alternating rounds of the two tenants' loads at ``shape``
    (connections, depth); each side's results."""
    conns, depth = shape
    # At least half a second a round: a strict round waits for a budget write now and then,
    # and on a loaded machine one write can outlast a smoke-sized round.
    seconds = max(sizes.duration, MIN_ROUND_S)
    load = _loads(nodes)
    ours_side = load(tenants[0], conns, depth, seconds)
    ref_side = load(tenants[1], conns, depth, seconds)
    ours: list[LoadResult] = []
    ref: list[LoadResult] = []
    for r in range(sizes.rounds):
        progress(
            f"quotas: {what}, {len(nodes)} node(s), {conns} conn, depth {depth}, "
            f"round {r + 1}/{sizes.rounds}"
        )
        a, b = in_turn(r, partial(run_load, ours_side), partial(run_load, ref_side))
        ours.append(a)
        ref.append(b)
    return ours, ref


def _throughput(
    nodes: list[NodeProcess],
    configs: tuple[tuple[int, int], ...],
    sizes: Sizes,
    progress: Progress,
) -> list[Row]:
    """Part 1 (and part 2's far-from-limit writes) on ``nodes``."""
    n = len(nodes)
    _set_limit(nodes, STRICT_TENANT, {"limit": FAR, "kind": "hard", "enforcement": "strict"})
    _set_limit(nodes, FAST_TENANT, {"limit": FAR, "kind": "hard", "enforcement": "fast"})
    sides = (STRICT_TENANT, FAST_TENANT)
    _warm_up(nodes, sides, "both counters", progress)
    rows: list[Row] = []
    for conns, depth in configs:
        units0 = _usage(nodes, STRICT_TENANT)
        writes0 = _strict(nodes)
        ours, ref = _rounds(nodes, sides, "strict vs fast", (conns, depth), sizes, progress)
        units = _usage(nodes, STRICT_TENANT) - units0
        writes1 = _strict(nodes)
        strict = {k: writes1[k] - writes0[k] for k in writes0}
        errors = sum(x.errors for x in ours + ref)
        o_ops = [x.ops_per_s for x in ours]
        r_ops = [x.ops_per_s for x in ref]
        ratio = ratios(o_ops, r_ops)
        shape = f"{n} node{'s' if n > 1 else ''}, {conns} conn" + (
            f", pipelined {depth}" if depth > 1 else ""
        )
        detail = {
            "nodes": n,
            "connections": conns,
            "depth": depth,
            "errors": errors,
            "limit": FAR,
            "counters": "one per side, shared by every connection of every node",
            "ours_p50_us": median([x.percentile_us(50) for x in ours]),
            "ours_p99_us": median([x.percentile_us(99) for x in ours]),
            "fast_p50_us": median([x.percentile_us(50) for x in ref]),
            "fast_p99_us": median([x.percentile_us(99) for x in ref]),
            "rounds_strict_ops": o_ops,
            "rounds_fast_ops": r_ops,
            "order": ALTERNATING,
        }
        rows.append(
            Row(
                QUOTAS,
                f"track, strict vs fast limit far from it, {shape}",
                "ops/s",
                median(o_ops),
                median(r_ops),
                ratio,
                f">= {THROUGHPUT_TARGET}x fast",
                ratio >= THROUGHPUT_TARGET and errors == 0,
                detail,
            )
        )
        per_1k = 1000 * strict["writes"] / units if units else 0.0
        rows.append(
            Row(
                QUOTAS,
                f"strict: storage writes per 1,000 admitted units, far from the limit, {shape}",
                "writes",
                per_1k,
                None,
                None,
                "(report)",
                None,
                {
                    **{k: v for k, v in detail.items() if not k.startswith("rounds")},
                    "admitted_units": units,
                    "strict_writes": strict["writes"],
                    "strict_conflicts": strict["conflicts"],
                    "strict_errors": strict["errors"],
                    "includes": "grants, cap raises and lease renewals over the rounds "
                    "(fast side's turns included), summed over the nodes",
                },
            )
        )
    return rows


def _bursts(svc: Services, q: QuotaSizes, progress: Progress) -> list[Row]:
    """Part 2's burst to a small strict limit, and part 3."""
    rows: list[Row] = []
    progress(
        f"quotas: strict burst, 3 nodes x {q.burst_clients} clients to a limit of {q.burst_limit:,}"
    )
    got = measure(100, q.burst_limit, q.burst_clients, enforcement="strict", svc=svc)
    exact = got["admitted"] == q.burst_limit
    per_1k = 1000 * got["strict_writes"] / got["admitted"] if got["admitted"] else 0.0
    shape = f"3 nodes x {q.burst_clients} clients to a strict limit of {q.burst_limit:,}"
    rows.append(
        Row(
            QUOTAS,
            f"strict burst: units admitted, {shape}",
            "units",
            got["admitted"],
            q.burst_limit,
            got["admitted"] / q.burst_limit,
            f"exactly {q.burst_limit:,}",
            exact,
            got,
            "target",
        )
    )
    rows.append(
        Row(
            QUOTAS,
            f"strict burst: storage writes per 1,000 admitted units, {shape}",
            "writes",
            per_1k,
            None,
            None,
            "(report)",
            None,
            got,
        )
    )
    for tick in q.overshoot_ticks:
        progress(
            f"quotas: fast overshoot, 3 nodes x {q.overshoot_clients} clients, limit "
            f"{q.overshoot_limit:,}, tick {tick} ms"
        )
        got = measure(tick, q.overshoot_limit, q.overshoot_clients, svc=svc)
        aurora = ""
        if tick == 1000:
            aurora = f" (AuroraMeter: {AURORA_1S} = {2 * q.overshoot_limit:,})"
        elif tick == 25:
            aurora = f" (AuroraMeter: {AURORA_25MS[0]:,}-{AURORA_25MS[1]:,})"
        bound = got["bound"]
        rows.append(
            Row(
                QUOTAS,
                f"fast overshoot, tick {tick} ms, {got['rate_per_node']:,} units/s a node" + aurora,
                "units",
                got["overshoot"],
                bound,
                got["overshoot"] / bound if bound else None,
                "<= (N-1)r(T+d)",
                0 <= got["overshoot"] <= bound,
                {
                    **got,
                    "aurora_published": {"1000": AURORA_1S, "25": list(AURORA_25MS)},
                    "reference": "the bound of docs/quotas.md from the run's r and d",
                },
                "target",
            )
        )
    progress(
        f"quotas: the same burst under a strict limit, tick {q.strict_tick} ms, "
        f"limit {q.overshoot_limit:,}"
    )
    got = measure(q.strict_tick, q.overshoot_limit, q.overshoot_clients, enforcement="strict",
                  svc=svc)  # fmt: skip
    rows.append(
        Row(
            QUOTAS,
            f"strict overshoot, the same burst, tick {q.strict_tick} ms, "
            f"{got['rate_per_node']:,} units/s a node",
            "units",
            got["overshoot"],
            0,
            None,
            "0",
            got["overshoot"] == 0,
            got,
            "target",
        )
    )
    return rows


def _credits(
    nodes: list[NodeProcess],
    configs: tuple[tuple[int, int], ...],
    sizes: Sizes,
    progress: Progress,
) -> list[Row]:
    """Credit-metered ``track`` against plain ``track``, far from zero, on ``nodes``."""
    n = len(nodes)
    _set_limit(nodes, CREDIT_TENANT, {"price": 1})
    nodes[0].call("grant", CREDIT_TENANT, FAR, {"ref": f"bench-{n}"})
    sides = (CREDIT_TENANT, PLAIN_TENANT)
    _warm_up(nodes, sides, "the credit-metered and plain counters", progress)
    rows: list[Row] = []
    for conns, depth in configs:
        ours, ref = _rounds(
            nodes, sides, "credit-metered vs plain", (conns, depth), sizes, progress
        )
        errors = sum(x.errors for x in ours + ref)
        o_ops = [x.ops_per_s for x in ours]
        r_ops = [x.ops_per_s for x in ref]
        ratio = ratios(o_ops, r_ops)
        shape = f"{n} node{'s' if n > 1 else ''}, {conns} conn" + (
            f", pipelined {depth}" if depth > 1 else ""
        )
        rows.append(
            Row(
                QUOTAS,
                f"track, credit-metered (1 credit a unit, far from zero) vs plain, {shape}",
                "ops/s",
                median(o_ops),
                median(r_ops),
                ratio,
                f">= {CREDIT_TARGET}x plain",
                ratio >= CREDIT_TARGET and errors == 0,
                {
                    "nodes": n,
                    "connections": conns,
                    "depth": depth,
                    "errors": errors,
                    "credits_granted": FAR,
                    "ours_p50_us": median([x.percentile_us(50) for x in ours]),
                    "ours_p99_us": median([x.percentile_us(99) for x in ours]),
                    "plain_p50_us": median([x.percentile_us(50) for x in ref]),
                    "plain_p99_us": median([x.percentile_us(99) for x in ref]),
                    "rounds_credit_ops": o_ops,
                    "rounds_plain_ops": r_ops,
                    "order": ALTERNATING,
                },
            )
        )
    return rows


def quotas(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    """Parts 1-4 (see the module doc)."""
    q = sizes.quotas
    rows: list[Row] = []
    for n, configs in ((1, q.one_node), (3, q.three_nodes)):
        progress(f"quotas: starting {n} node(s) on DynamoDB Local")
        _, env, _ = cluster_env(svc, f"quota{n}")
        nodes = start_cluster(svc, [f"q{n}-{i}" for i in range(n)], env)
        try:
            rows += _throughput(nodes, configs, sizes, progress)
            rows += _credits(nodes, configs, sizes, progress)
        finally:
            for p in nodes:
                svc.stop_node(p)
    rows += _bursts(svc, q, progress)
    return rows + near_limit(
        svc, q.near_flat, q.near_account, q.near_clients, q.near_rounds, progress
    )
