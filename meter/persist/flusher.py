"""The flusher: a thin loop that writes each dirty key's delta and re-bases it on the answer.

Exactly once: a delta taken for flushing stays in flight in the table, under its sequence,
until the store answers for that key. A failed or unknown outcome leaves it there, and the next
round sends the same ``(key, seq, delta)`` again; the store refuses a sequence it already
applied and answers with the item, so a retry of a write that did land counts nothing.

Why one module: a round's take, write, re-base, day-bucket repairs and stretch (the turns
of keys under no limit) all read and move the same in-flight state under one lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from meter.core.counts import FLUSH_BOUNDS, Buckets, FeatureUnits, PeriodUnits
from meter.core.dims import is_dimension, shown
from meter.core.keys import Key
from meter.core.table import CounterTable
from meter.history.days import clamp_day, utc_day
from meter.persist.owner import Ownership
from meter.wal.log import WalError, WriteAheadLog
from meter.wal.records import FLUSH
from storage.base import Applied, BadItems, Counters, DayBuckets, Delta, StorageError

log = logging.getLogger("meter.flusher")

#: Day bucket repairs a flusher keeps waiting (docs/history.md); past this the oldest is given
#: up (logged, counted in ``repairs_dropped``).
MAX_REPAIRS = 100_000

#: A key's stored item is read back (not derived, ADR 0015) at least every this many of its
#: flushes: an item that went back (expired, restored) or a peer's flush whose gossip was lost
#: shows in its view within that many flushes of the key.
REREAD_EVERY = 8

#: Longest a backlog stretches the interval of keys under no limit: they are written every
#: this many rounds at least (docs/storage.md, "A round longer than the interval"). A power
#: of two, as every stretch is.
MAX_STRETCH = 8

#: Called after every successful write with the keys and snapshots just stored (gossip hook).
OnFlushed = Callable[[list[tuple[Key, Applied]]], Awaitable[None] | None]


@dataclass
class FlushStats:
    """What ``status`` shows about flushing."""

    rounds: int = 0
    keys_written: int = 0
    duplicates: int = 0
    failures: int = 0
    #: Keys re-seeded because their stored item went back (expired or restored).
    reseeded: int = 0
    last_at: float | None = None
    last_result: str = "never"
    last_error: str | None = None
    #: Wall-clock time since which some delta has been waiting because writes failed.
    backlog_since: float | None = None
    #: Keys whose write failed permanently (parked, never retried): key -> error.
    poisoned: dict[Key, str] = field(default_factory=dict)
    #: How long rounds took (seconds).
    round_seconds: Buckets = field(default_factory=lambda: Buckets(FLUSH_BOUNDS))
    #: The process's CPU time while rounds ran (requests served meanwhile count too, so
    #: per stored key it is an upper bound of what flushing costs).
    cpu_seconds: float = 0.0
    #: Rounds that took longer than the interval stretch it for keys under no limit: each is
    #: written every ``stretch`` rounds (1: every round); ``stretched`` counts the keys the
    #: last round left for a later one.
    stretch: int = 1
    stretched: int = 0


class FlushTarget(Counters, DayBuckets, Protocol):
    """What the flusher writes to: the counters and their day buckets."""


class Flusher:
    """Writes dirty keys every ``interval`` seconds, with backoff while writes fail."""

    def __init__(
        self,
        table: CounterTable,
        storage: FlushTarget,
        *,
        interval: float = 1.0,
        batch_keys: int = 10_000,
        max_backoff: float = 30.0,
        on_flushed: OnFlushed | None = None,
        wal: WriteAheadLog | None = None,
        owner: Ownership | None = None,
        feature_units: FeatureUnits | None = None,
        limited: Callable[[Key], bool] | None = None,
        period_units: PeriodUnits | None = None,
    ) -> None:
        self.table = table
        #: The units taken for storage by period, for the period's close mark (``None``:
        #: not kept).
        self.period_units = period_units
        #: Whether a key is under a limit, a price or alerts: never stretched (``None``: every
        #: key counts as limited, nothing is stretched).
        self.limited = limited
        #: Units stored by feature (the ``metrics_feature_labels`` setting; ``None``: off).
        self.feature_units = feature_units
        #: Writes happen only while this node owns its id in storage (``None``: not checked).
        self.owner = owner
        #: Deltas are logged (and synced) here before they are sent, so a restarted node
        #: re-sends the same ``(key, seq, delta)``.
        self.wal = wal
        self.storage = storage
        self.interval = interval
        self.batch_keys = batch_keys
        self.max_backoff = max_backoff
        self.on_flushed = on_flushed
        self.stats = FlushStats()
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._failures_in_row = 0
        #: Of the dirty keys, the part the round being run writes (below 1: stretched), and
        #: how long its writes took.
        self._share = 1.0
        self._writing = 0.0
        #: Rounds run (failed or not): whose turn it is while stretched.
        self._turn = 0
        self._round_started = time.time()
        self._reread = False
        #: The clock that dates day buckets (tests set it).
        self.clock: Callable[[], float] = time.time
        #: Each month key's in-flight ``(seq, day, delta)``: a retry of a delta goes to the
        #: same day bucket as its first try (docs/history.md), whatever day it is sent on.
        self._days: dict[Key, tuple[int, str, int]] = {}
        #: Deltas stored without this node hearing it (a peer's snapshot or a read covered
        #: them while their write's answer was an error): their day bucket may lack them, and
        #: is written alone (``Storage.apply_days``) until it answers.
        self._repairs: dict[tuple[Key, int], Delta] = {}
        #: Keys with a repair outstanding, and how many: a key's next delta is not taken
        #: before its repair landed (a bucket keeps one sequence per node, so a later one
        #: landing first would make the repair look like a duplicate).
        self._repair_keys: dict[Key, int] = {}
        #: Repairs given up: more than MAX_REPAIRS outstanding (counted, logged).
        self.repairs_dropped = 0

    def reread_before_writing(self) -> None:
        """The node (re)gained its id: rows seeded before may hold sequences of ours that the
        previous holder of the id has since passed, and totals it has since changed. No round
        writes until :meth:`reread` has re-based every warm key on a fresh read."""
        self._reread = True

    async def reread(self) -> bool:
        """Re-read every warm, seeded key and re-base on it (between rounds); True if done."""
        async with self._lock:
            return await self._reread_warm()

    async def _reread_warm(self) -> bool:
        warm = self.table.keys()  # a list: the table is not iterable
        keys = [k for k in warm if self.table.is_seeded(k)]
        try:
            for start in range(0, len(keys), 100):
                snaps = await self.storage.load(keys[start : start + 100])
                for key, snap in snaps.items():
                    self.table.rebase(key, snap, "read")
        except StorageError as exc:
            self._note_error(f"re-reading {len(keys)} keys after claiming the node id: {exc}")
            return False
        self._reread = False
        return True

    async def run(self) -> None:
        """Flush forever (until cancelled)."""
        while True:
            delay = self._next_delay()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
            self._wake.clear()
            try:
                await self.flush_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not stop flushing for good
                log.exception("flush round failed unexpectedly")
                self._failures_in_row += 1
                self.stats.last_result = "error"
                self.stats.last_error = f"{type(exc).__name__}: {exc}"[:300]

    def wake(self) -> None:
        """Start the next round now instead of at the next interval."""
        self._wake.set()

    def _next_delay(self) -> float:
        if self._failures_in_row == 0:
            return self.interval
        backoff = min(self.max_backoff, self.interval * 2 ** min(self._failures_in_row, 20))
        return random.uniform(self.interval, max(self.interval, backoff))

    async def flush_once(self) -> bool:
        """One round: seed unseeded keys, write every dirty key. True if nothing failed."""
        return await self._flush_once(stretch=True)

    async def _flush_once(self, *, stretch: bool) -> bool:
        async with self._lock:
            began = time.monotonic()
            cpu = time.process_time()
            self.stats.stretched = 0
            self._writing = 0.0
            try:
                return await self._round(stretch)
            finally:
                took = time.monotonic() - began
                self.stats.round_seconds.add(took)
                self.stats.cpu_seconds += time.process_time() - cpu
                # Every round, also one that failed, moves the turns on: no turn repeats.
                self._turn += 1
                # A round that outlasts the interval writes the keys under no limit less
                # often until rounds fit again (their units wait in memory, in order). Judged
                # by what a round of every dirty key would take: the writes scaled up from
                # the part written, the rest of the round (reads, the owner check) as it was.
                # A power of two: a key's turn at 8 is its turn at 4, 2 and 1 too, so however
                # the stretch moves, every key is written at least every MAX_STRETCH rounds.
                whole = took - self._writing + self._writing / self._share
                need = max(1, min(MAX_STRETCH, math.ceil(whole / self.interval)))
                self.stats.stretch = 1 << (need - 1).bit_length()
                self._share = 1.0

    async def _round(self, stretch: bool = False) -> bool:
        """:meth:`flush_once` under its lock (``stretch``: keys under no limit may wait for
        a later round while rounds outlast the interval)."""
        # A round against a store that is down can take seconds (timeouts, retries): a
        # failure it meets dates the backlog from the round's start, not its end.
        self._round_started = time.time()
        if self.wal is not None and self.wal.broken is not None:
            # Nothing can be logged, so nothing is taken or sent (a take's record would
            # fail with the answers of the pass it lands in, reads included).
            self._note_error(f"the write-ahead log cannot be written: {self.wal.broken}")
            self._finish_round(False)
            return False
        seeded = await self._seed_unseeded()
        wrote = True
        keys = [k for k in self.table.dirty_keys() if k not in self.stats.poisoned]
        if stretch and self.stats.stretch > 1 and self.limited is not None:
            keys = self._this_turn(keys, self.stats.stretch)
        self._find_repairs()
        if keys or self._repairs:
            may = await self._may_write()
            if may is None:
                # Storage did not answer the owner read: it is down, and every write
                # would only fail after its own timeouts. A failed round (backoff).
                self._finish_round(False, seeded)
                return False
            if not may:
                # Not a storage failure: no backoff (the owner loop claims on its own).
                self.stats.rounds += 1
                self.stats.last_at = time.time()
                return False
        if self._repairs:
            wrote = await self._write_repairs()
            if self._repair_keys:  # a key's next delta waits for its repair
                held = self._repair_keys
                keys = [k for k in keys if k not in held]
        began = time.monotonic()
        for start in range(0, len(keys), self.batch_keys):
            wrote = await self._write(keys[start : start + self.batch_keys]) and wrote
        self._writing = time.monotonic() - began
        # Only failed writes back off: a failed seeding read is retried next round, so it
        # never delays the writes of the other keys (nor its own) by up to max_backoff.
        self._finish_round(wrote, seeded)
        return seeded and wrote

    def _this_turn(self, keys: list[Key], stretch: int) -> list[Key]:
        """The keys this round writes while rounds are ``stretch`` intervals long: every
        limited key and every key with a delta in flight (a retry), and of the others those
        whose turn it is (one in ``stretch``, each key in its own turn, so a round is about
        ``1/stretch`` of them)."""
        limited, inflight = self.limited, self.table.inflight_seq
        assert limited is not None
        turn = self._turn % stretch
        out = [
            k
            for k in keys
            if zlib.crc32("\x00".join(k).encode()) % stretch == turn or inflight(k) or limited(k)
        ]
        self.stats.stretched = len(keys) - len(out)
        self._share = max(len(out), 1) / max(len(keys), 1)
        return out

    async def drain(self, timeout: float) -> bool:
        """Flush until nothing is left to write or ``timeout`` passes; True if all written.

        Gives up at once when another process holds this node's id: nothing can be written.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self._flush_once(stretch=False)  # every key, whatever the backlog
            except Exception:  # a bug must not turn a drain into a crash of Node.stop
                log.exception("flush round failed unexpectedly while draining")
            if not self.backlog_keys() and not self._repairs:
                return True
            if time.monotonic() >= deadline:
                if self._repairs:  # not in the log: those days stay short of these units
                    log.error(
                        "drain: %d day bucket repairs (%d units) not written; those days' "
                        "buckets stay short (the month counters have the units)",
                        len(self._repairs),
                        sum(d.delta for d in self._repairs.values()),
                    )
                return False
            if self.owner is not None and self.owner.can_never_write():
                return False
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def backlog_keys(self) -> list[Key]:
        """Keys still holding units the store does not have, each once (poisoned keys
        excluded)."""
        return [key for key, _ in self.table.unflushed(self.stats.poisoned)]

    def backlog(self) -> tuple[list[Key], int]:
        """:meth:`backlog_keys` and the units they hold, in one walk of the table."""
        held = self.table.unflushed(self.stats.poisoned)
        return [key for key, _ in held], sum(units for _, units in held)

    async def _may_write(self) -> bool | None:
        """Whether this round may write: this node holds its id (and, after it (re)gained it,
        its warm keys were re-read). ``None``: storage did not answer reading the owner back
        (this round's failure, dated from its start)."""
        owner = self.owner
        if owner is None:
            return True
        failures = owner.read_failures
        allowed = await owner.may_write()
        if owner.read_failures != failures:
            self._note_error(f"storage unreachable: {owner.last_error}")
            return None
        if not allowed:
            refusal = owner.refusal()
            self.stats.last_error = (
                f"not flushing: {refusal}"
                if refusal
                else f"not flushing: node id not claimed "
                f"yet ({owner.last_error or 'storage not asked yet'})"
            )
            self.stats.last_result = "not owner"
            if self.stats.backlog_since is None:
                self.stats.backlog_since = self._round_started
            return False
        return not self._reread or await self._reread_warm()

    async def _seed_unseeded(self) -> bool:
        keys = self.table.unseeded_keys()
        if not keys:
            return True
        keys = [k for k in keys if k not in self.stats.poisoned]
        if not keys:
            return True
        # A read issued before the node (re)claimed its id may predate the last holder's
        # writes: the table refuses it (the keys stay unseeded, read again next round).
        epoch = self.table.epoch
        try:
            snaps = await self.storage.load(keys)
        except BadItems as exc:
            # Those keys' stored items cannot be read: park them (their units stay in memory,
            # reported), and seed the rest.
            for key, why in exc.bad.items():
                self._park(key, f"cannot seed: {why}")
            snaps = exc.good
        except StorageError as exc:
            self._note_error(f"seeding {len(keys)} keys: {exc}")
            return False
        for key, snap in snaps.items():
            self.table.seed(key, snap, epoch)
        return True

    async def _check_went_back(self, suspects: list[tuple[Key, int]]) -> None:
        """Tell a write answer overtaken by a peer's newer snapshot from a stored item that
        went back (TTL expiry, a recreated or restored table), with a fresh read.

        The read is newer than anything the row knew when it was issued; if even it is older
        than that, storage went back, and the row is re-seeded on it (else its in-flight delta
        would be retried for ever). If it merely covers the row, it re-bases as usual.
        """
        before = {key: self.table.based_on(key) for key, _ in suspects}
        try:
            fresh = await self.storage.load([key for key, _ in suspects])
        except BadItems as exc:
            fresh = exc.good
        except StorageError:
            return  # the in-flight deltas are retried next round
        for key, seq in suspects:
            snap, known = fresh.get(key), before[key]
            if snap is None or known is None or self.table.rebase(key, snap, "read"):
                continue
            went_back = any(snap.seq_of(n) < s for n, s in known.seqs.items())
            if went_back and snap.seq_of(self.table.node) >= seq:
                log.warning(
                    "stored item of %s went back (expired, recreated or restored): "
                    "re-seeded on it (total %s)",
                    _fmt(key),
                    snap.total,
                )
                self.table.reseed(key, snap)
                self.stats.reseeded += 1

    def _find_repairs(self) -> None:
        """Move to the repairs the dated deltas no longer in flight: a re-base on a snapshot
        holding one (a peer's, a read) ended it while its write's answer was an error, so its
        counter has it and its day bucket may not."""
        days = self._days
        if not days:
            return
        inflight_seq = self.table.inflight_seq
        for key, (seq, day, delta) in list(days.items()):
            if inflight_seq(key) != seq:
                del days[key]
                self._add_repair(Delta(key, seq, delta, day))

    def _add_repair(self, d: Delta) -> None:
        ident = (d.key, d.seq)
        if ident in self._repairs:
            return
        if len(self._repairs) >= MAX_REPAIRS:  # bounded: the oldest goes (logged, counted)
            old = next(iter(self._repairs))
            self._drop_repair(old)
            self.repairs_dropped += 1
            log.error("day bucket repair of %s dropped: over %d waiting", _fmt(old[0]), MAX_REPAIRS)
        self._repairs[ident] = d
        self._repair_keys[d.key] = self._repair_keys.get(d.key, 0) + 1

    def _drop_repair(self, ident: tuple[Key, int]) -> None:
        if self._repairs.pop(ident, None) is None:
            return
        left = self._repair_keys.get(ident[0], 0) - 1
        if left > 0:
            self._repair_keys[ident[0]] = left
        else:
            self._repair_keys.pop(ident[0], None)

    async def _write_repairs(self) -> bool:
        """Write the repairs' day buckets (each once by its sequence); True if all landed."""
        repairs = list(self._repairs.items())[: self.batch_keys]
        try:
            outcomes = await self.storage.apply_days(self.table.node, [d for _, d in repairs])
        except StorageError as exc:
            if not exc.retryable:  # (a backend without day buckets): never retried
                for ident, _ in repairs:
                    self._drop_repair(ident)
                log.error("%d day buckets not written: %s", len(repairs), exc)
            self._note_error(f"writing {len(repairs)} day buckets: {exc}"[:500])
            return False
        ok = True
        for (ident, d), outcome in zip(repairs, outcomes, strict=True):
            if outcome is None:
                self._drop_repair(ident)
            elif not outcome.retryable:
                self._drop_repair(ident)
                log.error("day bucket %s of %s not written: %s", d.day, _fmt(d.key), outcome)
            else:
                ok = False
                self._note_error(f"day bucket {d.day} of {_fmt(d.key)}: {outcome}")
        return ok

    def _park(self, key: Key, why: str) -> None:
        """Never retry ``key`` automatically; report it (status, log)."""
        self.stats.poisoned[key] = why
        log.error("key parked, its units kept but not stored: %s: %s", _fmt(key), why)
        self._note_error(f"{_fmt(key)}: {why}")

    def _take(self, keys: list[Key]) -> list[Delta]:
        """Take each key's delta; with a log, append them to it (in the same step)."""
        deltas: list[Delta] = []
        now = self.clock()
        today = utc_day(now)
        days = self._days
        inflight_seq = self.table.inflight_seq
        based_on = self.table.based_on
        repair_keys = self._repair_keys
        tally = self.period_units
        for key in keys:
            held = days.get(key)
            if held is not None and inflight_seq(key) != held[0]:
                # Ended while a write's answer was an error (a re-base meanwhile): its bucket
                # first, this key's next delta once that landed.
                del days[key]
                self._add_repair(Delta(key, held[0], held[2], held[1]))
                continue
            if repair_keys and key in repair_keys:
                continue
            taken = self.table.take_flush(key)
            if taken is not None:
                seq = taken[0]
                if tally is not None and not is_dimension(key[1]):
                    tally.take(key, seq, taken[1])
                if held is not None and held[0] == seq:
                    day: str | None = held[1]
                else:
                    if held is not None:  # stored without our answer: its bucket may lack it
                        self._add_repair(Delta(key, held[0], held[2], held[1]))
                    day = clamp_day(key[2], today, now)
                    if day is not None:
                        days[key] = (seq, day, taken[1])
                # Every REREAD_EVERY-th delta of a key is answered by a read of the item
                # (the others may be by what the row rests on plus the delta, ADR 0015).
                known = based_on(key) if seq % REREAD_EVERY else None
                deltas.append(Delta(key, seq, taken[1], day, known))
        if self.wal is not None and deltas:
            self.wal.append([FLUSH, [[*d.key, d.seq, d.delta] for d in deltas]])
        return deltas

    async def _take_committed(self, keys: list[Key]) -> list[Delta]:
        """:meth:`_take` at the log's next commit boundary: a take then holds only units of
        calls whose records are written (a call undone after a failed write was never taken,
        so its units never reach storage)."""
        wal = self.wal
        if wal is None:
            return self._take(keys)
        fut: asyncio.Future[list[Delta]] = asyncio.get_running_loop().create_future()

        def take() -> None:
            try:
                fut.set_result(self._take(keys))
            except BaseException as exc:  # handed to the waiting round
                fut.set_exception(exc)

        wal.at_commit(take)
        return await fut

    async def _write(self, keys: list[Key]) -> bool:
        deltas = await self._take_committed(keys)
        if not deltas:
            return True
        if self.wal is not None:
            try:
                await self.wal.durable()
            except WalError as exc:
                # Not sent: the deltas stay in flight and are logged again next round.
                for d in deltas:
                    self.table.flush_failed(d.key)
                self._note_error(f"logging {len(deltas)} deltas before writing them: {exc}")
                return False
        node = self.table.node
        try:
            results = await self.storage.apply(node, deltas)
        except Exception as exc:
            # The batch's fate is unknown: every delta stays in flight for a retry. A backend
            # bug (anything but a StorageError) is logged with its traceback, and must not
            # stop the other batches of the round.
            if not isinstance(exc, StorageError):
                log.exception("storage.apply raised %s", type(exc).__name__)
            for d in deltas:
                self.table.flush_failed(d.key)
            self._note_error(f"writing {len(deltas)} keys: {exc!r}"[:500])
            return False
        ok = True
        written: list[tuple[Key, Applied]] = []
        suspects: list[tuple[Key, int]] = []
        for d in deltas:
            outcome = results.get(d.key)
            if isinstance(outcome, Applied):
                self._days.pop(d.key, None)
                snap = outcome.snapshot
                if not self.table.rebase(d.key, snap, "flush") and snap.seq_of(node) >= d.seq:
                    # The answer holds our delta but is older than the row's snapshot: either a
                    # peer's newer snapshot overtook it (harmless), or the item went back.
                    suspects.append((d.key, d.seq))
                written.append((d.key, outcome))
                self.stats.keys_written += 1
                if self.period_units is not None:
                    self.period_units.stored(d.key, d.seq)
                if self.feature_units is not None and not is_dimension(d.key[1]):
                    # (a dimension counter's units are its feature's, counted there)
                    self.feature_units.add(d.key[1], d.delta)
                if outcome.duplicate:
                    self.stats.duplicates += 1
                continue
            ok = False
            self.table.flush_failed(d.key)
            if outcome is None:
                self._note_error(f"{_fmt(d.key)}: the store returned no outcome")
            elif not outcome.retryable:
                msg = f"{_fmt(d.key)} seq {d.seq}: {outcome}"
                self.stats.poisoned[d.key] = str(outcome)
                log.error("permanent write failure, delta parked (not retried): %s", msg)
                self._note_error(msg)
            else:
                self._note_error(f"{_fmt(d.key)}: {outcome}")
        if suspects:
            await self._check_went_back(suspects)
        if written and self.on_flushed is not None:
            maybe = self.on_flushed(written)
            if maybe is not None:
                await maybe
        return ok

    def _note_error(self, message: str) -> None:
        self.stats.failures += 1
        self.stats.last_error = message
        if self.stats.backlog_since is None:
            self.stats.backlog_since = self._round_started
        log.warning("flush: %s", message)

    def _finish_round(self, wrote: bool, seeded: bool = True) -> None:
        """End a round: failed writes back off; a failed seeding read only shows as an error."""
        self.stats.rounds += 1
        self.stats.last_at = time.time()
        self._failures_in_row = 0 if wrote else self._failures_in_row + 1
        if wrote and seeded:
            self.stats.last_result = "ok"
            if not self.backlog_keys():
                self.stats.backlog_since = None
        else:
            self.stats.last_result = "error"


def _fmt(key: Key) -> str:
    return f"{key[0]}/{shown(key[1])}@{key[2]}"
