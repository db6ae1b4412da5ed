"""Real node processes in a cluster: one redis-server, one DynamoDB Local table, 2-3 nodes.

Every node is ``python -m meter serve`` with its own id; the tests talk to them over their
sockets and read the table directly. Timing is only reported (``-s`` shows it), asserted loosely.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from cluster.bus import channel_name
from cluster.codec import Codec, Header
from meter.keys import period_start
from storage.dynamodb import DynamoDBStorage
from tests.cluster_harness import (
    KEY_TENANT,
    Load,
    measure_visibility,
    node_env,
    start_nodes,
    usages,
    wait_until,
)
from tests.nodes import NodeProcess, short_tmpdir
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.dynamodb, pytest.mark.redis]

FEATURES = ["api", "seats", "tokens"]


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = short_tmpdir("mc-")
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def nodes_cleanup() -> Iterator[list[NodeProcess]]:
    started: list[NodeProcess] = []
    yield started
    for p in started:
        if p.proc is not None and p.proc.poll() is None:
            p.kill()


StartCluster = Callable[..., list[NodeProcess]]


@pytest.fixture
def start_cluster(
    workdir: Path,
    redis_server: RedisServer,
    dynamodb_local: str,
    dynamodb_table: str,
    cluster_name: str,
    nodes_cleanup: list[NodeProcess],
) -> StartCluster:
    """``start_cluster(n, **METER_env)``: n real nodes on this test's Redis and table."""

    def start(n: int, **extra: str) -> list[NodeProcess]:
        env = node_env(
            redis_url=redis_server.url,
            dynamodb_endpoint=dynamodb_local,
            table=dynamodb_table,
            cluster=cluster_name,
            **extra,
        )
        nodes = start_nodes(workdir, n, env)
        nodes_cleanup.extend(nodes)
        return nodes

    return start


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


async def test_a_unit_is_visible_on_every_node_within_about_a_tick(
    start_cluster: StartCluster,
) -> None:
    nodes = start_cluster(3)
    r = measure_visibility(nodes, "api", samples=40, tick_s=0.1)
    print(f"\nconvergence, 3 nodes, tick 100 ms: {r}")
    assert r["anomalies"] == []  # never above the truth, never below the previous value
    assert r["p99_ms"] < 2000
    st = nodes[0].call("status")["cluster"]
    print("peer lag:", {k: (v["lag_p50_ms"], v["lag_p99_ms"]) for k, v in st["peers"].items()})
    assert st["bus"]["connected"] and st["rejected"]["malformed"] == 0


async def test_concurrent_load_on_three_nodes_agrees_exactly_with_the_database(
    start_cluster: StartCluster,
    dynamodb_local: str,
    dynamodb_table: str,
) -> None:
    nodes = start_cluster(3)
    load = Load(nodes, FEATURES).start()
    time.sleep(3)
    load.stop_node_load()
    assert load.errors == [0, 0, 0]
    wait_until(lambda: flushed(nodes), 20, "everything is flushed", nodes)
    time.sleep(0.3)  # a quiet tick (and the last announcements)
    total = 0
    for f in FEATURES:
        db = await stored(dynamodb_local, dynamodb_table, f)
        views = usages(nodes, f)
        print(f"{f}: views {views}, database {db}")
        assert views == [db] * 3
        total += db
    print(f"acknowledged {load.acked} = {load.total}, database {total}")
    assert total == load.total
    for p in nodes:
        c = p.call("status")["cluster"]
        assert c["rejected"] == dict.fromkeys(c["rejected"], 0)


async def test_redis_killed_mid_load_and_restarted_loses_nothing(
    workdir: Path,
    redis_factory: Callable[..., RedisServer],
    dynamodb_local: str,
    dynamodb_table: str,
    cluster_name: str,
    nodes_cleanup: list[NodeProcess],
) -> None:
    server = redis_factory()
    env = node_env(
        redis_url=server.url,
        dynamodb_endpoint=dynamodb_local,
        table=dynamodb_table,
        cluster=cluster_name,
    )
    nodes = start_nodes(workdir, 3, env)
    nodes_cleanup.extend(nodes)
    load = Load(nodes, FEATURES).start()
    time.sleep(1)
    server.stop()
    wait_until(
        lambda: not any(p.call("status")["cluster"]["bus"]["connected"] for p in nodes),
        10,
        "every node sees Redis down",
        nodes,
    )
    time.sleep(1.5)  # nodes keep serving and flushing without Redis
    acked_during = load.total
    server.start()
    wait_until(
        lambda: all(p.call("status")["cluster"]["bus"]["connected"] for p in nodes),
        15,
        "every node reconnects",
        nodes,
    )
    time.sleep(1)
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
    start_cluster: StartCluster,
    dynamodb_local: str,
    dynamodb_table: str,
) -> None:
    nodes = start_cluster(3, METER_FLUSH_INTERVAL_MS="1000")
    load = Load(nodes, FEATURES).start()
    time.sleep(2.5)
    victim = nodes[2]
    os.kill(victim.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
    victim.stop()
    time.sleep(1.0)  # the survivors keep serving under load
    load.stop_node_load()
    survivors = nodes[:2]
    assert load.errors[:2] == [0, 0]
    wait_until(lambda: flushed(survivors), 20, "survivors flushed", survivors)
    wait_until(
        lambda: (
            all(p.call("status")["cluster"]["live_peers"] == [] for p in survivors[:1])
            or all("n2" not in p.call("status")["cluster"]["live_peers"] for p in survivors)
        ),
        10,
        "n2 is declared dead",
        survivors,
    )
    time.sleep(0.5)
    db_total = sum([await stored(dynamodb_local, dynamodb_table, f) for f in FEATURES])
    views = [sum(usages(survivors, f)[i] for f in FEATURES) for i in range(2)]
    lost = load.total - db_total
    print(
        f"\nSIGKILL: n2 acknowledged {load.acked[2]} units; {lost} of them were not flushed and "
        f"wait in its log (acknowledged total {load.total}, database {db_total}); survivors' views "
        f"{views} (view - database = {[v - db_total for v in views]})"
    )
    assert 0 <= lost <= load.acked[2]
    assert views[0] == views[1]
    # The survivors forget the dead node's gossiped-but-unflushed units: views == database.
    assert views == [db_total, db_total]
    # Its units are not lost, only waiting in its write-ahead log: started again on its data
    # dir, the node replays them and flushes them, once, and every view reaches the total.
    victim.start()
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
    start_cluster: StartCluster,
    redis_server: RedisServer,
    cluster_name: str,
) -> None:
    nodes = start_cluster(2, METER_CLUSTER_SECRET="correct horse")
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
    start_cluster: StartCluster, dynamodb_local: str, dynamodb_table: str
) -> None:
    nodes = start_cluster(
        2,
        METER_FLUSH_INTERVAL_MS="60000",  # only the drain flushes
        METER_GOSSIP_INTERVAL_MS="60000",  # only the drain gossips
        METER_CLUSTER_RECONCILE_S="0",
    )
    assert usages(nodes, "api") == [0, 0]
    nodes[0].call("track", KEY_TENANT, "api", 42)
    assert nodes[0].stop() == 0  # SIGTERM: drain, announce, close
    assert await stored(dynamodb_local, dynamodb_table, "api") == 42
    wait_until(lambda: usages(nodes[1:], "api") == [42], 5, "the drain's announcement", nodes)
    received = nodes[1].call("status")["cluster"]["received"]
    assert received["announcements_applied"] == 1
