"""The seeder (``meter/core/seeder.py``) against an in-memory store whose reads land when
the test says, on an event loop the test turns one pass at a time.

:class:`GatedStore` is our own :class:`~storage.memory.MemoryStorage`: a read takes its
snapshots when it is issued and answers (or fails) only when the test lands it, so evictions,
other seeding paths, flushes and peers' writes can happen between a read's issue and its
landing. The state machine checks, over every interleaving it finds:

- every caller is answered once every read has landed (C12, L04);
- a key is seeded only by a read issued after the last eviction pass and the last claim of
  the node id (another process having stored under it meanwhile), with that read's total
  and sequences, and a read overtaken by either is refused and the key read again, until
  :data:`~meter.core.seeder.MAX_TRIES` reads of it in a row were refused (C06, L05); no flush
  reuses a stored sequence, and the store ends up with exactly the acknowledged units;
- at most ``concurrency`` reads are out at once, none of more than ``chunk`` keys, and no key
  is in two reads at once (L01).

The property tests below it check that keys asked for in one event-loop pass share batches and
that keys a caller waits on go before keys read ahead (L01).
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
from collections import Counter
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from meter.core.seeder import MAX_TRIES, Seeder
from meter.core.table import CounterTable
from storage.base import EMPTY, BadItems, Delta, Key, Snapshot, StorageUnavailable
from storage.memory import MemoryStorage
from tests.support.machine_reach import reach_alone

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
    epoch: int
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
        read = Read(wanted, snaps, self.table.epoch, asyncio.get_running_loop().create_future())
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


class _Spy:
    """A counter table (``table``), recording every successful seed with the eviction count
    it was made under; everything else goes to the table. (A wrapper: the compiled
    ``CounterTable`` takes no interpreted subclass.)"""

    def __init__(self, node: str) -> None:
        self.table = CounterTable(node, gossip=False)
        self.seeds: list[tuple[Key, Snapshot, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.table, name)

    def seed(self, key: Key, snap: Snapshot, epoch: int | None = None) -> bool:
        now = self.table.epoch
        ok = self.table.seed(key, snap, epoch)
        if ok:
            self.seeds.append((key, snap, now))
        return ok

    def seed_many(self, snaps: Iterable[tuple[Key, Snapshot]], epoch: int) -> tuple[int, list[Key]]:
        """The seeder's way (a landed batch under one lock): each key it seeded is recorded."""
        items = list(snaps)
        table = self.table
        cold = {k for k, _ in items if not table.is_seeded(k)}
        now = table.epoch
        out = table.seed_many(items, epoch)
        self.seeds.extend((k, s, now) for k, s in items if k in cold and table.is_seeded(k))
        return out


if TYPE_CHECKING:
    # What the seeder, the store and the machine see: a table (the machine's source stays as
    # it was, so its derandomized runs, and what test_the_machine_reaches_... counts, too).
    class SpyTable(CounterTable):
        seeds: list[tuple[Key, Snapshot, int]]
else:
    SpyTable = _Spy


def _copy(snap: Snapshot) -> Snapshot:
    return Snapshot(snap.total, dict(snap.seqs))


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (the memory store's ``apply``) to its end."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise AssertionError("the memory store suspended")


def flush(table: CounterTable, store: MemoryStorage) -> None:
    """Write every dirty, seeded key once, as the flusher does, and re-base on the answer.
    A duplicate answer means the row reused a sequence the store holds: C06 broken."""
    for key in table.dirty_keys():
        taken = table.take_flush(key)
        if taken is None:
            continue
        seq, delta = taken
        out = run_sync(store.apply(NODE, [Delta(key, seq, delta)]))
        assert not out[key].duplicate, f"{key}: sequence {seq} reused, {delta} units lost"
        table.rebase(key, out[key].snapshot)


class SeederMachine(RuleBasedStateMachine):
    """Callers, read-ahead, reads landing or failing, evictions, other seeding paths, flushes
    and a peer's writes, in any order."""

    #: How often the runs reached each kind of step (see test_the_machine_reaches_...).
    seen: ClassVar[Counter[str]] = Counter()

    def __init__(self) -> None:
        super().__init__()
        self.loop = Loop()
        self.table = SpyTable(NODE)
        self.store = GatedStore(self.table)
        # Half the keys hold sequences of this node already (it ran before): a key seeded
        # from anything but a fresh read would reuse one at its next flush.
        for i, key in enumerate(KEYS):
            if i % 2 == 0:
                self.store.items[key] = Snapshot(10 * i + 1, {NODE: 2, PEER: 1})
        self.stored = {k: s.total for k, s in self.store.items.items()}
        self.peer_seq = Counter({k: s.seq_of(PEER) for k, s in self.store.items.items()})
        self.seeder: Seeder | None = None
        self.callers: list[tuple[asyncio.Task[Any], list[Key]]] = []
        self.acked: Counter[Key] = Counter()
        self.peer_units: Counter[Key] = Counter()
        #: Units another process stored under this node's id before this node claimed it.
        self.holder_units: Counter[Key] = Counter()
        #: Reads of a key refused in a row (overtaken by an eviction pass), since it was
        #: last seeded, failed or given up.
        self.refused: Counter[Key] = Counter()
        #: Keys refused fewer than MAX_TRIES times in a row: the seeder owes them a read.
        self.owed: set[Key] = set()
        self.checked_reads = 0
        self.checked_seeds = 0
        self.spares = 0

    @initialize(chunk=st.integers(1, 4), concurrency=st.integers(1, 3))
    def start(self, chunk: int, concurrency: int) -> None:
        self.seeder = Seeder(self.table, self.store, chunk=chunk, concurrency=concurrency)

    @property
    def s(self) -> Seeder:
        assert self.seeder is not None
        return self.seeder

    # -- callers --------------------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS))
    def ask_one(self, key: Key) -> None:
        self.callers.append((self.loop.loop.create_task(self.s.seed(key)), [key]))

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6))
    def ask_many(self, keys: list[Key]) -> None:
        self.callers.append((self.loop.loop.create_task(self.s.seed_many(keys)), keys))

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=8))
    def prefetch(self, keys: list[Key]) -> None:
        self.loop.call(self.s.prefetch, keys)

    @rule(passes=st.integers(1, 3))
    def run(self, passes: int) -> None:
        for _ in range(passes):
            self.loop.one_pass()
        self._note_reads()

    # -- reads ----------------------------------------------------------------------------

    def _a_pending_read(self, data: st.DataObject) -> Read | None:
        """A read that has not landed yet; if none is out, the passes that issue the reads
        queued first."""
        if not self.store.pending():
            self.loop.settle(3)
            self._note_reads()
        pending = self.store.pending()
        return data.draw(st.sampled_from(pending)) if pending else None

    @rule(data=st.data())
    def land_one(self, data: st.DataObject) -> None:
        read = self._a_pending_read(data)
        if read is None:
            return
        outcome = data.draw(st.sampled_from(["ok", "error", "bad", "bug"]))
        bad: set[Key] = set()
        if outcome == "bad":  # some keys undecodable, the others (if any) good
            most = max(1, len(read.keys) - 1)
            bad = data.draw(st.sets(st.sampled_from(read.keys), min_size=1, max_size=most))
        self._land(read, outcome, bad)

    @rule(data=st.data())
    def land_after_an_eviction(self, data: st.DataObject) -> None:
        """An eviction pass between a read's issue and its landing, and then the passes that
        issue the read that follows it (so reads refused in a row are reached)."""
        read = self._a_pending_read(data)
        if read is None:
            return
        self.evict_another_key()
        self._land(read, "ok")
        self.loop.settle(3)
        self._note_reads()

    def _land(self, read: Read, outcome: str, bad: Iterable[Key] = ()) -> None:
        table = self.table
        was_seeded = {k: table.is_seeded(k) for k in read.keys}
        fresh = read.epoch == table.epoch
        land(read, outcome, bad)
        good = set(read.snaps) - set(bad) if outcome in ("ok", "bad") else set()
        self.loop.one_pass()  # the seeder's read resumes and lands
        assert read not in self.store.outstanding
        for key in read.keys:
            if was_seeded[key]:  # seeded meanwhile by another path: nothing to do
                self.refused.pop(key, None)
                self.seen["seeded elsewhere while read"] += 1
                continue
            snap = read.snaps[key]
            if key not in good:
                assert not table.is_seeded(key), f"{key} seeded by a failed read"
                self.refused.pop(key, None)
                self.seen["failed"] += 1
            elif fresh:
                assert table.is_seeded(key), f"{key}: a fresh read did not seed it"
                cols = table.columns(key)
                assert cols is not None
                assert cols["base"] == snap.total, (key, cols, snap)
                assert cols["own_applied"] == snap.seq_of(NODE), (key, cols, snap)
                self.refused.pop(key, None)
                self.seen["seeded"] += 1
                if outcome == "bad":
                    self.seen["seeded beside undecodable items"] += 1
            else:
                assert not table.is_seeded(key), f"{key} seeded by a read older than its epoch"
                self.refused[key] += 1
                self.seen["refused"] += 1
                if self.refused[key] < MAX_TRIES:
                    self.owed.add(key)
                else:
                    self.refused.pop(key)
                    self.seen["gave up"] += 1
        self._note_reads()

    def _note_reads(self) -> None:
        """Check reads issued since the last call: size, no repeats, what they pay back."""
        chunk = self.s.chunk
        for read in self.store.reads[self.checked_reads :]:
            assert 1 <= len(read.keys) <= chunk, (read.keys, chunk)
            assert len(set(read.keys)) == len(read.keys), read.keys
            self.owed.difference_update(read.keys)
        self.checked_reads = len(self.store.reads)

    # -- the rest of the node -------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS), qty=st.integers(1, 5))
    def count(self, key: Key, qty: int) -> None:
        """A track: on a cold or unseeded key after a failed seed, counted unseeded."""
        self.table.incr(key, qty)
        self.acked[key] += qty

    @rule()
    def flush(self) -> None:
        flush(self.table, self.store)

    @rule()
    def evict(self) -> None:
        before = self.table.epoch
        self.table.evict_idle()
        if self.table.epoch != before and self.store.pending():
            self.seen["eviction under a read"] += 1

    @rule()
    def evict_another_key(self) -> None:
        """An eviction pass that drops some other idle key (there are always some)."""
        self.spares += 1
        spare = ("spare", f"s{self.spares}", PERIOD)
        self.table.seed(spare, EMPTY)
        before = self.table.epoch
        self.table.evict_idle()
        self.table.evict_idle()
        assert self.table.epoch > before and not self.table.is_warm(spare)
        if self.store.pending():
            self.seen["eviction under a read"] += 1

    @rule(key=st.sampled_from(KEYS))
    def seed_elsewhere(self, key: Key) -> None:
        """``usage_all`` or the flusher seeding the key with a read of its own (fresh)."""
        if not self.table.is_seeded(key):
            self.table.seed(key, _copy(self.store.items.get(key, EMPTY)))
            self.seen["seeded elsewhere"] += 1

    @rule(data=st.data())
    def seed_one_being_read(self, data: st.DataObject) -> None:
        """Another path seeds a key while the seeder's read of it is out."""
        keys = sorted({k for r in self.store.pending() for k in r.keys})
        if keys:
            self.seed_elsewhere(data.draw(st.sampled_from(keys)))

    @rule(key=st.sampled_from(KEYS), qty=st.integers(1, 5))
    def peer_writes(self, key: Key, qty: int) -> None:
        self.peer_seq[key] += 1
        run_sync(self.store.apply(PEER, [Delta(key, self.peer_seq[key], qty)]))
        self.peer_units[key] += qty

    @rule(key=st.sampled_from(KEYS), qty=st.integers(1, 5))
    def another_holder_then_claim(self, key: Key, qty: int) -> None:
        """Another process held this node's id and stored units under it (maybe while reads
        of the key were out), then this node claimed the id: as ``Node._owner_state`` does,
        reads issued before are refused and the warm seeded keys re-read (the flusher's
        ``reread``). A stale read seeding after it would make the next flush reuse the
        holder's sequence: ``flush`` fails on that duplicate."""
        seq = self.store.items.get(key, EMPTY).seq_of(NODE) + 1
        run_sync(self.store.apply(NODE, [Delta(key, seq, qty)]))
        self.holder_units[key] += qty
        self.table.refuse_earlier_reads()
        warm_keys = self.table.keys()  # a list: the table is not iterable
        for warm in warm_keys:
            if self.table.is_seeded(warm):
                self.table.rebase(warm, _copy(self.store.items.get(warm, EMPTY)), "read")
        if self.store.pending():
            self.seen["claim under a read"] += 1

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def reads_stay_within_bounds(self) -> None:
        if self.seeder is None:
            return
        assert self.store.most_open <= self.s.concurrency, (self.store.most_open, self.s)
        reading: Counter[Key] = Counter(k for r in self.store.outstanding for k in r.keys)
        assert all(n == 1 for n in reading.values()), reading

    @invariant()
    def only_a_fresh_read_seeds(self) -> None:
        by_snap = {id(s): r for r in self.store.reads for s in r.snaps.values()}
        for key, snap, epoch in self.table.seeds[self.checked_seeds :]:
            read = by_snap.get(id(snap))
            if read is not None:
                assert read.epoch == epoch, f"{key} seeded by a read issued before epoch {epoch}"
                self.seen["seed traced to its read"] += 1
        self.checked_seeds = len(self.table.seeds)

    @invariant()
    def no_seeded_row_is_behind_its_stored_sequence(self) -> None:
        """A seeded row knows every sequence stored under this node's id (else its next flush
        reuses one, and the store drops its units as a duplicate)."""
        for key in KEYS:
            cols = self.table.columns(key)
            if cols is not None and cols["seeded"]:
                stored = self.store.items.get(key, EMPTY).seq_of(NODE)
                assert cols["own_seq"] >= stored, f"{key}: row at {cols}, stored {stored}"

    @invariant()
    def answered_callers_answered_well(self) -> None:
        for task, _ in self.callers:
            if task.done():
                assert task.exception() is None, task.exception()

    # -- the end --------------------------------------------------------------------------

    def quiesce(self) -> None:
        """Let every read land (fresh ones seed), until none is out or queued."""
        for _ in range(100):
            self.loop.settle()
            self._note_reads()
            pending = self.store.pending()
            if not pending:
                break
            for read in pending:
                self._land(read, "ok")
        assert not self.store.pending() and not self.s.busy(), "reads never stop"

    def teardown(self) -> None:
        try:
            if self.seeder is not None and sys.exc_info()[0] is None:
                self.finish()
        finally:
            self.loop.close()

    def finish(self) -> None:
        self.quiesce()
        self.only_a_fresh_read_seeds()
        waiting = [keys for task, keys in self.callers if not task.done()]
        assert not waiting, f"callers still waiting after every read landed: {waiting}"
        assert not self.owed, f"refused reads never read again: {self.owed}"
        # Seed what is left (rows counted unseeded) and store everything.
        self.callers.append(
            (self.loop.loop.create_task(self.s.seed_many(self.table.unseeded_keys())), [])
        )
        self.quiesce()
        assert not self.table.unseeded_keys(), "fresh reads must seed"
        flush(self.table, self.store)
        assert not self.table.dirty_keys()
        for key in KEYS:
            want = (
                self.stored.get(key, 0)
                + self.acked[key]
                + self.peer_units[key]
                + self.holder_units[key]
            )
            got = self.store.items.get(key, EMPTY).total
            assert got == want, f"{key}: stored {got}, acknowledged {want}"
        self.only_a_fresh_read_seeds()
        self.probe_full_tries()
        self.only_a_fresh_read_seeds()

    def probe_full_tries(self) -> None:
        """Whatever happened before, a key evicted and asked for again gets MAX_TRIES reads
        before its caller is told it could not be seeded."""
        self.evict_another_key()  # everything is stored and idle: every key goes
        for key in KEYS:
            assert not self.table.is_warm(key)
            caller = self.loop.loop.create_task(self.s.seed(key))
            self.loop.settle()
            for refused in range(MAX_TRIES):
                pending = self.store.pending()
                assert len(pending) == 1 and key in pending[0].keys, (
                    f"{key}: given up after {refused} refused reads, not {MAX_TRIES}"
                )
                if refused < MAX_TRIES - 1:
                    self.evict_another_key()
                self._land(pending[0], "ok")
                self.loop.settle()
            assert caller.result() is True


SeederMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSeeder = SeederMachine.TestCase


def test_the_machine_reaches_refusals_give_ups_and_failures() -> None:
    """The machine must reach what it claims to check: reads overtaken by an eviction pass or
    a claim of the node id (refused, read again, given up after MAX_TRIES), failed reads,
    other seeding paths."""
    seen = reach_alone("tests.test_seeder", "SeederMachine", examples=100, steps=50)
    print(f"\nthe seeder machine: {seen}")
    assert seen.get("refused", 0) >= 20 and seen.get("gave up", 0) >= 1, seen
    assert seen.get("eviction under a read", 0) >= 20, seen
    assert seen.get("claim under a read", 0) >= 20, seen
    assert seen.get("seeded", 0) >= 100 and seen.get("failed", 0) >= 20, seen
    assert seen.get("seeded elsewhere", 0) >= 20, seen
    assert seen.get("seeded elsewhere while read", 0) >= 5, seen
    assert seen.get("seeded beside undecodable items", 0) >= 1, seen
    # The seeds checked against their reads (the table's seeding calls are spied on).
    assert seen.get("seed traced to its read", 0) >= 100, seen


# -- property tests -----------------------------------------------------------------------------


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


@settings(max_examples=200, deadline=None)
@given(
    chunk=st.integers(1, 5),
    concurrency=st.integers(1, 4),
    asks=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 29), min_size=1, max_size=12)),
        min_size=1,
        max_size=6,
    ),
)
def test_keys_asked_for_in_one_pass_share_batches(
    chunk: int, concurrency: int, asks: list[tuple[bool, list[int]]]
) -> None:
    """Callers (``seed`` and ``seed_many``, keys overlapping) that ask in one event-loop pass
    are served by ceil(distinct keys / chunk) reads, each key in exactly one, never more than
    ``concurrency`` at once; every caller is answered and every key seeded."""
    with Rig(chunk, concurrency) as rig:
        pool = keys_named("k", 30)
        callers = []
        for many, idx in asks:
            keys = [pool[i] for i in idx]
            if many:
                callers.append(rig.task(rig.seeder.seed_many(keys)))
            else:
                callers.extend(rig.task(rig.seeder.seed(k)) for k in keys)
        distinct = {pool[i] for _, idx in asks for i in idx}
        for _ in range(100):
            rig.loop.settle()
            pending = rig.store.pending()
            if not pending:
                break
            for read in pending:
                land(read, "ok")
        assert all(c.done() for c in callers)
        loads = [set(r.keys) for r in rig.store.reads]
        assert len(loads) == math.ceil(len(distinct) / chunk), (len(loads), len(distinct), chunk)
        assert sum(len(r) for r in loads) == len(distinct) and set().union(*loads) == distinct
        assert rig.store.most_open <= concurrency
        assert all(rig.table.is_seeded(k) for k in distinct)


@settings(max_examples=200, deadline=None)
@given(
    chunk=st.integers(1, 4),
    concurrency=st.integers(1, 3),
    extra_batches=st.integers(1, 4),
    from_ahead=st.sets(st.integers(0, 39), max_size=10),
    new=st.integers(0, 6),
    order=st.randoms(use_true_random=False),
)
def test_keys_a_caller_waits_on_go_before_keys_read_ahead(
    chunk: int,
    concurrency: int,
    extra_batches: int,
    from_ahead: set[int],
    new: int,
    order: random.Random,
) -> None:
    """With read-ahead filling every read slot and more queued behind, keys a caller then
    waits on (some queued for read-ahead, some being read ahead, some new) are read before any
    other read-ahead key: every read issued after the call holds only such keys until all of
    them are read. Keys already being read are not read again, and no key is read twice."""
    with Rig(chunk, concurrency) as rig:
        ahead = keys_named("a", (concurrency + extra_batches) * chunk)
        rig.loop.call(rig.seeder.prefetch, ahead)
        rig.loop.settle()
        first = list(rig.store.pending())
        assert len(first) == concurrency, "read-ahead fills every slot"
        reading = {k for r in first for k in r.keys}
        wanted = [ahead[i % len(ahead)] for i in sorted(from_ahead)] + keys_named("n", new)
        if not wanted:
            wanted = keys_named("n", 1)
        # Half the keys through seed(), the rest through one seed_many(), in the same pass.
        callers = [rig.task(rig.seeder.seed(k)) for k in wanted[::2]]
        callers.append(rig.task(rig.seeder.seed_many(wanted[1::2])))
        rig.loop.settle()
        owed = set(wanted) - reading
        issued_after: list[Read] = []
        for _ in range(200):
            pending = rig.store.pending()
            if not pending:
                break
            land(order.choice(pending), "ok")
            rig.loop.settle()
            issued_after = rig.store.reads[len(first) :]
        assert all(c.done() for c in callers), "every caller answered"
        assert all(rig.table.is_seeded(k) for k in wanted)
        left = set(owed)
        for read in issued_after:
            if left:
                assert set(read.keys) <= left, (
                    f"read-ahead keys {sorted(set(read.keys) - left)} read while keys waited on "
                    f"{sorted(left)} were queued"
                )
            left -= set(read.keys)
        assert not left
        counts = Counter(k for r in rig.store.reads for k in r.keys)
        assert set(counts) == set(ahead) | set(wanted) and set(counts.values()) == {1}, counts
        # The keys waited on were read together: as few reads as the chunk allows.
        assert sum(1 for r in issued_after if set(r.keys) & owed) == math.ceil(len(owed) / chunk)


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
            """Make an idle key and evict it: the table's epoch moves on."""
            idle = next(spare)
            rig.table.seed(idle, EMPTY)
            before = rig.table.epoch
            rig.table.evict_idle()
            rig.table.evict_idle()
            assert rig.table.epoch == before + 1

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
        cols = rig.table.columns(key)
        assert cols is not None and cols["seeded"] == 1 and cols["base"] == 5


async def test_close_wakes_callers_of_reads_cancelled_before_they_ran() -> None:
    """A read task cancelled by close() before its first step never runs its cleanup: its
    callers must still wake (a draining node answers them), with their keys unseeded."""
    from meter.core.seeder import Seeder
    from meter.core.table import CounterTable
    from storage.memory import MemoryStorage

    table = CounterTable("n1")
    seeder = Seeder(table, MemoryStorage(), chunk=10, concurrency=2)
    key = ("acme", "api", "2026-11")
    waiter = asyncio.ensure_future(seeder.seed(key))
    for _ in range(2):  # the waiter queues the key; the next pass dispatches its read task
        await asyncio.sleep(0)
    assert seeder.stats.reads == 0 and seeder._reading == 1, "read task created, not run"
    await seeder.close()
    await asyncio.wait_for(waiter, 1)
    assert waiter.result() is False and not table.is_seeded(key)


async def test_a_landing_that_fails_still_wakes_its_callers() -> None:
    """L04: if seeding a landed batch raises (a backend bug: an answer that is no snapshot),
    every caller of the batch still wakes, its key unseeded, and the error is logged."""

    class WrongAnswers(MemoryStorage):
        async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]:
            return dict.fromkeys(keys, None)  # type: ignore[return-value]

    table = CounterTable(NODE)
    seeder = Seeder(table, WrongAnswers(), chunk=10, concurrency=2)
    assert await asyncio.wait_for(seeder.seed(KEYS[0]), 5) is False
    await asyncio.wait_for(seeder.seed_many(KEYS[1:]), 5)
    assert not any(table.is_seeded(k) for k in KEYS)
    assert not seeder.busy() and seeder.status()["queued"] == 0
    assert "failed unexpectedly" in str(seeder.stats.last_error)
    await seeder.close()


class HeldStore(MemoryStorage):
    """A memory store whose reads answer only once ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.started = 0

    async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]:
        self.started += 1
        await self.release.wait()
        return await super().load(keys)


def _seeder_reads() -> list[asyncio.Task[Any]]:
    """The seeder's read tasks still alive on the running loop."""
    return [
        t
        for t in asyncio.all_tasks()
        if not t.done() and getattr(t.get_coro(), "__qualname__", "") == "Seeder._read"
    ]


async def test_close_leaves_no_read_running_and_starts_none() -> None:
    """close() with reads out and more queued: the cancelled reads' cleanup starts no new
    read, no read task outlives close(), and ``status`` counts nothing queued or in flight
    (none negative)."""
    table = CounterTable(NODE)
    store = HeldStore()
    seeder = Seeder(table, store, chunk=10, concurrency=2)
    keys = keys_named("c", 100)
    assert seeder.prefetch(keys) == 100  # ten batches queued ahead
    waiter = asyncio.ensure_future(seeder.seed_many(keys_named("w", 25)))
    deadline = asyncio.get_running_loop().time() + 5
    while store.started < 2:  # both read slots taken
        assert asyncio.get_running_loop().time() < deadline, "reads never started"
        await asyncio.sleep(0.001)
    await seeder.close()
    assert not _seeder_reads(), "a read runs after close()"
    status = seeder.status()
    assert status["queued"] == 0 and status["in_flight"] == 0, status
    assert not seeder.busy()
    await asyncio.wait_for(waiter, 5)  # the caller is answered, its keys unseeded
    assert store.started == 2, "a read started after close()"
    # Asked after close: answered at once, nothing read.
    assert await asyncio.wait_for(seeder.seed(keys[0]), 5) is False
    assert seeder.prefetch(keys_named("late", 3)) == 0
    assert store.started == 2 and not _seeder_reads()


def test_a_refused_key_a_caller_waits_on_is_read_again_before_the_read_ahead() -> None:
    """L01, L05: a key a caller waits on, whose read (a read-ahead batch already sent) an
    eviction pass overtook, is read again in the next read, not behind every batch of the
    read-ahead queued meanwhile."""
    with Rig(chunk=10, concurrency=2) as rig:
        ahead = keys_named("a", 200)  # twenty batches read ahead
        rig.loop.call(rig.seeder.prefetch, ahead)
        rig.loop.settle()
        first = rig.store.pending()
        assert len(first) == 2 and first[0].keys == ahead[:10]
        target = ahead[0]  # being read ahead: the caller waits for that read
        caller = rig.task(rig.seeder.seed(target))
        rig.loop.settle()
        assert len(rig.store.reads) == 2, "no read of its own: it is being read"
        rig.table.seed(("spare", "s", PERIOD), EMPTY)  # an idle key for the eviction pass
        rig.table.evict_idle()
        before = rig.table.epoch
        rig.table.evict_idle()
        assert rig.table.epoch == before + 1
        land(first[0], "ok")  # overtaken: refused, every key of it read again
        rig.loop.settle()
        assert not caller.done()
        nxt = rig.store.reads[2]
        assert nxt.keys == [target], f"next read {nxt.keys}, not the key a caller waits on"
        land(nxt, "ok")
        rig.loop.settle()
        assert caller.result() is True and rig.table.is_seeded(target)
