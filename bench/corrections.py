"""Scenario 13, corrections, the period close and billing cycles (docs/protocol.md, ``void``;
docs/invoicing.md; docs/periods.md): what a ``void`` costs against the ``track`` it takes
back, side by side in one run; the latency of calls while a node closes a period it holds
100,000 keys of; and a ``track`` on a tenant with a billing cycle against one on a UTC tenant,
side by side.

Each of 4 worker processes, one connection each, unpipelined, sends ``track`` calls under
fresh request ids (the calls a void can take back), then a ``void`` of each of them, every id
once, under its own void id (as a client that retries sends it): both phases of all workers
run at the same time, and a round's ratio is the voids' rate over the tracks' rate. The node
is the compiled build, tenant ``acme/u<worker>`` with the hierarchy on and feature ``f``
declared with dimension ``model``, so each call counts (and each void takes back) on 4
counters: once on memory storage without a log (as scenario 1), once on SQLite with the log
synced before each answer (``fsync``, the default there), where both calls wait for the disk.
"""

from __future__ import annotations

import calendar
import functools
import socket
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import msgpack

from bench.harness import NODE_MEMORY, Progress, Row, Services, Sizes, median, node_status
from bench.loadgen import Load, run_load
from meter.core.keys import period_start

SCENARIO = "13 corrections and billing cycles"
WORKERS = 4


def corrections(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    # The billing-cycle row's node first: its tenants' cycles take effect a minute on.
    cycles_node = svc.node("cycles")
    try:
        cycles_from = _anchor(cycles_node)
        rows = _voids(svc, sizes, progress, "memory, no log", "memory", "off")
        rows += _voids(svc, sizes, progress, "SQLite, log fsync", "sqlite", "fsync")
        rows.append(close_under_load(svc, sizes, progress))
        rows.append(cycles_vs_utc(cycles_node, cycles_from, sizes, progress))
    finally:
        svc.stop_node(cycles_node)
    return rows


def _voids(
    svc: Services, sizes: Sizes, progress: Progress, how: str, storage: str, durability: str
) -> list[Row]:
    node = svc.node(
        f"voids-{storage}",
        METER_TENANT_HIERARCHY="true",
        METER_STORAGE=storage,
        METER_DURABILITY=durability,
    )
    compiled = bool((node_status(node).get("build") or {}).get("compiled"))
    try:
        node.call("set_feature", "f", {"dimensions": ["model"]})
        calls = max(2000, int(10_000 * sizes.duration))
        work = functools.partial(_worker, str(node.socket))
        tracks, voids, ratios, errors = _side_by_side(
            sizes, progress, f"void vs track, {how}", work, calls
        )
    finally:
        svc.stop_node(node)
    ratio = median(ratios)
    return [
        Row(
            SCENARIO,
            f"void vs the track it takes back (4 counters), 4 conn, {how}",
            "ops/s",
            median(voids),
            median(tracks),
            ratio,
            ">= 0.8x",
            ratio >= 0.8 and errors == 0 and compiled,
            {
                "node_storage": storage,
                "node_durability": durability,
                "connections": WORKERS,
                "calls_per_worker_round": calls,
                "errors": errors,
                "rounds_ratio": ratios,
            },
            "measured",
        ),
    ]


def _worker(path: str, worker: int, round_: int, calls: int) -> tuple[float, float, int]:
    """Track ``calls`` calls under fresh ids, then void each; each phase's seconds, and the
    error answers."""
    tenant = f"acme/u{worker}"
    ids = [f"r{round_}-w{worker}-{i}" for i in range(calls)]
    tracks = [msgpack.packb([0, i, "track", [tenant, "f", 1, {"id": rid, "dims": {"model": "a"}}]])
              for i, rid in enumerate(ids)]  # fmt: skip
    voids = [msgpack.packb([0, i, "void", [rid, {"id": f"v-{rid}"}]]) for i, rid in enumerate(ids)]
    errors = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        unpacker = msgpack.Unpacker(raw=False)
        seconds: list[float] = []
        for frames in (tracks, voids):
            start = time.perf_counter()
            for frame in frames:
                s.sendall(frame)
                errors += _answer(s, unpacker)
            seconds.append(time.perf_counter() - start)
    return seconds[0], seconds[1], errors


#: The billing cycle of the row's anchored tenants.
ANCHOR = {"anchor_day": 15, "tz": "America/New_York", "effective": "now"}


def _anchor(node: Any) -> float:
    """Put the anchored tenants (``cyc<worker>``) on a billing cycle; when it takes effect."""
    node.call("set_plan", "open", {})
    froms = []
    for w in range(WORKERS):
        node.call("assign_plan", f"cyc{w}", "open", ANCHOR)
        froms.append(node.call("limits", f"cyc{w}")["cycle"][-1]["from"])
    return float(max(froms))


def cycles_vs_utc(node: Any, ready_at: float, sizes: Sizes, progress: Progress) -> Row:
    """``track`` on a tenant with a billing cycle against one on UTC calendar periods: each
    of 4 workers sends its calls for both tenants in each round, alternating every
    :data:`STRETCH` calls (which first swapped every round); a round's ratio is the anchored
    tenant's rate over the UTC tenant's. The row holds only if the anchored tenant's units
    are all in its own period."""
    progress("cycles: waiting for the tenants' cycles to take effect")
    time.sleep(max(0.0, ready_at + 1 - time.time()))
    compiled = bool((node_status(node).get("build") or {}).get("compiled"))
    calls = max(5000, int(20_000 * sizes.duration))
    work = functools.partial(_tracks, str(node.socket))
    what = "cycles: anchored vs UTC tenant"
    refs, rates, ratios, errors = _side_by_side(sizes, progress, what, work, calls)
    # The anchored tenant's calls are in its own period (its month rows are named by it).
    rows = node.call("history", "cyc0", "f", {"granularity": "month"})
    counted = [row for row in rows if row[1]]
    in_cycle = [row[0].endswith("@15:America/New_York") for row in counted] == [True]
    in_cycle = in_cycle and counted[0][1] == calls * sizes.rounds
    ratio = median(ratios)
    return Row(
        SCENARIO,
        "track on a tenant with a billing cycle vs a UTC tenant, 4 conn",
        "ops/s",
        median(rates),
        median(refs),
        ratio,
        ">= 0.95x",
        ratio >= 0.95 and errors == 0 and compiled and in_cycle,
        {
            **NODE_MEMORY,
            "connections": WORKERS,
            "calls_per_tenant_round": calls,
            "anchored_periods": counted,
            "cycle": ANCHOR,
            "errors": errors,
            "rounds_ratio": ratios,
        },
        "measured",
    )


#: Calls of one tenant in a row before the other tenant's (the two alternate all round).
STRETCH = 250


def _side_by_side(
    sizes: Sizes,
    progress: Progress,
    what: str,
    work: Callable[[int, int, int], tuple[float, float, int]],
    calls: int,
) -> tuple[list[float], list[float], list[float], int]:
    """Rounds of ``work(worker, round, calls)`` on each of :data:`WORKERS` processes at once,
    each answering (the reference's seconds, ours, error answers): per round the reference's
    rate and ours (calls per second over all workers) and ours over the reference; and the
    error answers."""
    refs: list[float] = []
    ours: list[float] = []
    ratios: list[float] = []
    errors = 0
    with ProcessPoolExecutor(WORKERS) as pool:
        for r in range(sizes.rounds):
            progress(f"{what}, round {r + 1}/{sizes.rounds}")
            done = [j.result() for j in [pool.submit(work, w, r, calls) for w in range(WORKERS)]]
            ref_s = max(d[0] for d in done)
            our_s = max(d[1] for d in done)
            errors += sum(d[2] for d in done)
            refs.append(WORKERS * calls / ref_s)
            ours.append(WORKERS * calls / our_s)
            ratios.append(ref_s / our_s)
    return refs, ours, ratios, errors


def _tracks(path: str, worker: int, round_: int, calls: int) -> tuple[float, float, int]:
    """``calls`` tracks for the UTC tenant and as many for the anchored one, alternating
    every :data:`STRETCH` calls (the anchored one first in odd rounds); each tenant's
    seconds, and the error answers."""
    anchored_first = round_ % 2 == 1
    utc, cyc = f"utc{worker}", f"cyc{worker}"
    frames = {
        tenant: [msgpack.packb([0, i, "track", [tenant, "f", 1]]) for i in range(calls)]
        for tenant in (utc, cyc)
    }
    order = [cyc, utc] if anchored_first else [utc, cyc]
    seconds = {utc: 0.0, cyc: 0.0}
    errors = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        unpacker = msgpack.Unpacker(raw=False)
        for first in range(0, calls, STRETCH):
            for tenant in order:
                start = time.perf_counter()
                for frame in frames[tenant][first : first + STRETCH]:
                    s.sendall(frame)
                    errors += _answer(s, unpacker)
                seconds[tenant] += time.perf_counter() - start
    return seconds[utc], seconds[cyc], errors


def _answer(s: socket.socket, unpacker: Any) -> int:
    """Read one answer: 1 if it is an error."""
    while True:
        for msg in unpacker:
            return 0 if msg[2] is None else 1
        data = s.recv(65536)
        if not data:
            raise ConnectionError("the node closed the connection")
        unpacker.feed(data)


#: Keys of last month the close row's node holds (each a tenant's counter).
CLOSE_KEYS = 100_000
#: Calls a frame of the fill carries (pipelined).
FILL_DEPTH = 1_000


def close_under_load(svc: Services, sizes: Sizes, progress: Progress) -> Row:
    """The close of last month on a node holding ``CLOSE_KEYS`` keys of it, under a load of
    plain ``track`` calls (4 connections): the load's p99 over a window holding the close,
    against the same load over a window without one. Last month's grace is set to end a
    moment after the keys are filled (``at`` in last month) and stored."""
    now = time.time()
    month_start = calendar.timegm(time.strptime(period_start("month", now), "%Y-%m"))
    lead = 40.0 if sizes.name != "smoke" else 20.0
    closes_at = now + lead
    node = svc.node("close", METER_PERIOD_GRACE_S=str(closes_at - month_start))
    try:
        compiled = bool((node_status(node).get("build") or {}).get("compiled"))
        progress(f"close: filling {CLOSE_KEYS:,} keys of last month")
        errors = _fill(str(node.socket), month_start - 3600)
        while node_status(node)["flush"]["backlog_keys"]:
            if time.time() > closes_at - 5:
                raise RuntimeError("close: the fill was not stored before the grace ended")
            time.sleep(0.2)
        if time.time() > closes_at - 3:
            raise RuntimeError("close: the fill took too long for the window")
        time.sleep(max(0.0, closes_at - 3 - time.time()))
        window = 10.0
        progress("close: load over the close")
        load = Load("meter", str(node.socket), "track", 4, 1, duration=window, warmup=0.0)
        over = run_load(load)
        closed = node_status(node)["periods"]["closed"]
        progress("close: the same load, no close")
        plain = run_load(load)
    finally:
        svc.stop_node(node)
    ours = over.percentile_us(99) / 1000
    ref = plain.percentile_us(99) / 1000
    return Row(
        SCENARIO,
        f"p99 of track under load while last month closes ({CLOSE_KEYS:,} keys of it), 4 conn",
        "ms",
        ours,
        ref,
        ours / ref if ref else 0.0,
        "<= 100 ms p99",
        ours <= 100 and closed >= 1 and errors + over.errors + plain.errors == 0 and compiled,
        {
            **NODE_MEMORY,
            "keys_of_last_month": CLOSE_KEYS,
            "closed_during_window": closed,
            "window_s": window,
            "max_ms": max(over.latencies_ns) / 1e6 if over.latencies_ns else 0.0,
            "reference_max_ms": max(plain.latencies_ns) / 1e6 if plain.latencies_ns else 0.0,
            "errors": errors + over.errors + plain.errors,
        },
        "measured",
    )


def _fill(path: str, at: float) -> int:
    """``CLOSE_KEYS`` tracks of one unit each, one tenant each, dated ``at``: error answers."""
    errors = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        unpacker = msgpack.Unpacker(raw=False)
        for first in range(0, CLOSE_KEYS, FILL_DEPTH):
            frame = b"".join(
                msgpack.packb([0, i, "track", [f"c{first + i}", "api", 1, {"at": at}]])
                for i in range(FILL_DEPTH)
            )
            s.sendall(frame)
            for _ in range(FILL_DEPTH):
                errors += _answer(s, unpacker)
    return errors
