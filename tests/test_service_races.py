"""Reproductions found in review: the service's cold paths racing shutdown, eviction and bugs."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Sequence
from pathlib import Path

from meter.client import AsyncClient
from meter.core.table import CounterTable
from meter.errors import Unavailable
from meter.node.wiring import build_service, serve
from meter.persist.flusher import Flusher
from storage.base import Delta, Key, Snapshot
from storage.memory import MemoryStorage


class GatedStorage(MemoryStorage):
    """A memory store whose reads wait until the test opens the gate (a slow database)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.reads_started = 0

    async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]:
        snap = await super().load(keys)  # the read happens now ...
        self.reads_started += 1
        await self.gate.wait()  # ... and its answer arrives late
        return snap


async def test_track_many_cut_short_by_shutdown_counts_nothing() -> None:
    """A track_many whose warm items were counted must not be answered as a failure when
    the node shuts down while a cold item of it waits for storage: the client would retry
    the batch and the warm items would be counted twice."""
    store = GatedStorage()
    table = CounterTable("n1")
    svc = build_service(table, store)
    warm = svc.key_for("acme", "warm")
    table.seed(warm, Snapshot(0, {}))
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "m.sock")
        server = await serve(path, svc)
        client = await AsyncClient.connect(path)
        store.gate.clear()  # the cold item's seed read hangs
        call = asyncio.ensure_future(
            client.call("track_many", [["acme", "warm", 5], ["acme", "cold", 1]])
        )
        while store.reads_started == 0:
            await asyncio.sleep(0.001)
        await server.close(drain_timeout=0.05)  # SIGTERM: the request is cut short
        try:
            answer = await call
        except Unavailable:
            answer = None
        await client.close()
    # A batch is counted all or nothing: cut short, it counted nothing, so its error answer
    # is true and a client retrying it counts nothing twice.
    assert answer is None, "the request was cut short: answered unavailable"
    assert table.pending(warm) == 0, "and the warm item of the batch was not counted either"


class BrokenReadStorage(MemoryStorage):
    """A memory store whose next read fails with something that is not a StorageError (a
    bug, or an item the backend cannot decode), after the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.broken = True

    async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]:
        if self.broken:
            self.broken = False
            await self.gate.wait()
            raise KeyError("N")
        return await super().load(keys)


async def test_a_failed_seed_does_not_leave_other_callers_waiting_forever() -> None:
    store = BrokenReadStorage()
    table = CounterTable("n1")
    svc = build_service(table, store)
    first = asyncio.ensure_future(svc.dispatch("track", ["acme", "api", 1]))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(svc.dispatch("track", ["acme", "api", 2]))
    for _ in range(3):
        await asyncio.sleep(0)
    store.gate.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert first.done() and second.done(), "a track waits for a seed nobody will finish"
    # The bug is logged (the seeder's batch failed): both calls counted, on an unseeded row,
    # as with storage down; the flusher seeds the key later.
    assert await first is None and await second is None
    assert table.pending(("acme", "api", svc.key_for("acme", "api")[2])) == 3


async def test_a_seed_read_that_outlives_an_eviction_does_not_reuse_a_stored_sequence() -> None:
    """service.seed trusts its read to hold every sequence this node stored for the key. If,
    while the read is on its way, the key is seeded by usage_all, flushed and evicted, the
    late read seeds the cold key with an old sequence; the next flush reuses a stored
    sequence, is refused as a duplicate, and its units are lost."""
    store = GatedStorage()
    table = CounterTable("n1")
    svc = build_service(table, store)
    key = svc.key_for("acme", "api")
    await store.apply("n2", [Delta(key, 1, 10)])  # a peer's units
    flusher = Flusher(table, store)
    store.gate.clear()
    late = asyncio.ensure_future(svc.dispatch("track", ["acme", "api", 7]))  # cold: reads
    while store.reads_started == 0:
        await asyncio.sleep(0.001)
    assert await svc.dispatch("usage_all", ["acme"]) == {"api": 10}  # seeds the key
    assert svc.dispatch("track", ["acme", "api", 5]) == 15  # warm now
    assert await flusher.flush_once()
    assert store.items[key] == Snapshot(15, {"n2": 1, "n1": 1})
    table.take_gossip(key)  # the broadcaster's tick (or, alone, the node after a flush)
    table.evict_idle()
    table.evict_idle()
    assert not table.is_warm(key), "idle and clean: evicted"
    store.gate.set()  # the first read, taken before the flush, arrives now
    await late
    assert await flusher.drain(1)
    assert store.items[key].total == 10 + 5 + 7, "every acknowledged unit is stored"
