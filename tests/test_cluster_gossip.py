"""Gossip between real counter tables in one process over the in-process bus.

Each node is a real :class:`CounterTable`, a real :class:`Flusher` and the real gossip layer; they
share one :class:`MemoryStorage` (the "database"). Ticks and flushes are driven by hand so every
interleaving is deterministic; ``settle()`` lets queued frames be sent and delivered.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import pytest

from cluster.bus import channel_name
from cluster.codec import AlertItem, Codec, DeltaItem, Header, HoldItem
from cluster.gossip import Gossip, GossipSettings
from cluster.local_bus import LocalHub
from cluster.shards import ShardMap
from meter.core.table import CounterTable
from meter.node.wiring import resync_from
from meter.persist.flusher import Flusher
from storage.base import EMPTY, Snapshot
from storage.memory import MemoryStorage

KEYS = [("acme", "api", "2026-11"), ("acme", "seats", "2026-11"), ("zeta", "api", "2026-11")]
# Ticks never fire by themselves: the tests call tick() (a huge interval and heartbeat).
MANUAL = GossipSettings(interval=3600, heartbeat=3600, peer_timeout=3600, reconcile=0, tail_slack=0)


class Heard:
    """A node's gossip listener: what it was told of moved views (deltas, announcements,
    resyncs), in order; the other frames are not looked at here."""

    def __init__(self) -> None:
        self.deltas: list[DeltaItem] = []

    def on_limits(self, version: int) -> None:
        pass

    def on_holds(self, peer: str, holds: Sequence[HoldItem]) -> None:
        pass

    def on_deltas(self, deltas: Sequence[DeltaItem]) -> None:
        self.deltas.extend(deltas)

    def on_alert(self, sender: str, alert: AlertItem) -> None:
        pass


@dataclass
class N:
    table: CounterTable
    flusher: Flusher
    gossip: Gossip[Snapshot]
    heard: Heard

    def tick(self) -> int:
        return self.gossip.broadcaster.gossip_now()

    async def flush(self) -> None:
        assert await self.flusher.flush_once()


class Cluster:
    def __init__(
        self, hub: LocalHub, store: MemoryStorage, keys: Sequence[tuple[str, str, str]] = KEYS
    ) -> None:
        self.hub = hub
        self.store = store
        self.keys = list(keys)
        self.nodes: list[N] = []
        self.acked = dict.fromkeys(self.keys, 0)

    async def add(
        self,
        name: str,
        secret: str | None = None,
        settings: GossipSettings = MANUAL,
        table_class: type[CounterTable] = CounterTable,
        replay: dict[tuple[str, str, str], int] | None = None,
        warm: Sequence[tuple[str, str, str]] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> N:
        """A node on the hub and the store, holding ``warm`` keys (default: all). ``replay``:
        units it held unflushed before a restart (recovered from its write-ahead log),
        counted again after seeding."""
        table = table_class(name)
        heard = Heard()
        gossip: Gossip[Snapshot] = Gossip(
            table,
            self.hub.bus(ShardMap("t", settings.shards).control),
            node_id=name,
            cluster="t",
            make_snapshot=Snapshot,
            resync=resync_from(self.store, table, heard),
            secret=secret,
            settings=settings,
            listener=heard,
            monotonic=monotonic,
        )
        flusher = Flusher(table, self.store, interval=3600, on_flushed=gossip.on_flushed)
        warm = self.keys if warm is None else warm
        snaps = await self.store.load(warm)
        for key in warm:
            table.seed(key, snaps.get(key, EMPTY))
        for key, qty in (replay or {}).items():
            table.incr(key, qty)
        await gossip.start()
        node = N(table, flusher, gossip, heard)
        self.nodes.append(node)
        await self.settle()
        return node

    def track(self, node: N, key: tuple[str, str, str], qty: int) -> None:
        node.table.incr(key, qty)
        self.acked[key] += qty

    async def settle(self) -> None:
        for _ in range(3):
            for n in self.nodes:
                assert await n.gossip.broadcaster.drained(2)
            for _ in range(10):
                await asyncio.sleep(0)
        # Resyncs run in their own task (MemoryStorage never suspends, so one runs to its end
        # in one step): wait until none is wanted.
        await eventually(
            lambda: not any(n.gossip._resync_event.is_set() for n in self.nodes),
            2.0,
            "every requested resync ran",
        )
        for _ in range(10):
            await asyncio.sleep(0)

    async def quiet_tick(self) -> None:
        for n in self.nodes:
            n.tick()
        await self.settle()

    def views(self, key: tuple[str, str, str]) -> list[int | None]:
        return [n.table.value(key) for n in self.nodes]

    async def stored(self, key: tuple[str, str, str]) -> int:
        return (await self.store.load([key]))[key].total

    async def close(self) -> None:
        for n in self.nodes:
            await n.gossip.stop(timeout=1)


async def until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Let the loop run until ``cond()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}")
        await asyncio.sleep(0.005)


async def eventually(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``cond`` on the running loop until it holds; return the seconds it took, or fail
    once ``timeout`` has passed (a deadline, not a sleep the test relies on)."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster(LocalHub(), MemoryStorage())
    try:
        yield c
    finally:
        await c.close()


async def test_views_converge_exactly_after_one_tick(cluster: Cluster) -> None:
    a, b, c = [await cluster.add(x) for x in "abc"]
    cluster.track(a, KEYS[0], 5)
    cluster.track(b, KEYS[0], 7)
    cluster.track(c, KEYS[1], 1)
    await cluster.quiet_tick()
    assert cluster.views(KEYS[0]) == [12, 12, 12]
    assert cluster.views(KEYS[1]) == [1, 1, 1]
    assert a.gossip.status()["live_peers"] == ["b", "c"]
    assert a.gossip.status()["received"]["deltas_applied"] == 2


async def test_flush_announcements_neither_double_count_nor_dip(cluster: Cluster) -> None:
    a, b = [await cluster.add(x) for x in "ab"]
    k = KEYS[0]
    cluster.track(a, k, 10)
    await cluster.quiet_tick()
    assert cluster.views(k) == [10, 10]
    # a flushes: b re-bases on the announced total, which contains the gossiped 10.
    await a.flush()
    await cluster.settle()
    assert cluster.views(k) == [10, 10]
    assert b.table.columns(k)["remote"] == 0  # type: ignore[index]
    # Units taken for flushing but not gossiped yet are sealed under the flush's sequence.
    cluster.track(a, k, 3)
    take = a.flusher.flush_once()  # takes seq 2 with the 3 units, then writes
    await take
    await cluster.settle()
    assert cluster.views(k) == [13, 13]  # the announcement carried them before any gossip
    # Their sealed gossip (seq 2) was dropped when seq 2 was stored: nothing left to send.
    assert a.tick() == 0
    # Had it arrived late, b's snapshot already has it: refused.
    a.gossip.broadcaster.seq += 1
    late = Codec("t").encode(
        Header("t", "a", a.gossip.incarnation, a.gossip.broadcaster.seq, 0.0),
        "deltas",
        [(*k, 2, 3)],
    )
    b.gossip.on_bytes(late)
    assert cluster.views(k) == [13, 13]
    assert b.gossip.status()["received"]["deltas_skipped"] == 1
    # b's own flush after gossip from a: nothing is counted twice in the store or the views.
    cluster.track(b, k, 4)
    cluster.track(a, k, 6)
    await cluster.quiet_tick()
    await b.flush()
    await cluster.settle()
    assert cluster.views(k) == [23, 23]
    await a.flush()
    await cluster.settle()
    assert cluster.views(k) == [23, 23]
    assert await cluster.stored(k) == 23


async def test_late_older_announcement_does_not_move_views_back(cluster: Cluster) -> None:
    a, b, c = [await cluster.add(x) for x in "abc"]
    k = KEYS[0]
    cluster.track(a, k, 1)
    await a.flush()
    cluster.track(b, k, 2)
    await b.flush()
    await cluster.quiet_tick()
    assert cluster.views(k) == [3, 3, 3]
    # Replay a's first announcement (older snapshot) as if delayed: refused by the table.
    frame = Codec("t").encode(
        Header("t", "a", a.gossip.incarnation, a.gossip.broadcaster.seq + 1, 0.0),
        "announce",
        [(*k, 1, {"a": 1})],
    )
    a.gossip.broadcaster.seq += 1
    c.gossip.on_bytes(frame)
    assert cluster.views(k) == [3, 3, 3]


async def test_lost_messages_are_detected_and_resynced(cluster: Cluster) -> None:
    a, b = [await cluster.add(x) for x in "ab"]
    k = KEYS[2]
    a.gossip.broadcaster.heartbeat_now()  # b knows a's sequence from here on
    await cluster.settle()
    cluster.hub.drop = lambda frame: True
    cluster.track(a, k, 9)
    a.tick()  # lost
    await a.flush()  # its announcement: lost too
    await cluster.settle()
    assert cluster.views(k) == [9, 0]
    cluster.hub.drop = None
    a.gossip.broadcaster.heartbeat_now()  # the next message shows the gap
    await cluster.settle()
    st = b.gossip.status()
    assert st["gaps"] == 1 and st["missed"] == 2
    assert st["resyncs"]["gap"] == 1
    assert cluster.views(k) == [9, 9]  # re-read from storage


async def test_a_view_moved_by_an_announcement_or_a_resync_is_heard_like_deltas(
    cluster: Cluster,
) -> None:
    """What moves a view besides a deltas frame (a flush announced before its units were
    gossiped; a resync after lost frames) reaches the listener as a delta of sequence 0, so
    threshold alerts and live pushes see it; a view it does not move is not heard."""
    a, b = [await cluster.add(x) for x in "ab"]
    k = KEYS[0]
    cluster.track(a, k, 4)
    await cluster.quiet_tick()
    assert b.heard.deltas == [(*k, 1, 4)]  # a deltas frame: as sent
    await a.flush()  # its announcement holds the 4 b has: the view does not move
    await cluster.settle()
    assert b.heard.deltas == [(*k, 1, 4)]
    cluster.track(a, k, 6)
    await a.flush()  # taken for flushing before any tick: only the announcement has them
    await cluster.settle()
    assert cluster.views(k) == [10, 10]
    assert b.heard.deltas == [(*k, 1, 4), (*k, 0, 6)]
    assert a.tick() == 0  # nothing left to gossip: the 6 reached b once, as a move
    a.gossip.broadcaster.heartbeat_now()
    await cluster.settle()
    cluster.hub.drop = lambda frame: True
    cluster.track(a, KEYS[2], 9)
    a.tick()  # lost
    await a.flush()  # its announcement: lost too
    await cluster.settle()
    cluster.hub.drop = None
    a.gossip.broadcaster.heartbeat_now()  # the gap: b re-reads storage
    await cluster.settle()
    assert b.gossip.status()["resyncs"]["gap"] == 1
    assert cluster.views(KEYS[2]) == [9, 9]
    assert b.heard.deltas == [(*k, 1, 4), (*k, 0, 6), (*KEYS[2], 0, 9)]


async def test_bus_outage_then_reconnect_converges(cluster: Cluster) -> None:
    a, b = [await cluster.add(x) for x in "ab"]
    k = KEYS[0]
    cluster.hub.set_up(False)
    cluster.track(a, k, 4)
    assert a.tick() == 0  # nothing taken while the bus is down
    await a.flush()  # flushing goes on; the announcement is not sent
    cluster.track(a, k, 1)  # gossip for the next sequence waits too
    cluster.track(b, k, 2)
    await cluster.settle()
    assert cluster.views(k) == [5, 2]
    cluster.hub.set_up(True)  # both reconnect: each resyncs from storage
    await cluster.settle()
    await cluster.quiet_tick()
    assert cluster.views(k) == [7, 7]
    assert b.gossip.status()["resyncs"]["connect"] >= 2  # first connect + reconnect
    await a.flush()
    await b.flush()
    await cluster.settle()
    assert cluster.views(k) == [7, 7] and await cluster.stored(k) == 7


async def test_forged_garbage_and_foreign_messages_are_rejected_and_counted() -> None:
    c = Cluster(LocalHub(), MemoryStorage())
    try:
        a = await c.add("a", secret="s3cret")
        b = await c.add("b", secret="s3cret")
        k = KEYS[0]
        bus = c.hub.bus(channel_name("t"))
        await bus.start(lambda _: None, lambda _: None)
        h = Header("t", "mallory", 1, 1, 0.0)
        await bus.publish(Codec("t", "guess").encode(h, "deltas", [(*k, 1, 1000)]))
        await bus.publish(Codec("t").encode(h, "deltas", [(*k, 1, 1000)]))
        foreign = Header("other", "mallory", 1, 1, 0.0)
        await bus.publish(Codec("other", "s3cret").encode(foreign, "deltas", [(*k, 1, 1000)]))
        await bus.publish(b"\x00garbage")
        await bus.publish(b"mg\x07\x00")
        # Replay of a genuine message: refused as stale.
        c.track(a, k, 1)
        a.tick()
        await c.settle()
        frames: list[bytes] = []

        def capture(frame: bytes) -> bool:
            frames.append(frame)
            return False  # deliver it too

        c.hub.drop = capture
        c.track(a, k, 1)
        a.tick()
        await c.settle()
        c.hub.drop = None
        await bus.publish(frames[0])
        await c.settle()
        assert c.views(k) == [2, 2]
        rej = b.gossip.status()["rejected"]
        assert rej["bad_mac"] == 1 and rej["unsigned"] == 1 and rej["malformed"] == 1
        assert rej["version"] == 1 and rej["stale"] == 1
        assert rej["cluster"] == 1
        await bus.close()
    finally:
        await c.close()


async def test_duplicate_node_id_is_refused_and_counted(cluster: Cluster) -> None:
    a = await cluster.add("a")
    b = await cluster.add("b")
    impostor = Codec("t").encode(Header("t", "a", 1, 1, 0.0), "deltas", [(*KEYS[0], 1, 5)])
    a.gossip.on_bytes(impostor)
    assert a.gossip.status()["rejected"]["own_id"] == 1
    assert cluster.views(KEYS[0]) == [0, 0]
    del b


async def test_a_restarted_peer_is_recognised_and_views_are_repaired(cluster: Cluster) -> None:
    a, b = [await cluster.add(x) for x in "ab"]
    k = KEYS[0]
    cluster.track(a, k, 3)
    await a.flush()
    await cluster.quiet_tick()
    cluster.track(a, k, 2)  # gossiped (tagged with a's flush sequence 2), not flushed yet
    a.tick()
    await cluster.settle()
    assert cluster.views(k) == [5, 5]
    # Then everything a says is lost: it flushes the 2 and 4 more (its announcement lost),
    # gossips 5 more (lost) and is killed before flushing them.
    cluster.hub.drop = lambda frame: True
    cluster.track(a, k, 4)
    await a.flush()
    cluster.track(a, k, 5)
    a.tick()
    await cluster.settle()
    await a.gossip.stop()  # dead: nothing more leaves it
    cluster.nodes.remove(a)
    cluster.hub.drop = None
    assert await cluster.stored(k) == 9 and cluster.acked[k] == 14
    assert cluster.views(k) == [5]  # b lacks the 4 flushed under a lost announcement
    # a starts again: its memory is storage plus the unflushed 5 from its log (what recovery
    # does), under a new incarnation. Its first heartbeat tells b it restarted: b forgets the
    # old incarnation's gossip and re-reads storage, repairing the view nothing else would.
    a2 = await cluster.add("a", replay={k: 5})
    st = b.gossip.status()
    assert st["peers"]["a"]["restarts"] == 1
    assert st["resyncs"]["peer"] == 1 and st["resyncs"]["gap"] == 0, st["resyncs"]
    assert st["forgotten_units"] == 2
    assert b.table.value(k) == 9 == await cluster.stored(k)
    # The restarted node gossips its unflushed units anew: counted once, then stored once.
    await cluster.quiet_tick()
    assert cluster.views(k) == [14, 14]
    await a2.flush()
    await cluster.settle()
    assert cluster.views(k) == [14, 14] and await cluster.stored(k) == 14


@pytest.mark.parametrize("seed", range(12))
async def test_random_interleavings_agree_exactly_after_a_quiet_tick(seed: int) -> None:
    rng = random.Random(seed)
    c = Cluster(LocalHub(), MemoryStorage())
    try:
        nodes = [await c.add(x) for x in "abc"]
        lossy = seed % 3 == 0
        actions: list[Callable[[], object]] = []
        for _ in range(60):
            n = rng.choice(nodes)
            r = rng.random()
            if r < 0.5:
                c.track(n, rng.choice(KEYS), rng.randint(-3, 20))
            elif r < 0.75:
                n.tick()
            elif r < 0.9:
                await n.flush()
            else:
                await c.settle()
            if lossy:
                c.hub.drop = (lambda f: rng.random() < 0.2) if rng.random() < 0.3 else None
            if rng.random() < 0.3:
                await asyncio.sleep(0)
        del actions
        c.hub.drop = None
        await c.quiet_tick()
        if lossy:  # a heartbeat exposes any gap; flush so lost deltas reach storage
            for n in nodes:
                await n.flush()
            for n in nodes:
                n.gossip.broadcaster.heartbeat_now()
            await c.settle()
            await c.quiet_tick()
        for k in KEYS:
            assert c.views(k) == [c.acked[k]] * 3, (k, c.views(k), c.acked[k])
        for n in nodes:
            await n.flush()
        await c.settle()
        for k in KEYS:
            assert c.views(k) == [c.acked[k]] * 3
            assert await c.stored(k) == c.acked[k]
    finally:
        await c.close()


@pytest.mark.quiet
async def test_periodic_reconciliation_repairs_silent_loss(cluster: Cluster) -> None:
    timed = GossipSettings(interval=3600, heartbeat=3600, peer_timeout=3600, reconcile=0.2)
    a = await cluster.add("a")
    b = await cluster.add("b", settings=timed)
    k = KEYS[1]
    cluster.hub.drop = lambda frame: True
    cluster.track(a, k, 6)
    a.tick()
    await a.flush()  # gossip and announcement both lost; a says nothing more
    await cluster.settle()
    cluster.hub.drop = None
    assert cluster.views(k) == [6, 0]
    # Nothing tells b of the loss but its own clock: the maintenance loop (a step of
    # min(0.5 s, peer_timeout / 4)) asks for a reconciliation once 0.2 s have passed, so the
    # view is repaired within about 0.5 s (bound: 0.2 s + one step, plus a margin for load).
    took = await eventually(lambda: cluster.views(k) == [6, 6], 3.0, "b reconciles")
    st = b.gossip.status()
    assert st["resyncs"]["reconcile"] >= 1 and st["resyncs"]["gap"] == 0, st["resyncs"]
    assert took < 0.2 + 0.5 + 0.5, f"repaired after {took:.2f}s"


async def test_a_dead_peers_unflushed_gossip_is_forgotten(cluster: Cluster) -> None:
    timed = GossipSettings(interval=3600, heartbeat=0.05, peer_timeout=0.3, reconcile=0)
    a = await cluster.add("a", settings=timed)
    b = await cluster.add("b", settings=timed)
    k = KEYS[0]
    cluster.track(a, k, 2)
    await a.flush()
    cluster.track(b, k, 3)
    await b.flush()
    cluster.track(b, k, 4)  # gossiped, never flushed: b "dies"
    await cluster.quiet_tick()
    assert cluster.views(k) == [9, 9]
    await b.gossip.stop()
    cluster.nodes.remove(b)
    # Silent for longer than peer_timeout: dead, its unflushed 4 forgotten, a's view re-read.
    await eventually(lambda: a.gossip.status()["live_peers"] == [], 3.0, "b is declared dead")
    await eventually(lambda: a.table.value(k) == 5, 3.0, "a forgets b's unflushed gossip")
    st = a.gossip.status()
    assert st["live_peers"] == [] and st["forgotten_units"] == 4
    assert a.table.value(k) == await cluster.stored(k) == 5


async def test_a_peer_declared_dead_and_heard_again_is_resynced(cluster: Cluster) -> None:
    """A peer wrongly declared dead (silent, not gone) comes back with the same incarnation and
    the next message number: no gap, but its gossip was forgotten at its death and whatever it
    did meanwhile that this node never heard of (here: a flush whose announcement never came)
    is only in storage. Hearing it again re-reads storage at once, not at reconciliation."""
    timed = GossipSettings(interval=3600, heartbeat=3600, peer_timeout=0.3, reconcile=0)
    a = await cluster.add("a")
    b = await cluster.add("b", settings=timed)
    k = KEYS[0]
    cluster.track(a, k, 4)
    a.tick()
    await cluster.settle()
    assert cluster.views(k) == [4, 4]
    # a says nothing more (its heartbeat is an hour): b declares it dead and forgets the 4.
    await until(lambda: b.gossip.status()["live_peers"] == [], "b declares a dead")
    assert b.gossip.status()["forgotten_units"] == 4
    await until(lambda: b.gossip.status()["resyncs"]["peer"] == 1, "b re-reads after the death")
    assert cluster.views(k) == [4, 0]
    # a flushes them; b never hears of it (no announcement, and no message number spent).
    a.flusher.on_flushed = None
    await a.flush()
    a.flusher.on_flushed = a.gossip.on_flushed
    assert await cluster.stored(k) == 4
    a.gossip.broadcaster.heartbeat_now()  # the next message in a's sequence
    await until(lambda: b.gossip.status()["live_peers"] == ["a"], "b hears a again")
    b.gossip.peers.dead_after = 3600  # a stays silent again: it must not die (and resync) twice
    assert b.gossip.status()["gaps"] == 0
    await until(lambda: b.table.value(k) == 4, "b re-reads the stored total", timeout=2)
    assert b.gossip.status()["resyncs"]["peer"] == 1
    assert b.gossip.status()["resyncs"]["revive"] == 1
    assert b.gossip.status()["peers"]["a"]["revivals"] == 1


@pytest.mark.parametrize("outage", ["hub", "one_bus"])
async def test_a_long_bus_outage_keeps_memory_flat_and_views_converge(
    cluster: Cluster, outage: str
) -> None:
    """While the bus is down nothing is gossiped, but flushing goes on: every round used to seal
    each flushed key's units in one more gossip entry kept for after the outage (about 70 B per
    busy key per round, and such rows were never evicted), all of it sent at once on reconnect.
    Entries whose sequence is stored are dropped instead (storage has the units); peers re-read
    storage on reconnect (theirs, or a gap this node leaves in its message numbers)."""
    a, b = [await cluster.add(x) for x in "ab"]
    a.gossip.broadcaster.heartbeat_now()  # b knows a's message numbers from here on
    await cluster.settle()
    idle = ("quiet", "api", "2026-11")  # tracked once early in the outage, then never again
    rng = random.Random(outage)
    if outage == "hub":
        cluster.hub.set_up(False)
    else:
        cluster.hub.set_up(False, only=[a.gossip.bus])  # b stays connected and hears nothing
    a.table.incr(idle, 3)
    await a.flush()  # seeds the new key
    await a.flush()  # and writes it
    for _ in range(300):
        for k in KEYS:
            cluster.track(a, k, rng.randint(1, 9))
        cluster.track(b, rng.choice(KEYS), rng.randint(1, 9))
        await a.flush()
        await b.flush()
    sealed = [a.table.columns(k)["sealed"] for k in KEYS]  # type: ignore[index]
    assert sealed == [0, 0, 0], "no gossip kept for units already stored"
    a.table.evict_idle()
    assert cluster.views(KEYS[0])[0] is not None  # reads keep the busy keys warm
    for k in KEYS[1:]:
        a.table.value(k)
    a.table.evict_idle()
    assert not a.table.is_warm(idle), "a flushed key with nothing else to do is evicted"
    for k in KEYS:
        cluster.track(a, k, 2)  # not flushed yet: gossiped after the outage
    assert a.tick() == 0  # nothing taken while the bus is down
    cluster.hub.set_up(True)
    await cluster.settle()
    await cluster.quiet_tick()

    def exact() -> bool:
        return all(cluster.views(k) == [cluster.acked[k]] * 2 for k in KEYS)

    await until(exact, "both views equal the acknowledged units")
    assert a.gossip.status()["sent"]["items"] <= len(KEYS), "one delta per key, not per round"
    if outage == "one_bus":
        st = b.gossip.status()  # a left a gap in its numbers: b re-read storage
        assert st["gaps"] == 1 and st["resyncs"]["gap"] == 1
    await a.flush()
    await b.flush()
    await cluster.settle()
    for k in KEYS:
        assert cluster.views(k) == [cluster.acked[k]] * 2
        assert await cluster.stored(k) == cluster.acked[k]
