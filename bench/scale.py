"""Scenario 8, ``scale``: a node meeting many keys it has not loaded yet (issue 14).

A warm node answers from memory; a key it has not loaded must first be read from storage
(seeded). Three parts, each through real node processes and the socket, as users call them:

1. **DynamoDB cold seeding, side by side.** One node on DynamoDB Local; clients send
   ``track_many`` calls of 200 items, each item a key nobody has used (10 features x new
   tenants, absent from the table), 4 connections with 4 calls in flight each. The rate is
   keys / (first call sent -> last call answered): a call is answered once its keys are
   seeded, so the last answer is the moment every key is warm. ``status.seeding.on_demand``
   must have grown by exactly the number of keys. The reference, in the same round (sides
   take turns going first), is a bare aioboto3 loop of ``BatchGetItem`` of 100 keys, 8 in
   flight (the node's own chunk and concurrency), consistent reads, over as many fresh keys
   of the same shape on the same table.
2. **SQLite cold seeding.** The SQLite file is filled first (through the storage class) with
   the keys; a fresh node process on it then meets them all cold, in random order, in calls
   of 200; then the same calls again, all warm, in the same run. Judged against a fixed
   target of 50,000 keys/s.
3. **First of the month.** Three clustered nodes (DynamoDB Local, one Redis), each with its
   own active keys, all warm, each under an open-loop load that touches every key every
   ``rollover_sweep_s``. Their clocks are moved (:mod:`bench.clockshift`) so that a new month
   begins during the load: every key then has a new period, cold. Call latency (from the
   moment the call was due, so a stalled call is not hidden by the calls not sent behind it)
   in the ``rollover_window_s`` after the boundary and over the whole load; target p99 <=
   100 ms. With the roll-over read-ahead in the build (``rollover_read_ahead_s``) it runs
   once with it off and once on (:func:`read_ahead_modes`), side by side.

Every part checks what was counted: each answer is the expected total, and after the nodes
have flushed, the totals stored are exactly the units acknowledged.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import msgpack

from bench.clockshift import next_month_start, shift_to
from bench.harness import (
    ALTERNATING,
    Progress,
    Row,
    Services,
    Sizes,
    create_table,
    in_turn,
    median,
    node_status,
    percentile,
    ratios,
)
from meter.core.keys import Key, period_start
from tests.support.nodes import NodeProcess

SCALE = "8 scale (cold keys)"
#: Features per tenant in every key set of this scenario (10 features x N/10 tenants).
FEATURES = 10
#: Items per ``track_many`` call, connections and calls in flight per connection of the
#: cold-seeding passes.
ITEMS, CONNS, DEPTH = 200, 4, 4
#: The bare loop's shape: the node's (``DynamoDBStorage.load_chunk`` / ``load_concurrency``).
BARE_CHUNK, BARE_CONCURRENCY = 100, 8
#: Total of every key in the prefilled SQLite file.
SQLITE_BASE = 7
#: Part 3's target: p99 call latency, ms.
ROLLOVER_P99_MS = 100.0
#: Connections per node of part 3's load.
ROLLOVER_CONNS = 2
#: Parts 1 and 3 leave the node's writes until it is stopped (SIGTERM drains: everything is
#: stored, then checked). DynamoDB Local's writes (~500 conditional UpdateItem/s on the
#: 2-core bench machine, scenario 4) share one JVM with the reads measured here, which real
#: DynamoDB's do not; a flush in the window would measure that JVM, not seeding. Flushing
#: has its own scenario (4).
DEFERRED_FLUSH = {"METER_FLUSH_INTERVAL_MS": "3600000", "METER_DRAIN_TIMEOUT_S": "3600"}
#: How long a stopping node may take to store what it counted before it is killed.
DRAIN_TIMEOUT_S = 1800.0
#: Set (e.g. to 1000, the default) to run parts 1 and 3 with the node flushing every this
#: many ms instead of deferring its writes to the end.
FLUSH_ENV = "BENCH_SCALE_FLUSH_INTERVAL_MS"
#: Set to a comma-separated subset of ``ddb,sqlite,rollover,converge`` to run only those parts.
PARTS_ENV = "BENCH_SCALE_PARTS"


def ddb_flush() -> tuple[dict[str, str], str]:
    """The flush settings of parts 1 and 3 (see :data:`DEFERRED_FLUSH`, :data:`FLUSH_ENV`)
    and how to describe them."""
    every = os.environ.get(FLUSH_ENV)
    if every:
        env = {"METER_FLUSH_INTERVAL_MS": every, "METER_DRAIN_TIMEOUT_S": "3600"}
        return env, f"every {every} ms ({FLUSH_ENV})"
    return DEFERRED_FLUSH, "deferred until the node is stopped (DEFERRED_FLUSH)"


def cluster_env(svc: Services, name: str) -> tuple[str, dict[str, str], str]:
    """Settings of a cluster of nodes on a new table of the run's DynamoDB Local and its
    redis-server (flush as :func:`ddb_flush`): a fresh tag, the ``METER_*`` variables, and
    how the flush is set."""
    tag = uuid.uuid4().hex[:6]
    table = f"meter_{name}_{tag}"
    asyncio.run(create_table(svc.dynamodb(), table))
    flush_env, flush_how = ddb_flush()
    env = {
        "METER_STORAGE": "dynamodb",
        "METER_DYNAMODB_ENDPOINT": svc.dynamodb(),
        "METER_DYNAMODB_TABLE": table,
        "METER_REDIS_URL": f"unix://{svc.redis().socket}",
        "METER_CLUSTER_NAME": f"{name}-{tag}",
        "METER_CLUSTER_SECRET": "bench",
        **flush_env,
    }
    return tag, env, flush_how


def start_cluster(
    svc: Services, names: list[str], env: dict[str, str], shift: float | None = None
) -> list[NodeProcess]:
    """Start a node per name (in parallel), and wait until each sees the others live."""
    with ThreadPoolExecutor(len(names)) as pool:
        nodes = list(pool.map(lambda name: svc.node(name, clock_shift=shift, **env), names))
    try:
        deadline = time.monotonic() + 30
        while not all(
            len(node_status(p)["cluster"]["live_peers"]) == len(names) - 1 for p in nodes
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {len(names)} nodes did not see each other within 30 s")
            time.sleep(0.05)
    except BaseException:
        for p in nodes:
            svc.stop_node(p)
        raise
    return nodes


#: How the DynamoDB parts end, by ``ScaleSizes.store_check``.
STORED_HOW = {
    True: "node drained, every key read back and checked",
    False: "not checked at this size: the node was killed, not drained (DynamoDB Local stores "
    "a few hundred keys/s here); smoke and full runs check",
}


# -- driving a node ---------------------------------------------------------------------------


@dataclass
class Pass:
    """One pass of ``track_many`` calls over a key set (every call answered)."""

    calls: int
    items: int  # items answered with a value
    seconds: float  # first call sent -> last answer
    errors: int = 0  # error answers (whole calls or items)
    nil: int = 0  # items answered nil (the key could not be seeded)
    wrong: int = 0  # values other than the one expected
    latencies_ns: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.items / self.seconds if self.seconds else 0.0

    def ms(self, q: float) -> float:
        return percentile(self.latencies_ns, q) / 1e6


def keyset(tag: str, n: int) -> list[tuple[str, str]]:
    """``n`` distinct (tenant, feature) pairs: tenants ``<tag>-t<i>``, features ``f0`` ..
    ``f9``."""
    return [(f"{tag}-t{i // FEATURES}", f"f{i % FEATURES}") for i in range(n)]


def calls_of(pairs: list[tuple[str, str]], seed: int) -> list[list[tuple[str, str]]]:
    """The pairs in a random order, cut into calls of :data:`ITEMS` (each pair once)."""
    order = list(pairs)
    random.Random(seed).shuffle(order)
    return [order[i : i + ITEMS] for i in range(0, len(order), ITEMS)]


def frames(calls: list[list[tuple[str, str]]], conns: int, qty: int = 1) -> list[list[bytes]]:
    """Each call as a ``track_many`` request (``qty`` per item), dealt out to ``conns``
    connections in turn; msgids count from 0 on each connection."""
    lanes: list[list[bytes]] = [[] for _ in range(conns)]
    for i, call in enumerate(calls):
        lane = lanes[i % conns]
        lane.append(msgpack.packb([0, len(lane), "track_many", [[[t, f, qty] for t, f in call]]]))
    return lanes


@dataclass
class _Tally:
    items: int = 0
    errors: int = 0
    nil: int = 0
    wrong: int = 0

    def answer(self, error: Any, result: Any, expect: int | None) -> int:
        """Count one ``track_many`` answer; return the items it counted."""
        if error is not None or not isinstance(result, list):
            self.errors += 1
            return 0
        n = 0
        for v in result:
            if type(v) is int:
                n += 1
                if expect is not None and v != expect:
                    self.wrong += 1
            elif v is None:
                self.nil += 1
            else:
                self.errors += 1
        self.items += n
        return n


async def _lane(
    stream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    lane: list[bytes],
    depth: int,
    expect: int | None,
    tally: _Tally,
    lat: list[int],
) -> int:
    reader, writer = stream
    now = time.perf_counter_ns
    n = len(lane)
    sent = [0] * n
    nxt = 0
    while nxt < min(depth, n):
        sent[nxt] = now()
        writer.write(lane[nxt])
        nxt += 1
    unpacker = msgpack.Unpacker(raw=False)
    got = 0
    last = now()
    while got < n:
        data = await reader.read(1 << 20)
        if not data:
            raise ConnectionError("the node closed the connection")
        unpacker.feed(data)
        for msg in unpacker:
            last = now()
            _, msgid, error, result = msg
            lat.append(last - sent[msgid])
            got += 1
            tally.answer(error, result, expect)
            if nxt < n:
                sent[nxt] = now()
                writer.write(lane[nxt])
                nxt += 1
    return last


async def drive(path: str | Path, lanes: list[list[bytes]], expect: int | None) -> Pass:
    """Send every lane's calls on its own connection, :data:`DEPTH` in flight each."""
    streams = [await asyncio.open_unix_connection(str(path)) for _ in lanes]
    tally = _Tally()
    lat: list[int] = []
    try:
        t0 = time.perf_counter_ns()
        work = zip(streams, lanes, strict=True)
        ends = await asyncio.gather(*(_lane(s, x, DEPTH, expect, tally, lat) for s, x in work))
    finally:
        for _, writer in streams:
            writer.close()
    return Pass(
        sum(len(lane) for lane in lanes),
        tally.items,
        (max(ends) - t0) / 1e9,
        tally.errors,
        tally.nil,
        tally.wrong,
        lat,
    )


def finish(svc: Services, node: NodeProcess, store: bool) -> float:
    """Stop ``node``: drained (everything it counted stored) if ``store``, else killed (what
    it counted is in its log, not stored). The seconds it took."""
    if store:
        return drain(svc, node)
    t0 = time.monotonic()
    node.kill()
    svc.stop_node(node)
    return time.monotonic() - t0


def drain(svc: Services, node: NodeProcess) -> float:
    """Stop ``node`` with SIGTERM, which stores everything it counted before it exits; the
    seconds it took. Raise unless it exits 0 (drained)."""
    t0 = time.monotonic()
    code = svc.stop_node(node, timeout=DRAIN_TIMEOUT_S)
    if code != 0:
        raise RuntimeError(f"node {node.name} exited {code} on SIGTERM:\n{node.log()[-2000:]}")
    return time.monotonic() - t0


def _seeding(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """What ``status.seeding`` counted between two statuses."""
    b, a = before["seeding"], after["seeding"]
    return {k: int(a[k]) - int(b[k]) for k in ("on_demand", "prefetched", "reads", "failed_reads")}


async def _stored(storage: Any, keys: Sequence[Key]) -> list[int]:
    """The stored totals of ``keys`` (read in chunks through ``storage``)."""
    await storage.open()
    try:
        out: list[int] = []
        for i in range(0, len(keys), 5_000):
            chunk = keys[i : i + 5_000]
            snaps = await storage.load(chunk)
            out.extend(snaps[k].total for k in chunk)
        return out
    finally:
        await storage.close()


def _stored_ddb(endpoint: str, table: str, keys: Sequence[Key]) -> list[int]:
    from storage.dynamodb import DynamoDBStorage

    return asyncio.run(_stored(DynamoDBStorage(table, endpoint_url=endpoint), keys))


# -- 1. DynamoDB: the node vs a bare BatchGetItem loop ----------------------------------------


async def bare_batch_get(endpoint: str, table: str, keys: Sequence[Key]) -> tuple[float, int]:
    """Read ``keys`` with ``BatchGetItem`` of :data:`BARE_CHUNK`, :data:`BARE_CONCURRENCY` in
    flight, consistent reads, unprocessed keys asked again; ``(keys/s, requests)``. The
    client and its connections are made before the clock starts."""
    import aioboto3
    from aiobotocore.config import AioConfig

    session = aioboto3.Session(
        aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1"
    )
    config = AioConfig(max_pool_connections=BARE_CONCURRENCY)
    ids = [{"pk": {"S": t}, "sk": {"S": f"{p}#{f}"}} for t, f, p in keys]
    chunks = [ids[i : i + BARE_CHUNK] for i in range(0, len(ids), BARE_CHUNK)]
    requests = 0
    async with session.client("dynamodb", endpoint_url=endpoint, config=config) as client:

        async def get(request: dict[str, Any]) -> None:
            nonlocal requests
            while request:
                requests += 1
                resp = await client.batch_get_item(RequestItems=request)
                request = resp.get("UnprocessedKeys") or {}

        # One request per lane first, unmeasured: the connections are open, as the node's are.
        probe = [{"pk": {"S": "bench-probe"}, "sk": {"S": "2000-01#f"}}]
        await asyncio.gather(*(get({table: {"Keys": probe}}) for _ in range(BARE_CONCURRENCY)))
        requests = 0
        work = iter(chunks)

        async def lane() -> None:
            for chunk in work:
                await get({table: {"Keys": chunk, "ConsistentRead": True}})

        t0 = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(BARE_CONCURRENCY)))
        return len(keys) / (time.perf_counter() - t0), requests


def ddb_cold(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    sz = sizes.scale
    n = sz.ddb_keys
    progress("scale: starting DynamoDB Local")
    endpoint = svc.dynamodb()
    table = f"meter_scale_{uuid.uuid4().hex[:8]}"
    asyncio.run(create_table(endpoint, table))
    load0 = os.getloadavg()
    flush_env, flush_how = ddb_flush()
    node = svc.node(
        "scale-ddb",
        clock_shift=None,
        METER_STORAGE="dynamodb",
        METER_DYNAMODB_ENDPOINT=endpoint,
        METER_DYNAMODB_TABLE=table,
        **flush_env,
    )
    period = period_start("month")
    # A fresh DynamoDB Local (a JVM) is slow for its first requests: warm both paths up,
    # unmeasured, so that whichever side goes first in round 1 does not pay for it.
    progress("scale: warming up DynamoDB Local and the node (not measured)")
    warm = min(n, 2_000)
    asyncio.run(bare_batch_get(endpoint, table, [(t, f, period) for t, f in keyset("wb", warm)]))
    asyncio.run(drive(node.socket, frames(calls_of(keyset("wn", warm), 0), CONNS), 1))
    ours: list[Pass] = []
    ref: list[float] = []
    seeded: list[dict[str, int]] = []
    flushed_in_window: list[int] = []
    bare_requests: list[int] = []
    tracked: list[Key] = []

    def node_side(r: int, tag: str) -> None:
        pairs = keyset(f"c{tag}", n)
        lanes = frames(calls_of(pairs, r), CONNS)
        before = node_status(node)
        got = asyncio.run(drive(node.socket, lanes, 1))
        after = node_status(node)
        ours.append(got)
        seeded.append(_seeding(before, after))
        flushed_in_window.append(after["flush"]["keys_written"] - before["flush"]["keys_written"])
        tracked.extend((t, f, period) for t, f in pairs)

    def bare_side(tag: str) -> None:
        keys = [(t, f, period) for t, f in keyset(f"b{tag}", n)]
        rate, requests = asyncio.run(bare_batch_get(endpoint, table, keys))
        ref.append(rate)
        bare_requests.append(requests)

    for r in range(sz.ddb_rounds):
        progress(
            f"scale: {n:,} cold keys through the node vs bare BatchGetItem loop, "
            f"round {r + 1}/{sz.ddb_rounds}"
        )
        tag = uuid.uuid4().hex[:6]
        in_turn(r, lambda: node_side(r, tag), lambda: bare_side(tag))  # noqa: B023
    load1 = os.getloadavg()
    stored: list[int] | None = None
    if sz.store_check:
        progress(f"scale: stopping the node: it stores the {len(tracked) + warm:,} keys it counted")
    drain_s = finish(svc, node, sz.store_check)
    if sz.store_check:
        progress(f"scale: reading back the {len(tracked):,} keys the node stored")
        stored = _stored_ddb(endpoint, table, tracked)
    o = [p.rate for p in ours]
    ratio = ratios(o, ref)
    bad = sum(p.errors + p.nil + p.wrong for p in ours)
    exact = None if stored is None else (sum(stored) == len(tracked) and set(stored) == {1})
    all_seeded = all(s["on_demand"] == n for s in seeded)
    return [
        Row(
            SCALE,
            f"DynamoDB: {n:,} cold keys seeded through the node (track_many x{ITEMS}) "
            f"vs bare BatchGetItem x{BARE_CHUNK}, {BARE_CONCURRENCY} in flight",
            "keys/s",
            median(o),
            median(ref),
            ratio,
            ">= 0.8x bare",
            ratio >= 0.8 and bad == 0 and exact is not False and all_seeded,
            {
                "keys_per_round": n,
                "key_shape": f"{FEATURES} features x {n // FEATURES:,} new tenants, absent "
                "from the table (both sides)",
                "items_per_call": ITEMS,
                "connections": CONNS,
                "calls_in_flight_per_connection": DEPTH,
                "node_storage": "dynamodb",
                "node_flush": flush_how,
                "node_durability": "fsync (default)",
                "bare": f"aioboto3 BatchGetItem x{BARE_CHUNK}, {BARE_CONCURRENCY} in flight, "
                "ConsistentRead",
                "rounds_ours": o,
                "rounds_bare": ref,
                "bare_requests": bare_requests,
                "seeding_per_round": seeded,
                "all_keys_seeded_on_demand": all_seeded,
                "node_keys_flushed_during_window": flushed_in_window,
                "node_stop_seconds": round(drain_s, 2),
                "loadavg_start_end": [load0, load1],
                "call_p50_ms": median([p.ms(50) for p in ours]),
                "call_p99_ms": median([p.ms(99) for p in ours]),
                "call_max_ms": max(p.ms(100) for p in ours),
                "errors": sum(p.errors for p in ours),
                "nil_answers": sum(p.nil for p in ours),
                "wrong_answers": sum(p.wrong for p in ours),
                "tracked_items": len(tracked),
                "stored_total": None if stored is None else sum(stored),
                "stored_exact": exact,
                "stored": STORED_HOW[sz.store_check],
                "order": ALTERNATING,
            },
        )
    ]


# -- 2. SQLite: cold keys that exist in the file, then the same keys warm ---------------------


async def _prefill(path: Path, keys: Sequence[Key], total: int) -> None:
    from storage.base import Delta
    from storage.sqlite import SQLiteStorage

    store = SQLiteStorage(path)
    await store.open()
    try:
        for i in range(0, len(keys), 10_000):
            got = await store.apply("prefill", [Delta(k, 1, total) for k in keys[i : i + 10_000]])
            failed = [v for v in got.values() if isinstance(v, Exception)]
            if failed:
                raise RuntimeError(f"prefill: {len(failed)} keys failed: {failed[0]}")
    finally:
        await store.close()


def sqlite_cold(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    """Part 2. Each round starts two fresh nodes in turn on the filled file (sides take
    turns going first): one as configured by default, which meets the keys cold and then
    warm (judged); one whose flush waits until it is stopped, cold only (context: what the
    default node's flushes, on the same SQLite thread as its reads, cost the cold pass)."""
    from storage.sqlite import SQLiteStorage

    sz = sizes.scale
    n = sz.sqlite_keys
    tag = uuid.uuid4().hex[:6]
    period = period_start("month")
    pairs = keyset(f"q{tag}", n)
    keys = [(t, f, period) for t, f in pairs]
    path = svc.workdir / "scale-sqlite" / "counters.sqlite3"
    progress(f"scale: writing {n:,} keys to a SQLite file (total {SQLITE_BASE} each)")
    t0 = time.monotonic()
    asyncio.run(_prefill(path, keys, SQLITE_BASE))
    prefill_s = time.monotonic() - t0
    cold: list[Pass] = []
    warm: list[Pass] = []
    deferred: list[Pass] = []
    seeded: list[dict[str, int]] = []
    flushed: list[int] = []
    drain_s: list[float] = []
    passes = 0  # units each key got so far (one per pass)
    load0 = os.getloadavg()

    def side(r: int, default: bool) -> None:
        nonlocal passes
        # Either way the node may take its time to store 100,000 keys when stopped (the
        # default drain_timeout_s is 30 s).
        env = {"METER_DRAIN_TIMEOUT_S": "3600"} if default else DEFERRED_FLUSH
        # Each side restarts the node on the same data dir: without this, the warm-up after a
        # restart (ADR 0006) would read the keys the last side used ahead of the load.
        env = {**env, "METER_WARM_UP_MAX_KEYS": "0"}
        node = svc.node(
            "scale-sqlite",
            clock_shift=None,
            METER_STORAGE="sqlite",
            METER_SQLITE_FILE=str(path),
            **env,
        )
        lanes = frames(calls_of(pairs, 1000 + r), CONNS)
        before = node_status(node)
        got = asyncio.run(drive(node.socket, lanes, SQLITE_BASE + passes + 1))
        passes += 1
        after = node_status(node)
        seeded.append(_seeding(before, after))
        if default:
            cold.append(got)
            flushed.append(after["flush"]["keys_written"] - before["flush"]["keys_written"])
            warm.append(asyncio.run(drive(node.socket, lanes, SQLITE_BASE + passes + 1)))
            passes += 1
        else:
            deferred.append(got)
        drain_s.append(drain(svc, node))

    for r in range(sz.sqlite_rounds):
        progress(
            f"scale: fresh SQLite nodes meet {n:,} stored keys cold (default node: then warm; "
            f"other node: flush deferred), round {r + 1}/{sz.sqlite_rounds}"
        )
        in_turn(r, partial(side, r, True), partial(side, r, False))
    load1 = os.getloadavg()
    progress(f"scale: reading back the {n:,} keys")
    stored = asyncio.run(_stored(SQLiteStorage(path), keys))
    want = SQLITE_BASE + passes
    exact = all(v == want for v in stored)
    c = [p.rate for p in cold]
    w = [p.rate for p in warm]
    d = [p.rate for p in deferred]
    every = cold + warm + deferred
    bad = sum(p.errors + p.nil + p.wrong for p in every)
    all_seeded = all(s["on_demand"] == n for s in seeded)
    cold_rate = median(c)
    common = {
        "keys": n,
        "key_shape": f"{FEATURES} features x {n // FEATURES:,} tenants, all in the file",
        "order": "random, each key once per pass; the warm pass repeats the cold pass's calls",
        "items_per_call": ITEMS,
        "connections": CONNS,
        "calls_in_flight_per_connection": DEPTH,
        "node_storage": "sqlite",
        "node_durability": "fsync (default)",
        "node_flush": "every 1 s (default); context side: deferred to its drain",
        "node_drain_timeout_s": 3600,
        "node_keys_flushed_during_cold_pass": flushed,
        "node_drain_seconds": [round(x, 2) for x in drain_s],
        "loadavg_start_end": [load0, load1],
        "fresh_node_per_side": True,
        "sides": "default node (cold, then warm) and deferred-flush node (cold), alternating",
        "rounds_cold_keys_per_s": c,
        "rounds_warm_items_per_s": w,
        "rounds_deferred_flush_cold_keys_per_s": d,
        "cold_call_p50_ms": median([p.ms(50) for p in cold]),
        "cold_call_p99_ms": median([p.ms(99) for p in cold]),
        "warm_call_p50_ms": median([p.ms(50) for p in warm]),
        "warm_call_p99_ms": median([p.ms(99) for p in warm]),
        "deferred_flush_cold_call_p99_ms": median([p.ms(99) for p in deferred]),
        "seeding_per_side": seeded,
        "all_keys_seeded_on_demand": all_seeded,
        "errors": sum(p.errors for p in every),
        "nil_answers": sum(p.nil for p in every),
        "wrong_answers": sum(p.wrong for p in every),
        "prefill_seconds": round(prefill_s, 2),
        "stored_each_want": want,
        "stored_total": sum(stored),
        "stored_exact": exact,
    }
    return [
        Row(
            SCALE,
            f"SQLite: {n:,} stored keys met cold by a fresh node (track_many x{ITEMS})",
            "keys/s",
            cold_rate,
            50_000.0,
            cold_rate / 50_000,
            ">= 50,000 keys/s",
            cold_rate >= 50_000 and bad == 0 and exact and all_seeded,
            common,
            "target",
        ),
        Row(
            SCALE,
            "SQLite: the same keys cold vs warm, same node, same run",
            "keys/s",
            cold_rate,
            median(w),
            ratios(c, w),
            "(context)",
            None,
            common,
        ),
        Row(
            SCALE,
            "SQLite: cold, default node vs a node whose flush waits (same rounds)",
            "keys/s",
            cold_rate,
            median(d),
            ratios(c, d),
            "(context)",
            None,
            common,
        ),
    ]


# -- 3. first of the month --------------------------------------------------------------------


def read_ahead_setting() -> str | None:
    """The name of the roll-over read-ahead setting, if this build has one."""
    from meter.config import SETTING_NAMES

    for name in ("rollover_read_ahead_s", "rollover_prefetch_s"):
        if name in SETTING_NAMES:
            return name
    found = sorted(s for s in SETTING_NAMES if "read_ahead" in s or "prefetch" in s)
    return found[0] if found else None


def read_ahead_modes(sizes: Sizes) -> list[tuple[str, dict[str, str]]]:
    """``(label, node env)`` of each run of part 3: the read-ahead off (0) and on, when the
    build has the setting; else the build as it is.

    On, it is ``rollover_before_s - 1`` seconds, so that all its passes (at the lead, 3/4,
    1/2 and 1/4 of it) come after the setup: the nodes start ``rollover_setup_s +
    rollover_before_s`` before the month ends and their keys are warm only once set up, so
    with the default lead (120 s) the passes would find no warm key but for the last, or none.
    """
    name = read_ahead_setting()
    if name is None:
        return [("no read-ahead in this build", {})]
    from meter.config import env_name

    var = env_name(name)
    on = f"{max(1.0, sizes.scale.rollover_before_s - 1):g}"
    return [("read-ahead off", {var: "0"}), (f"read-ahead on ({on} s)", {var: on})]


@dataclass
class _Call:
    node: int
    due: float  # monotonic seconds the call was due
    lat_ns: int = -1  # -1: never answered
    ok: bool = False


async def open_loop(
    nodes: list[NodeProcess],
    pairs: list[list[tuple[str, str]]],
    items: int,
    per_s: float,
    t_start: float,
    t_end: float,
    marks: list[tuple[float, Any]],
) -> tuple[list[_Call], _Tally, float]:
    """Each node: ``per_s`` calls a second of ``items`` items (qty 1) walking its keys in
    order, over :data:`ROLLOVER_CONNS` connections, sent when due whatever is in flight.
    ``marks``: ``(monotonic time, callback)`` run in a thread at that time (status reads)."""
    loop = asyncio.get_running_loop()
    calls: list[_Call] = []
    tally = _Tally()
    lag = 0.0
    dt = 1.0 / per_s

    async def conn(i: int, j: int) -> None:
        nonlocal lag
        reader, writer = await asyncio.open_unix_connection(str(nodes[i].socket))
        keys = pairs[i]
        mine: dict[int, _Call] = {}
        done = asyncio.Event()
        finished = False

        async def read() -> None:
            unpacker = msgpack.Unpacker(raw=False)
            while not (finished and not mine):
                data = await reader.read(1 << 20)
                if not data:
                    raise ConnectionError(f"node {nodes[i].name} closed the connection")
                unpacker.feed(data)
                for _, msgid, error, result in unpacker:
                    c = mine.pop(msgid)
                    c.lat_ns = int((time.monotonic() - c.due) * 1e9)
                    c.ok = tally.answer(error, result, None) == items
            done.set()

        reading = asyncio.ensure_future(read())
        g = j
        msgid = 0
        while True:
            due = t_start + g * dt
            if due >= t_end:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            lag = max(lag, time.monotonic() - due)
            start = g * items
            batch = [[*keys[(start + k) % len(keys)], 1] for k in range(items)]
            c = _Call(i, due)
            mine[msgid] = c
            calls.append(c)
            writer.write(msgpack.packb([0, msgid, "track_many", [batch]]))
            msgid += 1
            g += ROLLOVER_CONNS
        finished = True
        if not mine:
            reading.cancel()
        else:
            await asyncio.wait_for(reading, 60)
        writer.close()

    async def mark(at: float, fn: Any) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        await loop.run_in_executor(None, fn)

    await asyncio.gather(
        *(conn(i, j) for i in range(len(nodes)) for j in range(ROLLOVER_CONNS)),
        *(mark(at, fn) for at, fn in marks),
    )
    return calls, tally, lag


def _lat(calls: list[_Call]) -> dict[str, float]:
    ms = [c.lat_ns / 1e6 for c in calls if c.lat_ns >= 0]
    return {
        "calls": len(calls),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms, default=0.0),
    }


def _timeline(calls: list[_Call], boundary: float, start: float) -> list[list[float]]:
    """``[seconds from the boundary, calls, p99 ms, max ms]`` per half second the calls were
    due, from the load's start to its end."""
    out: list[list[float]] = []
    by: dict[int, list[_Call]] = {}
    for c in calls:
        by.setdefault(int((c.due - boundary) // 0.5), []).append(c)
    for b in range(int((start - boundary) // 0.5), max(by, default=0) + 1):
        lat = _lat(by.get(b, []))
        out.append([b * 0.5, lat["calls"], round(lat["p99_ms"], 1), round(lat["max_ms"], 1)])
    return out


def _read_ahead_from(env: dict[str, str]) -> float | None:
    """Seconds from the boundary at which the read-ahead set in ``env`` starts (None: off)."""
    for value in env.values():
        if float(value) > 0:
            return -float(value)
    return None


class SetupOverran(RuntimeError):
    """Part 3's nodes were not started and warm in time: the month ended before the load."""


def _first_of_month(
    svc: Services,
    sizes: Sizes,
    progress: Progress,
    label: str,
    extra: dict[str, str],
    setup_s: float,
) -> dict[str, Any]:
    """One run of part 3; its figures and checks. ``setup_s``: seconds allowed to start the
    nodes and warm their keys (what is left is load before the boundary)."""
    sz = sizes.scale
    n = sz.rollover_keys
    items = min(100, n)
    per_s = n / sz.rollover_sweep_s / items  # calls per second per node
    tag, env, flush_how = cluster_env(svc, "fom")
    env.update(extra)
    boundary = next_month_start()
    lead = setup_s + sz.rollover_before_s
    m0 = time.monotonic()
    shift = shift_to(boundary, lead)
    m_boundary = m0 + lead
    old = period_start("month", boundary.timestamp() - 1)
    new = period_start("month", boundary.timestamp())
    names = [f"fom{tag}-{i}" for i in range(3)]
    progress(f"scale: first of the month ({label}): 3 nodes, clocks {lead:.0f} s before {new}")
    load0 = os.getloadavg()
    nodes = start_cluster(svc, names, env, shift)
    stopped = False
    try:
        pairs = [keyset(f"fom{tag}n{i}", n) for i in range(3)]
        progress(f"scale: first of the month ({label}): {n:,} keys warm on each node")

        async def warm_all() -> list[Pass]:
            return await asyncio.gather(
                *(
                    drive(p.socket, frames(calls_of(pairs[i], i), CONNS), 1)
                    for i, p in enumerate(nodes)
                )
            )

        t0 = time.monotonic()
        warmed = asyncio.run(warm_all())
        warm_s = time.monotonic() - t0
        # The load starts now: what setup left of its budget is more load before the end.
        # Setup must be over before the read-ahead (if on) begins, at rollover_before_s - 1.
        t_start = time.monotonic()
        before_s = m_boundary - t_start
        if before_s < sz.rollover_before_s:
            raise SetupOverran(
                f"setup took {t_start - m0:.1f} s of {setup_s:.0f}: less than "
                f"{sz.rollover_before_s:.0f} s left before the boundary"
            )
        progress(
            f"scale: first of the month ({label}): load on every node, "
            f"{per_s * items * 3:,.0f} items/s in all, {before_s:.1f} s before the boundary, "
            f"{sz.rollover_after_s:.0f} s after"
        )
        snaps: dict[str, list[dict[str, Any]]] = {}

        def snap(name: str) -> Any:
            return lambda: snaps.__setitem__(name, [node_status(p) for p in nodes])

        snap("start")()
        calls, tally, lag = asyncio.run(
            open_loop(
                nodes,
                pairs,
                items,
                per_s,
                t_start,
                m_boundary + sz.rollover_after_s,
                [
                    (m_boundary - 0.3, snap("boundary")),
                    (m_boundary + sz.rollover_window_s, snap("window_end")),
                ],
            )
        )
        snap("end")()
        load1 = os.getloadavg()
        if sz.store_check:
            progress(f"scale: first of the month ({label}): stopping the nodes (they store all)")
        t1 = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda p: finish(svc, p, sz.store_check), nodes))
        stopped = True
        drain_s = time.monotonic() - t1
    finally:
        if not stopped:
            for p in nodes:
                svc.stop_node(p)
    acked = tally.items + n * 3  # the load's items and the warm-up's
    stored: list[int] | None = None
    if sz.store_check:
        keys = [(t, f, per) for ps in pairs for t, f in ps for per in (old, new)]
        stored = _stored_ddb(env["METER_DYNAMODB_ENDPOINT"], env["METER_DYNAMODB_TABLE"], keys)

    window = [c for c in calls if m_boundary <= c.due < m_boundary + sz.rollover_window_s]
    before = [c for c in calls if c.due < m_boundary]
    seeding = {
        k: [_seeding(a, b) for a, b in zip(snaps[x], snaps[y], strict=True)]
        for k, (x, y) in {
            "before_boundary": ("start", "boundary"),
            "window": ("boundary", "window_end"),
            "whole_load": ("start", "end"),
        }.items()
    }
    return {
        "label": label,
        "node_env": extra,
        "window": _lat(window),
        "before": _lat(before),
        "overall": _lat(calls),
        "timeline": _timeline(calls, m_boundary, t_start),
        "read_ahead_from_s": _read_ahead_from(extra),
        "per_node_window_p99_ms": [
            _lat([c for c in window if c.node == i])["p99_ms"] for i in range(3)
        ],
        "unanswered": sum(c.lat_ns < 0 for c in calls),
        "calls_not_fully_counted": sum(not c.ok for c in calls),
        "errors": tally.errors,
        "nil_answers": tally.nil,
        "client_max_send_lag_ms": lag * 1000,
        "seeding": seeding,
        "keys_per_node": n,
        "items_per_call": items,
        "calls_per_s_per_node": per_s,
        "items_per_s_all_nodes": per_s * items * 3,
        "every_key_touched_every_s": sz.rollover_sweep_s,
        "boundary": f"{old} -> {new}",
        "seconds_of_load_before_boundary": round(before_s, 2),
        "seconds_of_load_after_boundary": sz.rollover_after_s,
        "window_s": sz.rollover_window_s,
        "warmup_seconds": round(warm_s, 2),
        "warmup_keys_per_s": 3 * n / warm_s,
        "warmup_wrong_answers": sum(p.wrong + p.nil + p.errors for p in warmed),
        "node_flush": flush_how,
        "stop_seconds": round(drain_s, 2),
        "loadavg_start_end": [load0, load1],
        "acked_items": acked,
        "stored_total": None if stored is None else sum(stored),
        "stored_total_new_period": None if stored is None else sum(stored[1::2]),
        "stored_exact": None if stored is None else sum(stored) == acked,
        "stored": STORED_HOW[sz.store_check],
    }


def first_of_month(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    rows: list[Row] = []
    modes = read_ahead_modes(sizes)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in modes}

    def run(label: str, env: dict[str, str]) -> None:
        # A machine busy enough to make the setup overrun its budget gets a longer one.
        setup = sizes.scale.rollover_setup_s
        for attempt in range(3):
            try:
                got = _first_of_month(svc, sizes, progress, label, env, setup)
            except SetupOverran as exc:
                if attempt == 2:
                    raise
                progress(f"scale: first of the month ({label}): {exc}; again, twice as long")
                setup *= 2
                continue
            got["setup_budget_s"] = setup
            runs[label].append(got)
            return

    # With two modes, the order turns each round: off, on; then on, off; ...
    for r in range(sizes.scale.rollover_rounds):
        in_turn(r, *(partial(run, label, env) for label, env in modes))
    n = sizes.scale.rollover_keys
    for label, _ in modes:
        got = runs[label]
        p99w = median([g["window"]["p99_ms"] for g in got])
        p99o = median([g["overall"]["p99_ms"] for g in got])
        sound = all(
            g["stored_exact"] is not False
            and g["errors"] == 0
            and g["nil_answers"] == 0
            and g["unanswered"] == 0
            and g["calls_not_fully_counted"] == 0
            and g["stored_total_new_period"] != 0
            for g in got
        )
        detail = {"runs": got, "clustered": "3 nodes, DynamoDB Local, one redis-server"}
        w = sizes.scale.rollover_window_s
        rows.append(
            Row(
                SCALE,
                f"first of the month, 3 nodes x {n:,} keys, {label}: p99 call latency, "
                f"{w:.0f} s after the boundary",
                "ms",
                p99w,
                ROLLOVER_P99_MS,
                p99w / ROLLOVER_P99_MS,
                f"<= {ROLLOVER_P99_MS:.0f} ms",
                p99w <= ROLLOVER_P99_MS and sound,
                {
                    **detail,
                    "p50_ms": median([g["window"]["p50_ms"] for g in got]),
                    "max_ms": max(g["window"]["max_ms"] for g in got),
                },
                "target",
            )
        )
        rows.append(
            Row(
                SCALE,
                f"first of the month, 3 nodes x {n:,} keys, {label}: p99 call latency, whole load",
                "ms",
                p99o,
                ROLLOVER_P99_MS,
                p99o / ROLLOVER_P99_MS,
                f"<= {ROLLOVER_P99_MS:.0f} ms",
                p99o <= ROLLOVER_P99_MS and sound,
                {
                    "p50_ms": median([g["overall"]["p50_ms"] for g in got]),
                    "max_ms": max(g["overall"]["max_ms"] for g in got),
                    "before_boundary_p99_ms": median([g["before"]["p99_ms"] for g in got]),
                },
                "target",
            )
        )
    return rows


def _converge(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    from bench.scale_converge import convergence_rows  # it builds on this module

    return convergence_rows(svc, sizes, progress)


PARTS = {
    "ddb": ("DynamoDB cold seeding", ddb_cold),
    "sqlite": ("SQLite cold seeding", sqlite_cold),
    "rollover": ("first of the month", first_of_month),
    "converge": ("convergence under load", _converge),
}


def scale(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    """The three parts; one that fails gives a row saying so, and the others still run.
    ``BENCH_SCALE_PARTS`` (e.g. ``ddb,rollover``) runs only some."""
    rows: list[Row] = []
    only = os.environ.get(PARTS_ENV)
    for key, (name, part) in PARTS.items():
        if only and key not in only.split(","):
            continue
        try:
            rows.extend(part(svc, sizes, progress))
        except Exception as exc:
            progress(f"scale: {name} FAILED: {type(exc).__name__}: {exc}")
            rows.append(
                Row(
                    SCALE,
                    name,
                    "-",
                    None,
                    None,
                    None,
                    "-",
                    None,
                    {"status": f"failed: {type(exc).__name__}: {exc}"[:500]},
                )
            )
    return rows
