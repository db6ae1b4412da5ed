"""Scenario 12, dimensions and aggregations (docs/dimensions.md): what a call with dimensions
costs against a plain one on the same node, side by side in one run, a ``track_many`` of
dimensioned items, a group-by read, a unique feature's already-seen value against a plain
``track``, and memory per dimension combination and per unique value (``python -m
bench.dimensions N``: bytes per combination in a fresh process; ``python -m bench.dimensions
values N``: bytes per unique value; printed as JSON).

The node is the compiled build on memory storage without a log (as scenario 1), feature ``f``
declared with dimensions ``model`` and ``region``, feature ``u`` declared ``unique``.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import tracemalloc
from collections.abc import Callable, Coroutine
from typing import Any

from bench.harness import (
    NODE_MEMORY,
    Progress,
    Row,
    Services,
    Sizes,
    fresh_process,
    in_turn,
    load_rounds,
    median,
    node_status,
    percentile,
    ratios,
)
from bench.loadgen import Load
from tests.support.cluster_harness import Conn

DIMS = "12 dimensions (memory storage)"
#: Group-by reads timed a round, and combinations of the tenant they read.
GROUP_READS = 2_000
GROUP_COMBINATIONS = 100
#: Combinations per tenant in the memory measure (30 models x 30 regions, with their 60
#: values' counters: under the default bound of 1,000 counters).
MEMORY_SIDE = 30


def dimensions(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    node = svc.node("dims")
    compiled = bool((node_status(node).get("build") or {}).get("compiled"))
    conn = Conn(node.socket)
    conn.ok("set_feature", "f", {"dimensions": ["model", "region"]})
    conn.ok("set_feature", "u", {"aggregation": "unique"})
    rows: list[Row] = []
    try:
        rows.append(_track(node, sizes, progress, compiled))
        rows.append(_unique(node, sizes, progress, compiled))
        rows.append(_track_many(node, sizes, progress, compiled))
        rows.append(_group_by(conn, sizes, progress, compiled))
    finally:
        conn.close()
        svc.stop_node(node)
    rows.extend(_memory(sizes, progress))
    return rows


def _track(node: Any, sizes: Sizes, progress: Progress, compiled: bool) -> Row:
    """``track`` with 2 dimensions against a plain ``track``, 4 connections, in turns."""
    load = Load("meter", str(node.socket), "track", 4, 1, duration=sizes.duration, dims=2)
    return _versus_plain(
        node,
        sizes,
        progress,
        compiled,
        load,
        "track with 2 dimensions",
        0.7,
        {"counters_per_call": "4 (total, 2 values, the combination) vs 1"},
    )


def _unique(node: Any, sizes: Sizes, progress: Progress, compiled: bool) -> Row:
    """``track`` of an already-seen value of a unique feature against a plain ``track``, 4
    connections, in turns (each worker's value is claimed by its first call, in the warm-up)."""
    load = Load("meter", str(node.socket), "track", 4, 1, duration=sizes.duration,
                value="user-17")  # fmt: skip
    return _versus_plain(node, sizes, progress, compiled, load,
                         "track of an already-seen unique value", 0.8, {})  # fmt: skip


def _versus_plain(
    node: Any,
    sizes: Sizes,
    progress: Progress,
    compiled: bool,
    load: Load,
    what: str,
    at_least: float,
    detail: dict[str, Any],
) -> Row:
    """``load`` against a plain ``track`` of the same shape, in turns: the row of ``what``,
    met at ``at_least`` times the plain figure."""
    loads = {"ours": load, "plain": Load("meter", str(node.socket), "track", 4, 1,
                                         duration=sizes.duration)}  # fmt: skip
    got = load_rounds(sizes.rounds, loads, progress, f"{what} vs plain")
    ops = {who: [x.ops_per_s for x in results] for who, results in got.items()}
    errors = sum(x.errors for results in got.values() for x in results)
    ratio = ratios(ops["ours"], ops["plain"])
    return Row(
        DIMS,
        f"{what} vs a plain track, 4 conn",
        "ops/s",
        median(ops["ours"]),
        median(ops["plain"]),
        ratio,
        f">= {at_least}x",
        ratio >= at_least and errors == 0 and compiled,
        {
            **NODE_MEMORY,
            **detail,
            "errors": errors,
            "compiled": compiled,
            **{f"rounds_{who}_ops": x for who, x in ops.items()},
        },
        "measured",
    )


def _track_many(node: Any, sizes: Sizes, progress: Progress, compiled: bool) -> Row:
    """``track_many`` of 100 dimensioned items (100 combinations a tenant) against 100
    plain items, 4 connections, 4 calls in flight each, in turns."""
    sock = str(node.socket)
    loads = {
        "dims": Load("meter", sock, "track_many", 4, 4, items=100, duration=sizes.duration, dims=2),
        "plain": Load("meter", sock, "track_many", 4, 4, items=100, duration=sizes.duration),
    }
    got = load_rounds(sizes.rounds, loads, progress, "track_many x100 with 2 dimensions")
    inc = {who: [x.increments_per_s for x in results] for who, results in got.items()}
    errors = sum(x.errors for results in got.values() for x in results)
    value = median(inc["dims"])
    return Row(
        DIMS,
        "track_many, 100 dimensioned items/call (ref: 100 plain items)",
        "items/s",
        value,
        median(inc["plain"]),
        ratios(inc["dims"], inc["plain"]),
        ">= 1,000,000 items/s",
        value >= 1e6 and errors == 0 and compiled,
        {
            **NODE_MEMORY,
            "connections": 4,
            "calls_in_flight_per_conn": 4,
            "combinations_per_tenant": 100,
            "errors": errors,
            **{f"rounds_{who}": x for who, x in inc.items()},
        },
        "measured",
    )


def _group_by(conn: Conn, sizes: Sizes, progress: Progress, compiled: bool) -> Row:
    """``usage`` with ``group_by`` over 100 combinations, one connection, unpipelined, in
    turns with a plain ``usage``: each call's round trip."""
    tenant = "groups"
    items = [[tenant, "f", 1, {"dims": {"model": f"m{j % 10}", "region": f"r{j // 10}"}}]
             for j in range(GROUP_COMBINATIONS)]  # fmt: skip
    conn.ok("track_many", items)
    reads = max(200, int(GROUP_READS * sizes.duration))

    def timed(params: list[Any]) -> list[float]:
        out = []
        for _ in range(reads):
            t0 = time.perf_counter()
            conn.ok("usage", *params)
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    grouped = [tenant, "f", {"group_by": ["model", "region"]}]
    got = conn.ok("usage", *grouped)
    assert len(got["groups"]) == GROUP_COMBINATIONS and got["total"] == GROUP_COMBINATIONS
    p99: dict[str, list[float]] = {"group_by": [], "plain": []}
    for r in range(sizes.rounds):
        progress(f"usage group_by over {GROUP_COMBINATIONS} combinations, round {r + 1}")
        a, b = in_turn(r, lambda: timed(grouped), lambda: timed([tenant, "f"]))
        p99["group_by"].append(percentile(a, 99))
        p99["plain"].append(percentile(b, 99))
    value = median(p99["group_by"])
    return Row(
        DIMS,
        f"usage with group_by over {GROUP_COMBINATIONS} combinations, p99 (ref: plain usage)",
        "us",
        value,
        median(p99["plain"]),
        ratios(p99["group_by"], p99["plain"]),
        "<= 1 ms p99",
        value <= 1000 and compiled,
        {"reads_per_round": reads, **{f"rounds_{who}_p99_us": x for who, x in p99.items()}},
        "measured",
    )


def _memory(sizes: Sizes, progress: Progress) -> list[Row]:
    tenants = max(1, sizes.memory_keys // 3_000)
    progress(f"memory: {tenants * MEMORY_SIDE**2:,} combinations in a fresh process")
    got = fresh_process("bench.dimensions", str(tenants))
    per = float(got["bytes_per_combination"])
    return [
        Row(
            DIMS,
            f"bytes per dimension combination ({got['combinations']:,}, with their values)",
            "B",
            per,
            300.0,
            per / 300,
            "<= 300 B",
            per <= 300,
            got,
            "target",
        ),
        _value_memory(sizes, progress),
    ]


def _value_memory(sizes: Sizes, progress: Progress) -> Row:
    values = max(1_000, sizes.memory_keys // 10)
    progress(f"memory: {values:,} unique values in a fresh process")
    got = fresh_process("bench.dimensions", "values", str(values))
    per = float(got["bytes_per_value"])
    return Row(
        DIMS,
        f"bytes per unique value known to a node ({got['values']:,} of 16 characters)",
        "B",
        per,
        None,
        None,
        "report",
        None,
        got,
    )


def measure_values(values: int) -> dict[str, Any]:
    """Track ``values`` distinct values of a unique feature (16 characters each, 100 tenants)
    through a service on memory storage; the Python heap the node keeps per value (its
    cache of values known claimed; storage's items are not counted)."""
    import asyncio
    import inspect

    from meter.config import CounterConfig
    from meter.core.table import CounterTable
    from meter.node.wiring import build_service
    from storage.memory import MemoryStorage

    store = MemoryStorage()
    svc = build_service(CounterTable("mem"), store, CounterConfig())

    async def call(method: str, *params: Any) -> Any:
        got = svc.dispatch(method, list(params))
        return await got if inspect.isawaitable(got) else got

    async def fill() -> None:
        for n in range(values):
            await call("track", f"tenant-{n % 100:03d}", "u", 1, {"value": f"user-{n:011d}"})

    async def declare() -> None:
        await call("set_feature", "u", {"aggregation": "unique"})
        await call("track", "tenant-000", "u", 1, {"value": "warm-up"})

    asyncio.run(declare())
    store_before = _heap_of(store)
    grown = _heap_grown(fill)
    stored = _heap_of(store) - store_before
    return {
        "values": values,
        "bytes_per_value": (grown - stored) / values,
        "bytes_per_value_with_memory_storage": grown / values,
        "cached_values": svc.uniques.status()["cached_values"],
    }


def _heap_grown(fill: Callable[[], Coroutine[Any, Any, None]]) -> int:
    """The Python heap ``fill()`` leaves allocated, run to its end (tracemalloc)."""
    import asyncio

    gc.collect()
    tracemalloc.start()
    t0, _ = tracemalloc.get_traced_memory()
    asyncio.run(fill())
    gc.collect()
    t1, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return t1 - t0


def _heap_of(store: Any) -> int:
    """Bytes the memory storage's value items hold (deep size of its values map)."""
    seen: set[int] = set()

    def size(obj: Any) -> int:
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        n = sys.getsizeof(obj)
        if isinstance(obj, dict):
            n += sum(size(k) + size(v) for k, v in obj.items())
        elif isinstance(obj, list | tuple | set | frozenset):
            n += sum(size(x) for x in obj)
        return n

    return size(store.values)


def measure(tenants: int) -> dict[str, Any]:
    """Track ``MEMORY_SIDE``² combinations of 2 dimensions for each of ``tenants`` tenants
    through a service (the key cache, the table, the listings and bounds of its groups);
    the Python heap left allocated, per combination and per dimension counter."""
    import asyncio
    import inspect

    from meter.config import CounterConfig
    from meter.core.table import CounterTable
    from meter.node.wiring import build_service
    from storage.memory import MemoryStorage

    svc = build_service(CounterTable("mem"), MemoryStorage(), CounterConfig())

    async def call(method: str, *params: Any) -> Any:
        got = svc.dispatch(method, list(params))
        return await got if inspect.isawaitable(got) else got

    async def fill() -> None:
        await call("set_feature", "f", {"dimensions": ["model", "region"]})
        for t in range(tenants):
            for m in range(MEMORY_SIDE):
                items = [[f"tenant-{t:05d}", "f", 1,
                          {"dims": {"model": f"model-{m:03d}", "region": f"region-{r:03d}"}}]
                         for r in range(MEMORY_SIDE)]  # fmt: skip
                answers = await call("track_many", items)
                assert not any(isinstance(a, dict) for a in answers), answers[:2]

    asyncio.run(call("ping"))  # (imports and first-use caches before measuring)
    grown = _heap_grown(fill)
    combos = tenants * MEMORY_SIDE**2
    counters = len(svc.table) - tenants  # (less each tenant's total)
    return {
        "tenants": tenants,
        "combinations": combos,
        "dimension_counters": counters,
        "bytes_per_combination": grown / combos,
        "bytes_per_dimension_counter": grown / counters,
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["values"]:
        print(json.dumps(measure_values(int(sys.argv[2]) if len(sys.argv) > 2 else 10_000)))
    else:
        print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 10)))
