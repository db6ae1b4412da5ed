"""Gossip shards on a real Redis Cluster (ADR 0024): 3 masters with a replica each on free
loopback ports. The bus hears every shard's channel wherever its slot lives, and again after a
master is killed and its replica promoted; three real nodes on it agree exactly with storage,
through such a failover under load, with nothing lost or counted twice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
from redis.asyncio.cluster import ClusterNode

from cluster.bus import BusUnavailable
from cluster.redis_cluster_bus import DOWN_AFTER_S, RedisClusterBus, startup_nodes
from cluster.shards import ShardMap
from meter.core.keys import period_start
from storage.dynamodb import DynamoDBStorage
from tests.support.cluster_harness import KEY_TENANT, Fleet, Load, wait_until
from tests.support.dynamodb_local import free_port
from tests.support.nodes import short_tmpdir
from tests.support.redis_cluster import RedisCluster

pytestmark = [pytest.mark.slow, pytest.mark.redis]

K = 8


@pytest.fixture
def redis_cluster() -> Iterator[RedisCluster]:
    with RedisCluster(short_tmpdir("rc-")) as rc:
        yield rc.start()


def test_startup_nodes_take_host_port_items_and_one_url() -> None:
    nodes, options = startup_nodes(
        ["127.0.0.1:7000", "rediss://u:pw@10.0.0.2:7001?ssl_ca_certs=/ca"]
    )
    assert nodes[0].name == ClusterNode("127.0.0.1", 7000).name and nodes[1].port == 7001
    assert options["username"] == "u" and options["password"] == "pw"
    assert options["ssl"] is True and options["ssl_ca_certs"] == "/ca"
    for bad in (["h"], ["h:0"], ["h:x"], [":7000"], [], ["unix:///tmp/s"],
                ["redis://a:1", "redis://b:2"]):  # fmt: skip
        with pytest.raises(ValueError):
            startup_nodes(bad)


async def _until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


async def test_every_shard_is_heard_across_the_masters_and_again_after_a_failover(
    redis_cluster: RedisCluster,
) -> None:
    shards = ShardMap("rc", K)
    got: list[bytes] = []
    states: list[bool] = []
    a = RedisClusterBus(redis_cluster.nodes_arg.split(","), shards.control)
    b = RedisClusterBus(redis_cluster.nodes_arg.split(","), shards.control)
    await a.start(got.append, states.append)
    await b.start(lambda _: None, lambda _: None)
    try:
        await _until(lambda: a.connected and b.connected, 10, "both buses connect")
        await a.listen(shards.channels)
        for i, channel in enumerate(shards.channels):
            await b.publish(b"s%d" % i, channel)
        await b.publish(b"control")
        await _until(lambda: len(got) == K + 1, 5, "every shard and the control heard")
        assert sorted(got) == sorted([b"s%d" % i for i in range(K)] + [b"control"])
        # Kill the master holding shard 0's channel: its replica takes over, the bus moves
        # the subscription, and what is published from then on is heard again.
        victim = redis_cluster.master_of_slot(_slot(shards.channels[0]))
        await asyncio.to_thread(redis_cluster.kill_master, victim)
        got.clear()

        async def heard_again() -> bool:
            try:
                await b.publish(b"after", shards.channels[0])
            except Exception:
                return False
            await asyncio.sleep(0.05)
            return b"after" in got

        deadline = time.monotonic() + 15
        while not await heard_again():
            assert time.monotonic() < deadline, "shard 0 not heard after the failover"
        assert a.moves >= 1 and states == [True]  # never down as a whole
    finally:
        await a.close()
        await b.close()


async def test_a_cluster_out_of_reach_is_down_and_the_bus_keeps_trying(
    redis_cluster: RedisCluster,
) -> None:
    """Unreachable at start: down, saying why, trying on; reachable: up; every master and
    replica killed: down within a few seconds (DOWN_AFTER_S of no slot map), publishing and
    listening refused, never an error of the client's own."""
    nowhere = RedisClusterBus([f"127.0.0.1:{free_port()}"], "meter:x:control", max_backoff=0.2)
    await nowhere.start(lambda _: None, lambda _: None)
    try:
        await _until(lambda: nowhere.last_error is not None, 10, "the first failure is said")
        await asyncio.sleep(0.5)  # (some more tries)
        assert not nowhere.connected and nowhere.connects == 0
        for call in (nowhere.publish(b"x"), nowhere.listen(["meter:x:gossip:0"])):
            with pytest.raises(BusUnavailable):
                await call
    finally:
        await nowhere.close()
    states: list[bool] = []
    bus = RedisClusterBus(redis_cluster.nodes_arg.split(","), "meter:x:control")
    await bus.start(lambda _: None, states.append)
    try:
        await _until(lambda: bus.connected, 10, "the bus connects")
        redis_cluster.stop()
        await _until(lambda: not bus.connected, DOWN_AFTER_S + 5, "the bus says it is down")
        assert states == [True, False] and bus.last_error
        with pytest.raises(BusUnavailable):
            await bus.publish(b"x")
        with pytest.raises(BusUnavailable):
            await bus.xadd("meter:alerts", {"a": "1"}, 10)
    finally:
        await bus.close()


def _slot(channel: str) -> int:
    from redis.crc import key_slot

    return int(key_slot(channel.encode()))


async def _stored(endpoint: str, table: str, tenants: list[str], feature: str) -> dict[str, int]:
    store = DynamoDBStorage(table, endpoint_url=endpoint)
    await store.open()
    try:
        keys = [(t, feature, period_start("month", None)) for t in tenants]
        got = await store.load(keys)
        return {k[0]: got[k].total for k in keys}
    finally:
        await store.close()


@pytest.mark.dynamodb
async def test_three_nodes_on_the_cluster_agree_exactly_through_a_master_failover(
    fleet: Fleet, redis_cluster: RedisCluster, dynamodb_local: str, dynamodb_table: str
) -> None:  # fmt: skip
    nodes = fleet(3, METER_REDIS_URL="", METER_REDIS_CLUSTER_NODES=redis_cluster.nodes_arg,
                  METER_GOSSIP_SHARDS=str(K))  # fmt: skip
    st = nodes[0].call("status")["cluster"]
    assert st["bus"]["kind"] == "redis-cluster" and st["shards"] == K
    load = Load(nodes, ["api", "seats"]).start()
    wait_until(lambda: min(load.acked) >= 500, 30, "every node counted under load", nodes)
    victim = redis_cluster.masters()[0]
    redis_cluster.kill_master(victim)
    acked = list(load.acked)
    wait_until(lambda: all(a >= b + 300 for a, b in zip(load.acked, acked, strict=True)),
               30, "every node counts on after the failover", nodes)  # fmt: skip
    load.stop_node_load()
    assert load.errors == [0, 0, 0]
    wait_until(
        lambda: all(not p.call("status")["flush"]["backlog_keys"] for p in nodes),
        30, "everything flushed", nodes,
    )  # fmt: skip
    features = ["api", "seats"]
    db = {
        f: (await _stored(dynamodb_local, dynamodb_table, [KEY_TENANT], f))[KEY_TENANT]
        for f in features
    }
    assert sum(db.values()) == load.total  # nothing lost, nothing counted twice
    wait_until(
        lambda: all(
            [p.call("usage", KEY_TENANT, f) for p in nodes] == [db[f]] * 3 for f in features
        ),
        20, "every view equals storage after the resyncs", nodes,
    )  # fmt: skip
    gaps = [p.call("status")["cluster"]["shard_gaps"] for p in nodes]
    print(f"\nfailover of master {victim}: shard gaps seen {gaps}, stored {db}")
    with pytest.raises(RuntimeError) as info:  # another K on the same cluster: refused
        fleet.node("n9", METER_REDIS_URL="", METER_REDIS_CLUSTER_NODES=redis_cluster.nodes_arg,
                   METER_GOSSIP_SHARDS="4")  # fmt: skip
    assert "exited 2" in str(info.value) and f"gossip_shards = {K}, this node has 4" in str(
        info.value
    )
