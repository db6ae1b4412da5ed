"""The benchmark scenarios. Each returns result rows; every ratio is measured side by side.

Each round runs both sides (A and B), alternating which goes first: A B, then B A, and so on
(with more sides, the order rotates), so neither side always runs on a machine the other has
just warmed or loaded. A row holds the median of each side and the median of the per-round
ratios, so a burst of noise on this shared machine moves one round, not the figure. A row
whose reference is a fixed number (a target, not a measurement) says so in
``reference_kind``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench import (
    corrections,
    dimensions,
    fanout,
    http_cost,
    ledger_cost,
    metrics_cost,
    quotas,
    scale,
)
from bench.harness import (
    ALTERNATING,
    NODE_MEMORY,
    Progress,
    Row,
    Services,
    Sizes,
    builds,
    create_table,
    fresh_process,
    in_turn,
    latencies,
    load_rounds,
    median,
    node_status,
    ratios,
)
from bench.loadgen import Load, LoadResult, run_load

# -- 1. track vs Redis INCR ------------------------------------------------------------------


RPC = "1 track vs Redis (memory storage)"
#: Issue 13's targets for the compiled node, by (connections, depth).
RPC_TARGETS = {(1, 1): 0.95, (4, 1): 0.9, (16, 1): 0.9}
#: ... and by depth for pipelined rows (any number of connections).
RPC_DEPTH_TARGETS = {16: 0.7}


def rpc_vs_redis(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    """``track`` on a node with memory storage and no log against ``INCR``, one hot key per
    connection on both sides."""
    b = builds(svc, "rpc")
    redis = svc.redis()
    rows: list[Row] = []
    for conns, depth in sizes.rpc_configs:
        loads = {
            who: Load("meter", str(n.socket), "track", conns, depth, duration=sizes.duration)
            for who, n in b.nodes.items()
        }
        loads["redis"] = Load(
            "redis", str(redis.socket), "incr", conns, depth, duration=sizes.duration
        )
        got = load_rounds(
            b.rounds(sizes.rounds), loads, progress, f"track vs INCR: {conns} conn, depth {depth}"
        )
        errors = sum(x.errors for results in got.values() for x in results)
        ops = {who: [x.ops_per_s for x in results] for who, results in got.items()}
        p99 = {who: [x.percentile_us(99) for x in results] for who, results in got.items()}
        ratio = ratios(ops["ours"], ops["redis"])
        need = RPC_TARGETS.get((conns, depth), RPC_DEPTH_TARGETS.get(depth, 0.0))
        target = f">= {need}x Redis" if need else "(context)"
        label = f"track vs INCR, {conns} conn" + (f", pipelined {depth}" if depth > 1 else "")
        label = b.label(label)
        lat = latencies(got)
        detail = {
            "connections": conns,
            "depth": depth,
            "errors": errors,
            **NODE_MEMORY,
            "keys_per_connection": 1,
            **lat,
            **{f"rounds_{who}_ops": x for who, x in ops.items()},
            "order": b.order(),
        }
        rows.append(
            Row(
                RPC,
                label,
                "ops/s",
                median(ops["ours"]),
                median(ops["redis"]),
                ratio,
                target,
                (ratio >= need and errors == 0 and b.compiled) if need else None,
                detail,
            ).sides(ops)
        )
        p99_ratio = ratios(p99["ours"], p99["redis"])
        p99_need = 1.5 if depth <= 16 else 0.0
        rows.append(
            Row(
                RPC,
                f"{label}: p99 latency",
                "us",
                lat["ours_p99_us"],
                lat["redis_p99_us"],
                p99_ratio,
                "<= 1.5x Redis' p99" if p99_need else "(context)",
                (p99_ratio <= p99_need and b.compiled) if p99_need else None,
                {
                    "connections": conns,
                    "depth": depth,
                    "latency": "batch round trip",
                    **NODE_MEMORY,
                    **lat,
                },
            ).sides(p99)
        )
    b.stop(svc)
    return rows


# -- 2. track_many ----------------------------------------------------------------------------


BATCH = "2 batch (memory storage)"
#: Scenario 2's shape: connections, calls in flight per connection, items per call. Both
#: sides keep 200 increments in flight per connection over the same 100 keys per connection.
BATCH_CONNS, BATCH_CALLS, BATCH_ITEMS = 2, 2, 100


def batch(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    """``track_many`` of 100 items against 100 pipelined ``INCR``s, on the same keys: per
    connection, tenant ``bench-<i>`` with features ``f0`` .. ``f99`` for the node, and keys
    ``bench-<i>:f0`` .. ``bench-<i>:f99`` for Redis."""
    b = builds(svc, "batch")
    redis = svc.redis()
    loads = {
        who: Load(
            "meter",
            str(n.socket),
            "track_many",
            BATCH_CONNS,
            BATCH_CALLS,
            items=BATCH_ITEMS,
            duration=sizes.duration,
        )
        for who, n in b.nodes.items()
    }
    loads["redis"] = Load(
        "redis",
        str(redis.socket),
        "incr",
        BATCH_CONNS,
        BATCH_CALLS * BATCH_ITEMS,
        keys=BATCH_ITEMS,
        duration=sizes.duration,
    )
    got = load_rounds(
        b.rounds(sizes.rounds), loads, progress, "track_many x100 vs INCR pipelined 100"
    )
    b.stop(svc)
    inc = {who: [x.increments_per_s for x in results] for who, results in got.items()}
    errors = sum(x.errors for results in got.values() for x in results)
    value = median(inc["ours"])
    return [
        Row(
            BATCH,
            b.label("track_many, 100 items/call (ref: INCR pipelined, same keys)"),
            "incr/s",
            value,
            median(inc["redis"]),
            ratios(inc["ours"], inc["redis"]),
            ">= 1,500,000 incr/s",
            value >= 1.5e6 and errors == 0 and b.compiled,
            {
                "connections": BATCH_CONNS,
                "calls_in_flight_per_conn": BATCH_CALLS,
                "items_per_call": BATCH_ITEMS,
                "redis_depth": BATCH_CALLS * BATCH_ITEMS,
                "distinct_keys_per_conn": BATCH_ITEMS,
                "keys": "node bench-<i> / f0..f99, redis bench-<i>:f0..f99",
                **NODE_MEMORY,
                "order": b.order(),
                "errors": errors,
                "ours_p50_us": median([x.percentile_us(50) for x in got["ours"]]),
                "ours_p99_us": median([x.percentile_us(99) for x in got["ours"]]),
                **{f"rounds_{who}": x for who, x in inc.items()},
            },
        ).sides(inc)
    ]


# -- 3. vs the write-per-event path -----------------------------------------------------------


def _per_event_worker(
    endpoint: str, table: str, index: int, concurrency: int, seconds: float, out: Any
) -> None:
    """One process of the seeds' path: one UpdateItem ADD per event, ``concurrency`` at once."""
    import aioboto3

    async def go() -> tuple[int, int]:
        session = aioboto3.Session(
            aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1"
        )
        done = errors = 0
        async with session.client("dynamodb", endpoint_url=endpoint) as client:
            deadline = time.monotonic() + seconds

            async def lane(j: int) -> None:
                nonlocal done, errors
                key = {"pk": {"S": f"perevent-{index}"}, "sk": {"S": f"2026-11#f{j % 4}"}}
                while time.monotonic() < deadline:
                    try:
                        await client.update_item(
                            TableName=table,
                            Key=key,
                            UpdateExpression="ADD t :d",
                            ExpressionAttributeValues={":d": {"N": "1"}},
                        )
                        done += 1
                    except Exception:
                        errors += 1

            await asyncio.gather(*(lane(j) for j in range(concurrency)))
        return done, errors

    try:
        out.send(asyncio.run(go()))
    except Exception as exc:
        out.send((0, 1))
        print(f"per-event worker failed: {exc}", file=sys.stderr)


def _per_event(
    endpoint: str, table: str, procs: int, concurrency: int, seconds: float
) -> tuple[float, int, int]:
    ctx = mp.get_context("fork")
    pipes, workers = [], []
    for i in range(procs):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_per_event_worker,
            args=(endpoint, table, i, concurrency, seconds, child),
            daemon=True,
        )
        p.start()
        child.close()
        pipes.append(parent)
        workers.append(p)
    done = errors = 0
    for parent, p in zip(pipes, workers, strict=True):
        if parent.poll(seconds + 60):
            d, e = parent.recv()
            done += d
            errors += e
        p.join(10)
        if p.is_alive():
            p.kill()
    return done / seconds, done, errors


def vs_dynamodb(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    progress("starting DynamoDB Local")
    endpoint = svc.dynamodb()
    table = f"meter_bench_{uuid.uuid4().hex[:8]}"
    asyncio.run(create_table(endpoint, table))
    node = svc.node(
        "ddb",
        METER_STORAGE="dynamodb",
        METER_DYNAMODB_ENDPOINT=endpoint,
        METER_DYNAMODB_TABLE=table,
        METER_FLUSH_INTERVAL_MS="1000",
    )
    procs, concurrency, conns = 4, 8, 4
    ours: list[float] = []
    ref: list[float] = []
    per1k: list[float] = []
    events_total = writes_total = ref_errors = errors = 0

    def node_side() -> None:
        nonlocal errors, events_total, writes_total
        before = node_status(node)["flush"]["keys_written"]
        res = run_load(
            Load("meter", str(node.socket), "track", conns, 1, duration=sizes.ddb_seconds)
        )
        errors += res.errors
        # Let the node store everything it counted, then count its writes.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            st = node_status(node)
            if st["keys"]["dirty"] == 0 and st["keys"]["inflight"] == 0:
                break
            time.sleep(0.1)
        writes = node_status(node)["flush"]["keys_written"] - before
        events = res.ops  # acknowledged in the measured window (warm-up excluded)
        ours.append(res.ops_per_s)
        per1k.append(1000 * writes / max(1, events))
        events_total += events
        writes_total += writes

    def per_event_side() -> None:
        nonlocal ref_errors
        rate, _, e = _per_event(endpoint, table, procs, concurrency, sizes.ddb_seconds)
        ref.append(rate)
        ref_errors += e

    # A fresh DynamoDB Local (a JVM) is slow for its first writes: warm it up, unmeasured,
    # so that whichever side goes first in round 1 does not pay for it.
    warm = min(1.0, sizes.ddb_seconds)
    progress(f"warming up DynamoDB Local ({warm:.1f} s of the per-event load, not measured)")
    _per_event(endpoint, table, procs, concurrency, warm)
    for r in range(sizes.ddb_rounds):
        progress(f"node+DynamoDB vs UpdateItem per event, round {r + 1}/{sizes.ddb_rounds}")
        in_turn(r, node_side, per_event_side)
    svc.stop_node(node)
    ratio = ratios(ours, ref)
    w = median(per1k)
    return [
        Row(
            "3 vs write-per-event",
            "events/s: node (DynamoDB storage) vs UpdateItem per event",
            "events/s",
            median(ours),
            median(ref),
            ratio,
            ">= 100x",
            ratio >= 100,
            {
                "node_connections": conns,
                "per_event_processes": procs,
                "per_event_in_flight": procs * concurrency,
                "errors": errors,
                "per_event_errors": ref_errors,
                "hot_keys": conns,
                "per_event_hot_keys": procs * 4,
                "order": ALTERNATING,
            },
        ),
        Row(
            "3 vs write-per-event",
            "node's DB writes per 1,000 events, hot keys (per-event path: 1,000)",
            "writes",
            w,
            1.0,
            w,
            "<= 1 per 1,000",
            w <= 1.0,
            {"events": events_total, "writes": writes_total, "flush_interval_ms": 1000},
            "target",
        ),
    ]


# -- 4. flush overhead ----------------------------------------------------------------------


FLUSH = "4 flush overhead"


async def _flush_round(
    endpoint: str, table: str, n: int, tag: str, mode: str = "auto"
) -> dict[str, float]:
    """A flusher writing ``n`` new dirty month keys (each two items: the counter and its day
    bucket) in one round, in flush mode ``mode``: keys/s, writes, and this process's CPU
    and the write units per stored key."""
    from meter.core.keys import period_start
    from meter.core.table import CounterTable
    from meter.persist.flusher import Flusher
    from storage.base import EMPTY
    from storage.dynamodb import DynamoDBStorage

    store = DynamoDBStorage(table, endpoint_url=endpoint, concurrency=64, flush_mode=mode)
    await store.open()
    try:
        counters = CounterTable("bench")
        period = period_start("month")
        for i in range(n):
            key = (f"{tag}-{i // 100}", f"f{i % 100}", period)
            counters.seed(key, EMPTY)
            counters.incr(key, 1)
        flusher = Flusher(counters, store, batch_keys=10_000)
        cpu, t0 = time.process_time(), time.perf_counter()
        ok = await flusher.flush_once()
        dt, cpu = time.perf_counter() - t0, time.process_time() - cpu
        if not ok or flusher.stats.keys_written != n:
            raise RuntimeError(f"flush failed: {flusher.stats.last_error}")
        ws = store.write_stats()
        return {
            "keys_per_s": n / dt,
            "writes": ws.writes,
            "cpu_us_per_key": cpu / n * 1e6,
            "write_units_per_key": ws.write_units / n,
            "derived": ws.derived,
        }
    finally:
        await store.close()


def _client(endpoint: str) -> Any:
    import aioboto3
    from aiobotocore.config import AioConfig

    session = aioboto3.Session(
        aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1"
    )
    # As the node has it: botocore's validation of every request off.
    config = AioConfig(max_pool_connections=64, parameter_validation=False)
    return session.client("dynamodb", endpoint_url=endpoint, config=config)


async def _bare_round(
    endpoint: str, table: str, n: int, tag: str, *, conditional: bool = False
) -> float:
    async with _client(endpoint) as client:
        sem = asyncio.Semaphore(64)

        # The conditional form is the flusher's own request, less the flusher: the same
        # condition on a per-node sequence and the whole item returned.
        extra: dict[str, Any] = (
            {
                "UpdateExpression": "ADD t :d SET #s = :seq",
                "ConditionExpression": "attribute_not_exists(#s) OR #s < :seq",
                "ExpressionAttributeNames": {"#s": "s_bench"},
                "ExpressionAttributeValues": {":d": {"N": "1"}, ":seq": {"N": "1"}},
                "ReturnValues": "ALL_NEW",
            }
            if conditional
            else {"UpdateExpression": "ADD t :d", "ExpressionAttributeValues": {":d": {"N": "1"}}}
        )

        async def one(i: int) -> None:
            async with sem:
                await client.update_item(
                    TableName=table,
                    Key={"pk": {"S": f"{tag}-{i // 100}"}, "sk": {"S": f"2026-11#f{i % 100}"}},
                    **extra,
                )

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - t0)


async def _bare_transactions(
    endpoint: str, table: str, n: int, tag: str, items: int, until: float | None = None
) -> float:
    """Keys/s of a bare loop of ``TransactWriteItems`` of ``items`` conditional updates,
    two a key (the counter and a day bucket, as the flusher writes), 64 in flight: the
    flusher's writes, less the flusher and the read-back. ``until``: stop sending at this
    ``time.monotonic()`` (the keys not sent by then are not counted)."""
    sent = 0
    async with _client(endpoint) as client:
        sem = asyncio.Semaphore(64)

        def update(sk: str, i: int) -> dict[str, Any]:
            return {
                "Update": {
                    "TableName": table,
                    "Key": {"pk": {"S": f"{tag}-{i // 100}"}, "sk": {"S": sk}},
                    "UpdateExpression": "ADD t :d SET #s = :seq",
                    "ConditionExpression": "attribute_not_exists(#s) OR #s < :seq",
                    "ExpressionAttributeNames": {"#s": "s_bench"},
                    "ExpressionAttributeValues": {":d": {"N": "1"}, ":seq": {"N": "1"}},
                }
            }

        per = max(1, items // 2)

        async def one(start: int) -> None:
            nonlocal sent
            ops = []
            for i in range(start, min(n, start + per)):
                ops += [update(f"2026-11#f{i % 100}", i), update(f"#d#f{i % 100}#2026-11-02", i)]
            async with sem:
                if until is not None and time.monotonic() >= until:
                    return
                await client.transact_write_items(
                    TransactItems=ops, ClientRequestToken=uuid.uuid4().hex
                )
                sent += len(ops) // 2

        t0 = time.perf_counter()
        await asyncio.gather(*(one(s) for s in range(0, n, per)))
        return sent / (time.perf_counter() - t0)


def _flush_side(endpoint: str, table: str, n: int, tag: str, mode: str) -> dict[str, float]:
    return asyncio.run(_flush_round(endpoint, table, n, tag, mode))


def _bare_side(endpoint: str, table: str, n: int, tag: str, conditional: bool) -> float:
    return asyncio.run(_bare_round(endpoint, table, n, tag, conditional=conditional))


def _bare_tx_side(endpoint: str, table: str, n: int, tag: str, items: int) -> float:
    return asyncio.run(_bare_transactions(endpoint, table, n, tag, items))


def flush(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    progress("starting DynamoDB Local")
    endpoint = svc.dynamodb()
    table = f"meter_flush_{uuid.uuid4().hex[:8]}"
    asyncio.run(create_table(endpoint, table))
    rows: list[Row] = []
    # A fresh DynamoDB Local (a JVM) is several times slower for its first thousand writes:
    # warm it up, unmeasured, so the first side measured does not pay for it.
    progress("warming up DynamoDB Local (2,000 writes, not measured)")
    asyncio.run(_bare_round(endpoint, table, 2_000, f"warm{uuid.uuid4().hex[:6]}"))
    _bare_tx_side(endpoint, table, 1_000, f"warm{uuid.uuid4().hex[:6]}", 10)
    rows += _flush_cost(endpoint, table, sizes, progress)
    rows += _flush_vs_transactions(endpoint, table, sizes, progress)
    for n in sizes.flush_sizes:
        rounds = 1 if n >= 100_000 else sizes.flush_rounds
        ours: list[float] = []
        ref: list[float] = []
        writes: list[int] = []
        for r in range(rounds):
            progress(f"flush of {n:,} dirty keys vs bare UpdateItem loop, round {r + 1}/{rounds}")
            tag = uuid.uuid4().hex[:6]
            got = in_turn(
                r,
                partial(_flush_side, endpoint, table, n, f"fl{tag}", "auto"),
                partial(_bare_side, endpoint, table, n, f"bare{tag}", False),
            )
            ours.append(got[0]["keys_per_s"])
            writes.append(int(got[0]["writes"]))
            ref.append(got[1])
        ratio = ratios(ours, ref)
        rows.append(
            Row(
                FLUSH,
                f"flush {n:,} dirty keys vs bare UpdateItem loop",
                "keys/s",
                median(ours),
                median(ref),
                ratio,
                ">= 0.9x bare",
                ratio >= 0.9,
                {
                    "keys": n,
                    "flush_mode": "auto",
                    "concurrency": 64,
                    "rounds": rounds,
                    "writes": writes,
                    "order": "turning: each round starts one side later",
                },
            )
        )
    rows += _track_during_flush(svc, endpoint, table, sizes, progress)
    return rows


def _flush_cost(endpoint: str, table: str, sizes: Sizes, progress: Progress) -> list[Row]:
    """Client CPU and write units per stored key: transactions against one UpdateItem a
    key's item, the same keys, in turns."""
    n = sizes.flush_cpu_keys
    got: dict[str, list[dict[str, float]]] = {"batched": [], "single": []}
    for r in range(sizes.flush_rounds):
        progress(f"flush CPU per stored key, {n:,} keys, batched vs single, round {r + 1}")
        tag = uuid.uuid4().hex[:6]
        a, b = in_turn(
            r,
            partial(_flush_side, endpoint, table, n, f"cb{tag}", "batched"),
            partial(_flush_side, endpoint, table, n, f"cs{tag}", "single"),
        )
        got["batched"].append(a)
        got["single"].append(b)

    def side(mode: str, what: str) -> list[float]:
        return [g[what] for g in got[mode]]

    cpu_ratio = ratios(side("batched", "cpu_us_per_key"), side("single", "cpu_us_per_key"))
    detail = {
        "keys": n,
        "items_per_key": 2,
        "transact_items": 10,
        "rounds": sizes.flush_rounds,
        "batched_keys_per_s": [round(x) for x in side("batched", "keys_per_s")],
        "single_keys_per_s": [round(x) for x in side("single", "keys_per_s")],
        "measure": "time.process_time() of the flushing process across flush_once()",
        "batched_answered_without_read": [int(x) for x in side("batched", "derived")],
    }
    units = median(side("batched", "write_units_per_key"))
    single_units = median(side("single", "write_units_per_key"))
    return [
        Row(
            FLUSH,
            f"client CPU per stored key, {n:,} keys: batched vs single UpdateItem",
            "us/key",
            median(side("batched", "cpu_us_per_key")),
            median(side("single", "cpu_us_per_key")),
            cpu_ratio,
            "<= 0.2x single",
            cpu_ratio <= 0.2,
            detail,
        ),
        Row(
            FLUSH,
            "write units per stored key: batched vs single (items <= 1 KB)",
            "WCU/key",
            units,
            single_units,
            units / single_units if single_units else None,
            "(report: 2 an item in a transaction, 1 alone)",
            None,
            {"items_per_key": 2},
        ),
    ]


def _flush_vs_transactions(
    endpoint: str, table: str, sizes: Sizes, progress: Progress
) -> list[Row]:
    n = sizes.flush_tx_keys
    ours: list[float] = []
    ref: list[float] = []
    derived: list[int] = []
    # Both sides are bound by DynamoDB Local's JVM, whose pace drifts by 10 % from round to
    # round here: three rounds at least, so one slow round does not make the median.
    rounds = sizes.flush_rounds if sizes.name == "smoke" else max(3, sizes.flush_rounds)
    for r in range(rounds):
        progress(f"flush of {n:,} keys vs bare TransactWriteItems loop, round {r + 1}")
        tag = uuid.uuid4().hex[:6]
        a, b = in_turn(
            r,
            partial(_flush_side, endpoint, table, n, f"tf{tag}", "batched"),
            partial(_bare_tx_side, endpoint, table, n, f"tb{tag}", 10),
        )
        ours.append(a["keys_per_s"])
        derived.append(int(a["derived"]))
        ref.append(b)
    ratio = ratios(ours, ref)
    return [
        Row(
            FLUSH,
            f"flush {n:,} dirty keys (batched) vs bare TransactWriteItems loop",
            "keys/s",
            median(ours),
            median(ref),
            ratio,
            ">= 0.9x bare",
            ratio >= 0.9,
            {
                "keys": n,
                "transact_items": 10,
                "bare_in_flight": 64,
                "rounds": rounds,
                # new keys, each its first flush: answered from what the flusher knew (a
                # key's every 8th flush, and keys other nodes write, are read back)
                "answered_without_read": derived,
            },
        )
    ]


def _track_during_flush(
    svc: Services, endpoint: str, table: str, sizes: Sizes, progress: Progress
) -> list[Row]:
    """``track`` p99 at 4 connections on a node (DynamoDB storage) while it flushes a round
    of ``flush_tx_keys`` new keys, against the same load while it flushes nothing but the
    load's own few keys and a bare TransactWriteItems loop (another client, in this
    process) keeps DynamoDB Local as busy: on this 2-core machine the JVM's writes take CPU
    from the node either way, and what is compared is the node's own flush work."""
    n = sizes.flush_tx_keys
    node = svc.node(
        "flushp99",
        METER_STORAGE="dynamodb",
        METER_DYNAMODB_ENDPOINT=endpoint,
        METER_DYNAMODB_TABLE=table,
        METER_FLUSH_INTERVAL_MS="1000",
    )
    seconds = sizes.flush_p99_seconds
    quiet: list[float] = []
    busy: list[float] = []
    covered: list[float] = []
    load = Load("meter", str(node.socket), "track", 4, 1, duration=seconds)
    run_load(load)  # warm: the load's keys seeded, not measured

    def quiet_side() -> None:
        until = time.monotonic() + load.warmup + seconds + 1
        tag = uuid.uuid4().hex[:6]
        beside = threading.Thread(
            target=lambda: asyncio.run(_bare_transactions(endpoint, table, n, f"q{tag}", 10, until))
        )
        beside.start()
        try:
            quiet.append(run_load(load).percentile_us(99))
        finally:
            beside.join()

    def busy_side() -> None:
        tag = uuid.uuid4().hex[:6]
        before = node_status(node)["flush"]["keys_written"]
        for start in range(0, n, 10_000):
            items = [
                [f"p{tag}-{i // 100}", f"f{i % 100}", 1]
                for i in range(start, min(n, start + 10_000))
            ]
            node.call("track_many", items)
        res = run_load(load)
        written = node_status(node)["flush"]["keys_written"] - before
        busy.append(res.percentile_us(99))
        covered.append(min(1.0, written / n))
        deadline = time.monotonic() + 120
        while node_status(node)["flush"]["keys_written"] - before < n:
            if time.monotonic() > deadline:
                raise RuntimeError("the node did not store the round within 120 s")
            time.sleep(0.2)

    for r in range(sizes.flush_rounds):
        progress(f"track p99 while a {n:,}-key flush round runs vs none, round {r + 1}")
        in_turn(r, busy_side, quiet_side)
    st = node_status(node)
    svc.stop_node(node)
    ratio = ratios(busy, quiet)
    return [
        Row(
            FLUSH,
            f"track p99, 4 connections, during a {n:,}-key flush round vs none (same DB load)",
            "us",
            median(busy),
            median(quiet),
            ratio,
            "<= 1.5x",
            ratio <= 1.5,
            {
                "window_s": seconds,
                "round_stored_in_window": [round(c, 2) for c in covered],
                "flush": {k: st["flush"][k] for k in ("cpu_us_per_key", "writes")},
            },
        )
    ]


# -- 5. convergence ---------------------------------------------------------------------------


def convergence(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    try:
        from tests.support.measure_convergence import measure
    except ImportError:
        return [
            Row(
                "5 convergence",
                "3 nodes: track -> visible on the others",
                "ms",
                None,
                None,
                None,
                "p99 <= tick + 20 ms",
                None,
                {"status": "not measured yet"},
            )
        ]
    rows: list[Row] = []
    for tick in sizes.conv_ticks:
        progress(f"convergence: 3 nodes, gossip every {tick} ms, {sizes.conv_samples} samples")
        try:
            res = measure(3, tick, sizes.conv_samples)
        except Exception as exc:
            rows.append(
                Row(
                    "5 convergence",
                    f"3 nodes, tick {tick} ms: p99",
                    "ms",
                    None,
                    None,
                    None,
                    f"<= {tick + 20} ms",
                    None,
                    {"status": f"failed: {type(exc).__name__}: {exc}"[:300]},
                )
            )
            continue
        p99 = float(res["p99_ms"])
        bound = float(tick + 20)
        rows.append(
            Row(
                "5 convergence",
                f"3 nodes, tick {tick} ms: p99",
                "ms",
                p99,
                bound,
                p99 / bound,
                f"<= {tick + 20} ms",
                p99 <= bound,
                {k: v for k, v in res.items() if not isinstance(v, list)},
                "target",
            )
        )
    return rows


# -- 6. memory --------------------------------------------------------------------------------


def memory(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    """Bytes per warm key by :mod:`bench.memory`: the wire path (judged) and the table alone."""
    n = sizes.memory_keys
    out: dict[str, Any] = {"keys": n}
    for path in ("wire", "table"):
        for mode in ("tracemalloc", "rss"):
            progress(f"memory: {n:,} warm keys in a fresh process ({path} path, {mode})")
            got = fresh_process("bench.memory", str(n), mode, path)
            got.pop("path", None)
            out.update(got)
    note = "" if n == 1_000_000 else " (quick mode, not 1M)"
    wire = float(out["wire_bytes_per_key_tracemalloc"])
    table = float(out["table_bytes_per_key_tracemalloc"])
    return [
        Row(
            "6 memory",
            f"bytes per warm key at {n:,} keys, tracked over the wire{note}",
            "B",
            wire,
            300.0,
            wire / 300,
            "<= 300 B",
            wire <= 300,
            {**out, "path": "wire: decoder, server connection, Service.track, seeding"},
            "target",
        ),
        Row(
            "6 memory",
            f"bytes per warm key at {n:,} keys, table alone, names made before{note}",
            "B",
            table,
            300.0,
            table / 300,
            "(context)",
            None,
            {**out, "path": "table: CounterTable.seed + incr on prepared keys"},
            "target",
        ),
    ]


# -- 7. durable track vs Redis AOF ------------------------------------------------------------

#: (node ``METER_DURABILITY``, redis ``appendfsync``): the pairs compared, like for like.
DURABLE_PAIRS = (("fsync", "always"), ("interval", "everysec"))
#: The compiled node's targets: issue 13's 1.2x against ``appendfsync always``.
DURABLE_TARGETS = {"fsync": 1.2, "interval": 1.0}
#: The node's fsync period in ``interval`` mode, as Redis' ``everysec``.
WAL_FSYNC_INTERVAL_MS = 1000


def _tree_bytes(path: Path) -> int:
    """Bytes in the files under ``path`` (0 when it does not exist)."""
    total = 0
    for f in path.rglob("*"):
        try:
            if f.is_file():
                total += f.stat().st_size
        except OSError:  # a log segment removed while we look
            continue
    return total


def _pid(proc: subprocess.Popen[bytes] | None) -> int | None:
    return None if proc is None else proc.pid


def _disk_write_bytes(pid: int | None) -> int | None:
    """``write_bytes`` of ``/proc/<pid>/io``: what the process sent to the block device."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return None


#: The node's log counters (``status.durability.wal``) summed over a row's rounds.
WAL_COUNTERS = ("commits", "fsyncs", "records", "failures")


def _counters(who: str, server: Any, pid: int | None) -> dict[str, Any]:
    """One side's counters before or after a load step.

    ``requests``: what the server answered (node: ``status.server.requests``; redis:
    ``total_commands_processed``), warm-up included, so per-request figures use it rather
    than the load generator's measured window. ``disk``: ``write_bytes`` of the process.
    The node also gives its durability mode and log counters, when it has them.
    """
    out: dict[str, Any] = {"disk": _disk_write_bytes(pid)}
    if who == "redis":
        out["requests"] = int(server.info("stats").get("total_commands_processed", 0))
        return out
    st = node_status(server)
    out["requests"] = int(st["server"]["requests"])
    dur = st.get("durability")
    if isinstance(dur, dict):
        out["mode"] = dur.get("mode")
        wal = dur.get("wal")
        if isinstance(wal, dict):
            out.update({k: int(wal.get(k, 0)) for k in WAL_COUNTERS})
    return out


def _fs_type(path: Path) -> str:
    """The file system ``path`` is on (from /proc/self/mounts; ``?`` if unknown)."""
    best, kind = "", "?"
    target = str(path.resolve())
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1]
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) > len(best):
            best, kind = mnt, parts[2]
    return kind


def durable(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    """``track`` on a node with its write-ahead log against ``INCR`` on Redis with AOF.

    ``METER_DURABILITY=fsync`` against ``appendfsync always`` (both answer only after an
    fsync), then ``interval`` (fsync every second) against ``everysec``; memory storage,
    so the log is the only disk work. The load is scenario 1's. Each round runs both sides,
    alternating which goes first (A B, B A, ...).
    """
    rows: list[Row] = []
    for mode, appendfsync in DURABLE_PAIRS:
        progress(f"durable: node {mode} vs redis appendfsync {appendfsync}: starting both")
        b = builds(
            svc,
            f"wal-{mode}",
            METER_DURABILITY=mode,
            METER_WAL_FSYNC_INTERVAL_MS=str(WAL_FSYNC_INTERVAL_MS),
        )
        redis = svc.redis_aof(appendfsync)
        redis_persistence = redis.info("persistence")
        setup = {
            "node_durability": mode,
            "node_wal_fsync_interval_ms": WAL_FSYNC_INTERVAL_MS if mode == "interval" else None,
            "node_storage": "memory",
            "node_data_dir_fs": _fs_type(b.nodes["ours"].data_dir.parent),
            "redis_appendonly": redis_persistence.get("aof_enabled") == "1",
            "redis_appendfsync": redis.config_get("appendfsync"),
            "redis_dir_fs": _fs_type(redis.workdir),
        }
        side: dict[str, tuple[str, str, str, Any, int | None]] = {
            who: ("meter", str(n.socket), "track", n, _pid(n.proc)) for who, n in b.nodes.items()
        }
        side["redis"] = ("redis", str(redis.socket), "incr", redis, _pid(redis.proc))
        reported: dict[str, str | None] = dict.fromkeys(b.nodes)
        for conns, depth in sizes.durable_configs:
            got: dict[str, list[LoadResult]] = {who: [] for who in side}
            # What each side's loads did besides answering: each node's data dir growth (its
            # log; only a node id and a lock without one), the bytes each process had the
            # kernel write to disk, the requests it served, and the nodes' log counters.
            grown = dict.fromkeys(b.nodes, 0)
            summed = {who: dict.fromkeys(("disk", "requests", *WAL_COUNTERS), 0) for who in b.nodes}
            summed["redis"] = dict.fromkeys(("disk", "requests"), 0)
            rounds = b.rounds(sizes.rounds)
            order = list(side)
            for r in range(rounds):
                progress(
                    f"durable {mode} vs AOF {appendfsync}: {conns} conn, depth {depth}, "
                    f"round {r + 1}/{rounds}"
                )
                k = r % len(order)
                for who in order[k:] + order[:k]:
                    proto, path, method, server, pid = side[who]
                    kind = "redis" if who == "redis" else "node"
                    size0 = 0 if kind == "redis" else _tree_bytes(server.data_dir)
                    before = _counters(kind, server, pid)
                    res = run_load(Load(proto, path, method, conns, depth, duration=sizes.duration))
                    after = _counters(kind, server, pid)
                    for key, total in summed[who].items():
                        if before.get(key) is not None and after.get(key) is not None:
                            summed[who][key] = total + after[key] - before[key]
                    got[who].append(res)
                    if kind == "node":
                        grown[who] = max(grown[who], _tree_bytes(server.data_dir) - size0)
                        reported[who] = after.get("mode")
            errors = sum(x.errors for results in got.values() for x in results)
            ops = {who: [x.ops_per_s for x in results] for who, results in got.items()}
            p99 = {who: [x.percentile_us(99) for x in results] for who, results in got.items()}
            ratio = ratios(ops["ours"], ops["redis"])
            label = f"track ({mode}) vs INCR (AOF {appendfsync}), {conns} conn" + (
                f", pipelined {depth}" if depth > 1 else ""
            )
            label = b.label(label)
            # Until the node had a log, METER_DURABILITY was accepted and ignored: say so
            # in the row rather than pass a no-log figure off as a durable one. The node's
            # own counters decide when it reports them; else whether its data dir grew.
            logged = {
                who: (reported[who] == mode and summed[who]["records"] > 0)
                if reported[who] is not None
                else grown[who] > 0
                for who in b.nodes
            }
            if not logged["ours"]:
                label += " (node wrote no log)"
            if b.beside is not None and not logged["beside"]:
                label += f" ({b.beside.label} node wrote no log)"
            lat = latencies(got)
            n, rd = summed["ours"], summed["redis"]
            need = DURABLE_TARGETS[mode]
            detail = {
                "connections": conns,
                "depth": depth,
                "errors": errors,
                **setup,
                "node_reported_durability": reported["ours"],
                "node_wal": {k: n[k] for k in WAL_COUNTERS},
                "node_requests": n["requests"],
                "node_wal_fsyncs_per_1k_requests": 1000 * n["fsyncs"] / max(1, n["requests"]),
                "node_data_dir_growth_bytes": grown["ours"],
                "node_disk_bytes_per_request": n["disk"] / max(1, n["requests"]),
                **(
                    {
                        "beside_reported_durability": reported["beside"],
                        "beside_wal": {k: summed["beside"][k] for k in WAL_COUNTERS},
                    }
                    if b.beside is not None
                    else {}
                ),
                "redis_requests": rd["requests"],
                "redis_disk_bytes_per_request": rd["disk"] / max(1, rd["requests"]),
                **lat,
                **{f"rounds_{who}_ops": x for who, x in ops.items()},
                "order": b.order(),
            }
            rows.append(
                Row(
                    "7 durable vs Redis AOF",
                    label,
                    "ops/s",
                    median(ops["ours"]),
                    median(ops["redis"]),
                    ratio,
                    f">= {need}x Redis",
                    (ratio >= need and errors == 0 and b.compiled) if logged["ours"] else None,
                    detail,
                ).sides(ops)
            )
            rows.append(
                Row(
                    "7 durable vs Redis AOF",
                    f"{label}: p99 latency",
                    "us",
                    lat["ours_p99_us"],
                    lat["redis_p99_us"],
                    ratios(p99["ours"], p99["redis"]),
                    "(context)",
                    None,
                    {"connections": conns, "depth": depth, "latency": "batch round trip", **lat},
                ).sides(p99)
            )
        b.stop(svc)
        svc.stop_redis(redis)
    return rows


#: The scenarios that run ``--beside``'s node (beside the compiled and pure ones).
BESIDE_SCENARIOS = ("rpc", "batch", "durable")
SCENARIOS: dict[str, Callable[[Services, Sizes, Progress], list[Row]]] = {
    "rpc": rpc_vs_redis,
    "batch": batch,
    "dynamodb": vs_dynamodb,
    "flush": flush,
    "convergence": convergence,
    "memory": memory,
    "durable": durable,
    "scale": scale.scale,
    "metrics": metrics_cost.metrics_cost,
    "quotas": quotas.quotas,
    "ledger": ledger_cost.ledger,
    "dimensions": dimensions.dimensions,
    "corrections": corrections.corrections,
    "fanout": fanout.fanout,
    "http": http_cost.http_cost,
}
