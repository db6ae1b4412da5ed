"""The seeder (``meter/seeder.py``) against an in-memory store whose reads land when the test
says, on an event loop the test turns one pass at a time.

:class:`GatedStore` is our own :class:`~storage.memory.MemoryStorage`: a read takes its
snapshots when it is issued and answers (or fails) only when the test lands it, so evictions
and other seeding paths can happen between a read's issue and its landing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from meter.seeder import MAX_TRIES, Seeder
from meter.table import CounterTable
from storage.base import EMPTY, BadItems, Key, Snapshot, StorageUnavailable
from storage.memory import MemoryStorage

NODE = "n1"
PEER = "n2"
PERIOD = "2026-11"
#: Few keys, so the steps keep meeting the same ones.
KEYS: list[Key] = [("t", f"f{i}", PERIOD) for i in range(4)]


class Loop:
    """A fresh event loop, turned one pass (one ``_run_once``) at a time."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def one_pass(self) -> None:
        self.loop.call_soon(self.loop.stop)
        self.loop.run_forever()

    def settle(self, passes: int = 8) -> None:
        """Enough passes for everything a landing or a call sets off (no timers involved)."""
        for _ in range(passes):
            self.one_pass()

    def call(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` inside the loop, in the next pass (as the service would)."""
        self.loop.call_soon(fn, *args)

    def close(self) -> None:
        # A cancelled read lands (empty) and may dispatch the next: cancel until none is left.
        for _ in range(10):
            tasks = asyncio.all_tasks(self.loop)
            if not tasks:
                break
            for task in tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()


@dataclass(eq=False)
class Read:
    """One ``load`` call: its keys, the snapshots taken when it was issued, the table's
    eviction count then, and the future the test lands it with."""

    keys: list[Key]
    snaps: dict[Key, Snapshot]
    evictions: int
    fut: asyncio.Future[dict[Key, Snapshot]]
    outcome: str | None = None


class GatedStore(MemoryStorage):
    """A memory store whose reads take their snapshots at once and answer when landed."""

    def __init__(self, table: CounterTable) -> None:
        super().__init__()
        self.table = table
        self.reads: list[Read] = []
        self.outstanding: list[Read] = []
        self.most_open = 0

    async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]:
        wanted = list(keys)
        # New objects per read: a seed can be traced back to the read it came from.
        snaps = {k: _copy(self.items.get(k, EMPTY)) for k in wanted}
        read = Read(wanted, snaps, self.table.evictions, asyncio.get_running_loop().create_future())
        self.reads.append(read)
        self.outstanding.append(read)
        self.most_open = max(self.most_open, len(self.outstanding))
        try:
            return await read.fut
        finally:
            self.outstanding.remove(read)

    def pending(self) -> list[Read]:
        return [r for r in self.outstanding if not r.fut.done()]


def land(read: Read, outcome: str, bad: Iterable[Key] = ()) -> None:
    """Answer ``read``: ``ok``, ``error`` (StorageError), ``bad`` (BadItems for ``bad``, the
    others good) or ``bug`` (an exception no backend should raise)."""
    read.outcome = outcome
    if outcome == "ok":
        read.fut.set_result(dict(read.snaps))
    elif outcome == "error":
        read.fut.set_exception(StorageUnavailable("storage down"))
    elif outcome == "bad":
        wrong = set(bad)
        good = {k: s for k, s in read.snaps.items() if k not in wrong}
        read.fut.set_exception(BadItems(good, dict.fromkeys(wrong, "undecodable")))
    else:
        read.fut.set_exception(RuntimeError("a backend bug"))


class SpyTable(CounterTable):
    """The counter table, recording every successful seed with the eviction count it was
    made under."""

    def __init__(self, node: str) -> None:
        super().__init__(node, gossip=False)
        self.seeds: list[tuple[Key, Snapshot, int]] = []

    def seed(self, key: Key, snap: Snapshot, evictions: int | None = None) -> bool:
        now = self.evictions
        ok = super().seed(key, snap, evictions)
        if ok:
            self.seeds.append((key, snap, now))
        return ok


def _copy(snap: Snapshot) -> Snapshot:
    return Snapshot(snap.total, dict(snap.seqs))


@dataclass
class Rig:
    """A seeder on a gated store, its loop, and helpers to drive them."""

    chunk: int
    concurrency: int
    loop: Loop = field(default_factory=Loop)
    table: SpyTable = field(default_factory=lambda: SpyTable(NODE))
    store: GatedStore = field(init=False)
    seeder: Seeder = field(init=False)

    def __post_init__(self) -> None:
        self.store = GatedStore(self.table)
        self.seeder = Seeder(self.table, self.store, chunk=self.chunk, concurrency=self.concurrency)

    def task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        return self.loop.loop.create_task(coro)

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.close()  # also when hypothesis stops an example part-way


def keys_named(prefix: str, n: int) -> list[Key]:
    return [("t", f"{prefix}{i}", PERIOD) for i in range(n)]


# -- examples -----------------------------------------------------------------------------------


def test_a_key_seeded_elsewhere_while_it_was_read_again_gets_its_full_tries_next_time() -> None:
    """L05: a key whose read was refused (an eviction pass overtook it) is read again; if
    another path seeds it before that read lands, the refusals are forgotten, so the next time
    the key is asked for it again gets MAX_TRIES reads before the caller is told it could not
    be seeded (``usage`` answers ``unavailable``, with storage up)."""
    with Rig(chunk=10, concurrency=2) as rig:
        key = KEYS[0]
        rig.store.items[key] = Snapshot(5, {NODE: 1})
        spare = iter(keys_named("spare", 10))

        def eviction_pass() -> None:
            """Make an idle key and evict it: the eviction count moves on."""
            idle = next(spare)
            rig.table.seed(idle, EMPTY)
            before = rig.table.evictions
            rig.table.evict_idle()
            rig.table.evict_idle()
            assert rig.table.evictions == before + 1

        def refuse_next_read() -> None:
            pending = rig.store.pending()
            assert len(pending) == 1 and pending[0].keys == [key], "the key is read (again)"
            eviction_pass()
            land(pending[0], "ok")
            rig.loop.settle()

        first = rig.task(rig.seeder.seed(key))
        rig.loop.settle()
        for _ in range(MAX_TRIES - 1):
            refuse_next_read()
        assert not first.done() and len(rig.store.pending()) == 1, "read again"
        rig.table.seed(key, _copy(rig.store.items[key]))  # usage_all, say, seeds it meanwhile
        (read,) = rig.store.pending()
        land(read, "ok")
        rig.loop.settle()
        assert first.result() is True

        # Idle: evicted. Asked for again, its reads overtaken by eviction passes again.
        rig.table.evict_idle()
        rig.table.evict_idle()
        assert not rig.table.is_warm(key)
        second = rig.task(rig.seeder.seed(key))
        rig.loop.settle()
        for _ in range(MAX_TRIES - 1):
            assert not second.done(), "given up before MAX_TRIES reads in a row were refused"
            refuse_next_read()
        assert not second.done(), "given up before MAX_TRIES reads in a row were refused"
        (read,) = rig.store.pending()
        land(read, "ok")  # fresh: no eviction pass since it was issued
        rig.loop.settle()
        assert second.result() is True
        assert rig.table.base(key) == 5
