"""Sharded gossip (ADR 0024) between real node processes on one redis-server and a DynamoDB
Local table: exact views across shards, a ``warm`` node joining the shards it needs, and a node
started with another ``gossip_shards`` refused."""

from __future__ import annotations

from collections import Counter

import pytest

from cluster.shards import shard_of
from tests.support.cluster_harness import Conn, Fleet, wait_until
from tests.support.nodes import NodeProcess

pytestmark = [pytest.mark.slow, pytest.mark.dynamodb, pytest.mark.redis]

#: Tenants on shards 1, 3, 0 and 2 of four.
TENANTS = ["t0", "t1", "t4", "t5"]


def views(nodes: list[NodeProcess], tenant: str) -> list[int]:
    return [p.call("usage", tenant, "api") for p in nodes]


def test_sharded_nodes_agree_exactly_a_warm_node_joins_and_another_k_is_refused(
    fleet: Fleet,
) -> None:
    assert sorted(shard_of(t, 4) for t in TENANTS) == [0, 1, 2, 3]
    nodes = fleet(3, METER_GOSSIP_SHARDS="4", each={2: {"METER_GOSSIP_SUBSCRIBE": "warm"}})
    warm = nodes[2]
    assert warm.call("status")["cluster"]["listening"] == 0  # holds no tenant yet
    conns = [Conn(p.socket) for p in nodes[:2]]
    acked: Counter[str] = Counter()
    try:
        for r in range(200):
            tenant = TENANTS[r % len(TENANTS)]
            conns[(r // 4) % 2].ok("track", tenant, "api", 1 + r % 5)
            acked[tenant] += 1 + r % 5
    finally:
        for c in conns:
            c.close()
    for tenant in TENANTS:  # within a tick or so; a second allows for this shared machine
        wait_until(
            lambda t=tenant: views(nodes[:2], t) == [acked[t]] * 2,  # type: ignore[misc]
            5,
            f"both full nodes show {tenant}'s {acked[tenant]}",
            nodes,
        )
    full = nodes[0].call("status")["cluster"]
    assert full["shards"] == 4 and full["listening"] == 4
    assert full["rejected"] == dict.fromkeys(full["rejected"], 0)
    assert all(n > 0 for n in full["sent"]["shard_seqs"])
    # The warm node reads t0 (seeding it from storage): it joins t0's shard, and from then on
    # hears t0's units, and only the shards it holds.
    assert warm.call("usage", "t0", "api") <= acked["t0"]
    wait_until(
        lambda: warm.call("status")["cluster"]["listening"] == 1, 5, "warm joins one shard", nodes
    )
    nodes[0].call("track", "t0", "api", 7)
    nodes[1].call("track", "t1", "api", 7)
    acked["t0"] += 7
    wait_until(lambda: views(nodes, "t0") == [acked["t0"]] * 3, 5, "warm hears t0", nodes)
    st = warm.call("status")["cluster"]
    assert st["listening"] == 1 and st["shard_joins"] == 1
    # A node with another K is refused before it serves, saying what the cluster has.
    with pytest.raises(RuntimeError) as info:
        fleet.node("n9", METER_GOSSIP_SHARDS="2")
    assert "exited 2" in str(info.value)
    assert "created with gossip_shards = 4, this node has 2" in str(info.value)
