"""Real node processes in a cluster: one redis-server, one DynamoDB Local table, 2-3 nodes.

Every node is ``python -m meter serve`` with its own id; the tests talk to them over their
sockets and read the table directly. They wait on conditions with deadlines, never on fixed
sleeps; timings are reported (``-s`` shows them).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
import redis

from cluster.bus import channel_name
from cluster.codec import Codec, Header
from meter.core.keys import period_start
from storage.dynamodb import DynamoDBStorage
from tests.support.cluster_harness import (
    KEY_TENANT,
    Fleet,
    Load,
    measure_visibility,
    usages,
    wait_until,
)
from tests.support.nodes import NodeProcess
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.dynamodb, pytest.mark.redis]

FEATURES = ["api", "seats", "tokens"]


async def stored(endpoint: str, table: str, feature: str) -> int:
    store = DynamoDBStorage(table, endpoint_url=endpoint)
    await store.open()
    try:
        key = (KEY_TENANT, feature, period_start("month", None))
        return (await store.load([key]))[key].total
    finally:
        await store.close()


def flushed(nodes: list[NodeProcess]) -> bool:
    for p in nodes:
        st = p.call("status")
        if st["flush"]["backlog_keys"] or st["keys"]["dirty"]:
            return False
    return True


def flush_stat(nodes: list[NodeProcess], name: str) -> list[int]:
    """One counter of every node's ``status.flush``."""
    return [int(p.call("status")["flush"][name]) for p in nodes]


def grew(now: list[int], before: list[int], by: int) -> bool:
    """Every value grew by at least ``by``."""
    return len(now) == len(before) and all(a >= b + by for a, b in zip(now, before, strict=True))


@pytest.mark.quiet
async def test_a_unit_is_visible_on_every_node_within_about_a_tick(fleet: Fleet) -> None:
    """docs/cluster.md claims a p99 of at most one tick + 20 ms from a track on one node to
    the unit showing on every other; this shared 2-core machine gets a margin of 60 ms (p99
    measured 97-112 ms here with two CPU hogs running beside the nodes)."""
    nodes = fleet(3)
    tick_ms = 100
    r = measure_visibility(nodes, "api", samples=100, tick_s=tick_ms / 1000)
    print(f"\nconvergence, 3 nodes, tick {tick_ms} ms: {r}")
    assert r["anomalies"] == []  # never above the truth, never below the previous value
    assert r["p50_ms"] <= tick_ms, r  # the tick's phase is uniform: the median is about half
    assert r["p99_ms"] <= tick_ms + 20 + 60, r
    st = nodes[0].call("status")["cluster"]
    print("peer lag:", {k: (v["lag_p50_ms"], v["lag_p99_ms"]) for k, v in st["peers"].items()})
    assert st["bus"]["connected"] and st["rejected"]["malformed"] == 0


async def test_concurrent_load_on_three_nodes_agrees_exactly_with_the_database(
    fleet: Fleet,
    dynamodb_local: str,
    dynamodb_table: str,
) -> None:
    nodes = fleet(3)
    load = Load(nodes, FEATURES).start()
    # Load until every node has acknowledged a few thousand units and flushed under load.
    rounds0 = flush_stat(nodes, "rounds")
    wait_until(
        lambda: min(load.acked) >= 3000 and grew(flush_stat(nodes, "rounds"), rounds0, 2),
        30,
        "every node counted and flushed under load",
        nodes,
    )
    load.stop_node_load()
    assert load.errors == [0, 0, 0]
    wait_until(lambda: flushed(nodes), 20, "everything is flushed", nodes)
    dbs = {f: await stored(dynamodb_local, dynamodb_table, f) for f in FEATURES}
    assert sum(dbs.values()) == load.total, (dbs, load.acked)
    # Nothing is written any more: the last announcements reach every node within a quiet
    # tick or so (100 ms; 1 s allows for this shared 2-core machine).
    took = wait_until(
        lambda: all(usages(nodes, f) == [dbs[f]] * 3 for f in FEATURES),
        1.0,
        "every view equals the database",
        nodes,
        step=0.01,
    )
    total = 0
    for f in FEATURES:
        views = usages(nodes, f)
        print(f"{f}: views {views}, database {dbs[f]}")
        assert views == [dbs[f]] * 3
        total += dbs[f]
    print(f"views agreed {took * 1000:.0f} ms after the last flush")
    print(f"acknowledged {load.acked} = {load.total}, database {total}")
    assert total == load.total
    # Three nodes flushing the same hot keys in transactions (the default, ADR 0015).
    writes = [p.call("status")["flush"]["writes"] for p in nodes]
    print("flush writes:", writes)
    assert all(w["mode"] == "auto" and w["transactions"] > 0 for w in writes)
    for p in nodes:
        c = p.call("status")["cluster"]
        assert c["rejected"] == dict.fromkeys(c["rejected"], 0)


async def test_redis_killed_mid_load_and_restarted_loses_nothing(
    fleet: Fleet,
    redis_factory: Callable[..., RedisServer],
    dynamodb_local: str,
    dynamodb_table: str,
) -> None:
    server = redis_factory()
    nodes = fleet(3, redis=server)
    load = Load(nodes, FEATURES).start()
    wait_until(lambda: min(load.acked) >= 2000, 20, "load on every node", nodes)
    server.stop()
    wait_until(
        lambda: not any(p.call("status")["cluster"]["bus"]["connected"] for p in nodes),
        10,
        "every node sees Redis down",
        nodes,
    )
    # Without Redis every node keeps serving and flushing.
    acked_down = list(load.acked)
    written = flush_stat(nodes, "keys_written")
    wait_until(
        lambda: (
            grew(load.acked, acked_down, 1000)
            and grew(flush_stat(nodes, "keys_written"), written, 1)
        ),
        20,
        "every node serves and flushes without Redis",
        nodes,
    )
    acked_during = load.total
    server.start()
    wait_until(
        lambda: all(p.call("status")["cluster"]["bus"]["connected"] for p in nodes),
        15,
        "every node reconnects",
        nodes,
    )
    acked_up = load.total
    wait_until(lambda: load.total >= acked_up + 3000, 20, "load after the reconnect", nodes)
    load.stop_node_load()
    assert load.errors == [0, 0, 0] and load.total > acked_during > 0
    wait_until(lambda: flushed(nodes), 20, "everything is flushed", nodes)
    total = 0
    for f in FEATURES:
        db = await stored(dynamodb_local, dynamodb_table, f)

        def converged(f: str = f, db: int = db) -> bool:
            return usages(nodes, f) == [db] * 3

        wait_until(converged, 5, f"{f} converges", nodes)
        total += db
    assert total == load.total
    st = nodes[0].call("status")["cluster"]
    print(f"\nafter the outage: resyncs {st['resyncs']}, sent {st['sent']}")
    assert st["resyncs"]["connect"] >= 2 and st["bus"]["connects"] >= 2


async def test_a_sigkilled_node_loses_only_what_it_had_not_flushed(
    fleet: Fleet,
    dynamodb_local: str,
    dynamodb_table: str,
) -> None:
    nodes = fleet(3, METER_FLUSH_INTERVAL_MS="1000")
    victim, survivors = nodes[2], nodes[:2]
    load = Load(nodes, FEATURES).start()
    # Kill n2 once it has flushed under load (some of its units are stored, and it always
    # holds up to a flush interval of units it has not flushed).
    wait_until(
        lambda: min(load.acked) >= 2000 and victim.call("status")["flush"]["rounds"] >= 2,
        30,
        "n2 counted and flushed under load",
        nodes,
    )
    os.kill(victim.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
    victim.stop()
    # The survivors keep serving under load.
    acked_at_kill = list(load.acked)
    wait_until(
        lambda: grew(load.acked[:2], acked_at_kill[:2], 1000),
        20,
        "the survivors serve on",
        survivors,
    )
    load.stop_node_load()
    assert load.errors[:2] == [0, 0]
    wait_until(lambda: flushed(survivors), 20, "survivors flushed", survivors)
    wait_until(
        lambda: all("n2" not in p.call("status")["cluster"]["live_peers"] for p in survivors),
        10,
        "n2 is declared dead",
        survivors,
    )
    db_total = sum([await stored(dynamodb_local, dynamodb_table, f) for f in FEATURES])
    acked_n2 = load.acked[2]
    # What n2 acknowledged and had not flushed: all of the shortfall, and nothing else.
    lost = load.total - db_total
    # The survivors forget the dead node's gossiped-but-unflushed units: views == database.
    wait_until(
        lambda: (
            [sum(usages(survivors, f)[i] for f in FEATURES) for i in range(2)] == [db_total] * 2
        ),
        10,
        "the survivors' views equal the database",
        survivors,
    )
    forgotten = [p.call("status")["cluster"]["forgotten_units"] for p in survivors]
    print(
        f"\nSIGKILL: n2 acknowledged {acked_n2} units; {lost} of them were not flushed and "
        f"wait in its log (acknowledged total {load.total}, database {db_total}); the "
        f"survivors forgot {forgotten} units n2 had gossiped but not flushed"
    )
    assert 0 < lost <= acked_n2, "a flush interval of n2's units is unflushed at the kill"
    # Its units are not lost, only waiting in its write-ahead log: started again on its data
    # dir, the node replays them and flushes them, once, and every view reaches the total.
    victim.start()
    load.resend_in_doubt(2)  # the call the kill left unanswered: counted once, by its ids
    wait_until(lambda: flushed(nodes), 20, "the restarted node flushed", nodes)
    db_total = sum([await stored(dynamodb_local, dynamodb_table, f) for f in FEATURES])
    assert db_total == load.total
    wait_until(
        lambda: [sum(usages(nodes, f)[i] for f in FEATURES) for i in range(3)] == [load.total] * 3,
        10,
        "every view equals the acknowledged total",
        nodes,
    )


async def test_forged_and_garbage_messages_are_rejected_and_counted(
    fleet: Fleet,
    redis_server: RedisServer,
    cluster_name: str,
) -> None:
    nodes = fleet(2, METER_CLUSTER_SECRET="correct horse")
    nodes[0].call("track", KEY_TENANT, "api", 5)
    wait_until(lambda: usages(nodes, "api") == [5, 5], 5, "gossip works", nodes)
    key = (KEY_TENANT, "api", period_start("month", None))
    h = Header(cluster_name, "mallory", time.time_ns(), 1, time.time())
    client = redis.Redis.from_url(redis_server.url)
    ch = channel_name(cluster_name)
    try:
        client.publish(ch, Codec(cluster_name, "wrong").encode(h, "deltas", [(*key, 1, 10**6)]))
        client.publish(ch, Codec(cluster_name).encode(h, "deltas", [(*key, 1, 10**6)]))
        client.publish(ch, b"\xde\xad\xbe\xef" * 10)
        client.publish(ch, b"mg\x63\x00" + b"\x90")
    finally:
        client.close()

    def counted() -> bool:
        return all(
            (
                lambda r: (
                    r["bad_mac"] == 1
                    and r["unsigned"] == 1
                    and r["malformed"] == 1
                    and r["version"] == 1
                )
            )(p.call("status")["cluster"]["rejected"])
            for p in nodes
        )

    wait_until(counted, 5, "every node counted the rejections", nodes)
    assert usages(nodes, "api") == [5, 5]
    assert all(p.proc is not None and p.proc.poll() is None for p in nodes)


async def test_sigterm_drain_announces_the_final_flush(
    fleet: Fleet, dynamodb_local: str, dynamodb_table: str
) -> None:
    nodes = fleet(
        2,
        METER_FLUSH_INTERVAL_MS="60000",  # only the drain flushes
        METER_GOSSIP_INTERVAL_MS="60000",  # only the drain gossips
        METER_CLUSTER_RECONCILE_S="0",
    )
    assert usages(nodes, "api") == [0, 0]
    nodes[0].call("track", KEY_TENANT, "api", 42)
    assert nodes[0].stop() == 0, nodes[0].log()  # SIGTERM: drain, announce, close
    assert await stored(dynamodb_local, dynamodb_table, "api") == 42
    wait_until(lambda: usages(nodes[1:], "api") == [42], 5, "the drain's announcement", nodes)
    received = nodes[1].call("status")["cluster"]["received"]
    assert received["announcements_applied"] == 1
