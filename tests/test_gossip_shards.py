"""Sharded gossip (ADR 0024) between real counter tables in one process over the local bus:
a key's items on its tenant's shard, numbered per (sender, shard); a gap or a lost tail there
re-reads that shard's keys only; ``warm`` listens to the shards of warm tenants only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cluster.codec import Codec, Message
from cluster.gossip import Gossip
from cluster.local_bus import LocalHub
from cluster.shards import ShardMap, shard_of
from meter.config import ClusterConfig
from meter.core.gauges import GaugeTable
from meter.core.table import CounterTable
from meter.errors import ConfigError
from meter.node.loops import check_shards, shards_match
from storage.base import Snapshot
from storage.memory import MemoryStorage
from tests.test_cluster_gossip import MANUAL, Cluster, eventually

# One tenant per shard of three: acme on 2, zeta on 0, beta on 1.
Key = tuple[str, str, str]
ACME: Key = ("acme", "api", "2026-11")
ZETA: Key = ("zeta", "api", "2026-11")
BETA: Key = ("beta", "api", "2026-11")
KEYS = [ACME, ZETA, BETA]
SHARDED = replace(MANUAL, shards=3)


class Reads(MemoryStorage):
    """A memory store that remembers the keys each ``load`` read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[list[tuple[str, ...]]] = []

    async def load(self, keys: Sequence[tuple[str, ...]]) -> dict[tuple[str, ...], Snapshot]:
        self.reads.append(list(keys))
        return await super().load(keys)


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster(LocalHub(), Reads(), KEYS)
    try:
        yield c
    finally:
        await c.close()


def on_shard(shard: int) -> Callable[[bytes], bool]:
    """A hub filter dropping every frame on data shard ``shard``."""
    codec = Codec("t", shards=3)

    def drop(frame: bytes) -> bool:
        m = codec.decode(frame)
        return isinstance(m, Message) and m.header.shard == shard

    return drop


def test_the_tenants_here_fall_one_on_each_shard() -> None:
    assert [shard_of(k[0], 3) for k in KEYS] == [2, 0, 1]
    assert ShardMap("t", 1).channels == ("meter:t:gossip",)  # K = 1: today's one channel


async def test_views_converge_and_each_shard_numbers_its_own_frames(cluster: Cluster) -> None:
    a, b, c = [await cluster.add(x, settings=SHARDED) for x in "abc"]
    for node, key, qty in ((a, ACME, 5), (b, ACME, 7), (c, ZETA, 1), (a, BETA, 2)):
        cluster.track(node, key, qty)
    await cluster.quiet_tick()
    for key in KEYS:
        assert cluster.views(key) == [cluster.acked[key]] * 3
    assert a.gossip.broadcaster.shard_seqs == [0, 1, 1]  # beta's frame on 1, acme's on 2
    assert c.gossip.broadcaster.shard_seqs == [1, 0, 0]
    assert a.gossip.status()["live_peers"] == ["b", "c"]
    assert b.gossip.status()["shard_gaps"] == 0


async def test_a_gap_on_one_shard_rereads_only_that_shards_keys(cluster: Cluster) -> None:
    a, b = [await cluster.add(x, settings=SHARDED) for x in "ab"]
    store = cluster.store
    assert isinstance(store, Reads)
    cluster.track(a, ACME, 1)
    cluster.track(a, ZETA, 1)
    await cluster.quiet_tick()
    cluster.hub.drop = on_shard(2)
    cluster.track(a, ACME, 4)
    cluster.track(a, ZETA, 3)
    await cluster.quiet_tick()
    assert cluster.views(ACME) == [5, 1] and cluster.views(ZETA) == [4, 4]
    cluster.hub.drop = None
    store.reads.clear()
    cluster.track(a, ACME, 2)
    await cluster.quiet_tick()  # b sees the gap on shard 2 and re-reads acme's keys
    assert b.gossip.resyncs["gap"] == 1 and b.gossip.status()["shard_gaps"] == 1
    assert store.reads == [[ACME]]
    await a.flush()  # the units lost with the frame come back with a's announcement
    await cluster.settle()
    assert cluster.views(ACME) == [7, 7] == [await cluster.stored(ACME)] * 2
    assert cluster.views(ZETA) == [4, 4]


async def test_a_lost_tail_is_seen_one_heartbeat_after_the_one_that_told_it(
    cluster: Cluster,
) -> None:
    a, b = [await cluster.add(x, settings=SHARDED) for x in "ab"]
    a.gossip.broadcaster.heartbeat_now()  # b learns a's numbers on every shard
    await cluster.settle()
    cluster.hub.drop = on_shard(0)
    cluster.track(a, ZETA, 6)
    await cluster.quiet_tick()  # the last frame a sends on shard 0: lost
    await a.flush()  # its announcement on shard 0: lost too
    await cluster.settle()
    cluster.hub.drop = None
    assert cluster.views(ZETA) == [6, 0]
    a.gossip.broadcaster.heartbeat_now()  # tells shard 0 at 2: not heard yet, maybe late
    await cluster.settle()
    assert b.gossip.resyncs["gap"] == 0
    a.gossip.broadcaster.heartbeat_now()  # still unheard a heartbeat later: lost
    await cluster.settle()
    assert b.gossip.resyncs["gap"] == 1
    assert b.gossip.status()["shard_missed"] == 2
    assert cluster.views(ZETA) == [6, 6]  # re-read from storage


async def test_a_restart_heard_first_on_a_data_shard_is_acted_on_once(cluster: Cluster) -> None:
    a, b = [await cluster.add(x, settings=SHARDED) for x in "ab"]
    cluster.track(a, ACME, 3)
    await cluster.quiet_tick()
    assert cluster.views(ACME) == [3, 3]
    await a.gossip.stop(timeout=1)
    cluster.nodes.remove(a)
    # a restarts (a newer incarnation) without its unflushed 3: lost with the process here.
    cluster.acked[ACME] -= 3
    a2 = await cluster.add("a", settings=SHARDED)
    cluster.track(a2, ACME, 2)
    a2.tick()  # on shard 2, before any heartbeat of the new incarnation reaches b
    await cluster.settle()
    assert b.gossip.resyncs["peer"] == 1 and b.table.value(ACME) == 2
    a2.gossip.broadcaster.heartbeat_now()  # the control channel now says so too: no repeat
    await cluster.settle()
    assert b.gossip.resyncs["peer"] == 1 and b.table.value(ACME) == 2


async def test_warm_listens_to_the_shards_of_warm_tenants_and_joins_with_a_reread(
    cluster: Cluster,
) -> None:
    warm = replace(SHARDED, subscribe="warm", warm_check=0.01)
    a = await cluster.add("a", settings=SHARDED)
    b = await cluster.add("b", settings=warm, warm=[ACME])
    await eventually(lambda: b.gossip.listening == {2}, 2.0, "b listens to acme's shard")
    cluster.track(a, ZETA, 4)
    cluster.track(a, ACME, 1)
    await cluster.quiet_tick()
    assert b.gossip.received["deltas_applied"] == 1  # acme's; zeta's shard is not heard
    await a.flush()
    await cluster.settle()
    # b warms zeta: it joins shard 0 and re-reads zeta's keys (a flushed them meanwhile).
    b.table.seed(ZETA, (await cluster.store.load([ZETA]))[ZETA])
    await eventually(lambda: b.gossip.listening == {0, 2}, 2.0, "b joins zeta's shard")
    assert b.gossip.status()["shard_joins"] == 2
    cluster.track(a, ZETA, 2)
    await cluster.quiet_tick()
    assert b.table.value(ZETA) == 6 == cluster.acked[ZETA]


# -- any interleaving: nothing lost, nothing counted twice ----------------------------------

Op = tuple[str, int, Key, int, int | None]
"""``(kind, node, key, units, shard)``: a track of ``units`` on ``key`` at ``node``, a tick or
a flush or a heartbeat of ``node``, from now on losing every frame on ``shard`` (``None``:
the control channel), or losing nothing any more."""
KINDS = ["track", "track", "track", "tick", "tick", "flush", "heartbeat", "lose", "lose", "hear"]
OPS = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.integers(0, 2),
        st.sampled_from(KEYS),
        st.integers(-3, 9),
        st.sampled_from([None, 0, 1, 2]),
    ),
    max_size=40,
)


async def _run(ops: list[Op], shards: int) -> None:
    c = Cluster(LocalHub(), MemoryStorage(), KEYS)
    codec = Codec("t", shards=shards)
    lost: set[int | None] = set()

    def drop(frame: bytes) -> bool:
        m = codec.decode(frame)
        return isinstance(m, Message) and m.header.shard in lost

    c.hub.drop = drop
    try:
        nodes = [await c.add(x, settings=replace(MANUAL, shards=shards)) for x in "abc"]
        for kind, i, key, units, shard in ops:
            if kind == "track":
                c.track(nodes[i], key, units)
            elif kind == "tick":
                nodes[i].tick()
            elif kind == "flush":
                await nodes[i].flush()
            elif kind == "heartbeat":
                nodes[i].gossip.broadcaster.heartbeat_now()
            elif kind == "lose":
                lost.add(shard if shards > 1 else None)
            else:
                lost.clear()
            await c.settle()
        lost.clear()
        for n in nodes:  # every unit out and stored; then two heartbeats show lost tails
            n.tick()
            await n.flush()
        await c.settle()
        for _ in range(2):
            for n in nodes:
                n.gossip.broadcaster.heartbeat_now()
            await c.settle()
        for key in KEYS:
            assert await c.stored(key) == c.acked[key]
            assert c.views(key) == [c.acked[key]] * 3, (key, c.views(key), c.acked[key])
    finally:
        await c.close()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, shards=st.sampled_from([1, 3]))
# Lost tails: the last frames on zeta's shard (the flush's announcement) lost, before and after
# the peers heard a heartbeat of the sender.
@example(ops=[("track", 0, ZETA, 1, None), ("lose", 0, ZETA, 0, 0), ("flush", 0, ZETA, 0, None)],
         shards=3)  # fmt: skip
@example(ops=[("heartbeat", 0, ZETA, 0, None), ("track", 0, ZETA, 1, None),
              ("lose", 0, ZETA, 0, 0), ("flush", 0, ZETA, 0, None)], shards=3)  # fmt: skip
def test_any_interleaving_with_lost_frames_converges_exactly(ops: list[Op], shards: int) -> None:
    asyncio.run(_run(ops, shards))


async def test_a_flush_announced_while_the_bus_was_down_is_a_lost_tail_on_its_shard(
    cluster: Cluster,
) -> None:
    """K10 with shards: the announcement a node could not send skips its shard's number at
    once, so peers see a lost tail from its heartbeats, though nothing else goes there."""
    a, b = [await cluster.add(x, settings=SHARDED) for x in "ab"]
    a.gossip.broadcaster.heartbeat_now()
    await cluster.settle()
    cluster.hub.set_up(False, only=[a.gossip.bus])
    cluster.track(a, ZETA, 5)
    await a.flush()  # stored; its announcement cannot go out
    cluster.hub.set_up(True, only=[a.gossip.bus])  # a heartbeats at once, telling shard 0 at 1
    await cluster.settle()
    assert cluster.views(ZETA) == [5, 0] and b.gossip.resyncs["gap"] == 0
    a.gossip.broadcaster.heartbeat_now()  # the number told is still unheard: a lost tail
    await cluster.settle()
    assert b.gossip.resyncs["gap"] == 1 and cluster.views(ZETA) == [5, 5]


async def test_a_heartbeat_out_of_turn_is_not_judged_against_the_one_just_before(
    cluster: Cluster,
) -> None:
    """Frames on other masters may come a little after a heartbeat: one heard within
    ``tail_slack`` of the previous is not judged against it; the next in turn is."""
    slack = replace(SHARDED, tail_slack=0.25)
    now = [1000.0]
    a = await cluster.add("a", settings=slack)
    b = await cluster.add("b", settings=slack, monotonic=lambda: now[0])  # (moved by hand)

    async def heartbeat(at: float) -> None:
        now[0] = at
        a.gossip.broadcaster.heartbeat_now()
        await cluster.settle()

    await heartbeat(1000.0)  # tells shard 0 at 0
    cluster.hub.drop = on_shard(0)
    cluster.track(a, ZETA, 2)
    await cluster.quiet_tick()  # lost (as if still on its way)
    cluster.hub.drop = None
    await heartbeat(1000.1)  # within the slack of the one before: not judged (nor kept)
    await heartbeat(1001.0)  # judged against the first (0): nothing lost yet; tells 1
    await heartbeat(1001.2)  # out of turn: not judged against the one telling 1
    assert b.gossip.resyncs["gap"] == 0
    await heartbeat(1002.0)  # in turn: 1 still unheard, a lost tail
    assert b.gossip.resyncs["gap"] == 1


async def test_warm_asks_again_for_a_shard_the_bus_could_not_listen_to(cluster: Cluster) -> None:
    warm = replace(SHARDED, subscribe="warm", warm_check=0.01)
    a = await cluster.add("a", settings=SHARDED)
    b = await cluster.add("b", settings=warm, warm=[ACME])
    await eventually(lambda: b.gossip.listening == {2}, 2.0, "b listens to acme's shard")
    cluster.hub.set_up(False, only=[b.gossip.bus])
    b.table.seed(ZETA, (await cluster.store.load([ZETA]))[ZETA])
    await eventually(lambda: b.gossip.listening == {0, 2}, 2.0, "b wants zeta's shard")
    assert not b.gossip._listen_confirmed
    cluster.hub.set_up(True, only=[b.gossip.bus])
    await eventually(lambda: b.gossip._listen_confirmed, 2.0, "b's listen is confirmed")
    cluster.track(a, ZETA, 3)
    await cluster.quiet_tick()
    assert b.table.value(ZETA) == 3


async def test_warm_follows_the_shards_of_gauges_held_too() -> None:
    hub = LocalHub()
    table, gauges = CounterTable("b"), GaugeTable("b")
    gauges.seed(ZETA, "max", None)

    async def resync(_: object) -> int:
        return 0

    gossip: Gossip[Snapshot] = Gossip(
        table, hub.bus(ShardMap("t", 3).control), node_id="b", cluster="t",
        make_snapshot=Snapshot, resync=resync, gauges=gauges,
        settings=replace(SHARDED, subscribe="warm"),
    )  # fmt: skip
    await gossip.start()
    try:
        await gossip.follow_warm()
        assert gossip.listening == {0}  # zeta's, held as a gauge only
    finally:
        await gossip.stop(timeout=1)


async def test_the_clusters_k_is_checked_until_storage_tells_and_another_k_refused() -> None:
    """A node whose storage cannot tell the cluster's K at start checks again, backing off,
    and stops (``refuse``) once storage says another K; each cluster name has its own K."""
    store = MemoryStorage()
    mine = ClusterConfig(redis_url="redis://x", cluster_name="c1", gossip_shards=4)
    assert await shards_match(store, replace(mine, gossip_shards=8))  # the first node: 8
    store.fail_next = 2  # storage down for the next two tries
    refused: list[bool] = []
    await check_shards(store, mine, refuse=lambda: refused.append(True), pause=0.01)
    assert refused == [True] and store.fail_next == 0
    with pytest.raises(ConfigError, match="created with gossip_shards = 8, this node has 4"):
        await shards_match(store, mine)
    other = replace(mine, cluster_name="c2")
    assert await shards_match(store, other)  # another cluster on the same storage
    store.fail_next = 1
    await check_shards(store, other, refuse=lambda: refused.append(True), pause=0.01)
    assert refused == [True]  # (the same K: it just ends)
