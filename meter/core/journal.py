"""The log journal: undoing calls whose log write failed, and restating state in checkpoints.

The write-ahead log (:mod:`meter.wal.log`) calls :meth:`Journal.undo` with the records of a
batch it could not write (their calls are then answered ``unavailable``, having changed
nothing), and :meth:`Journal.checkpoint` when it compacts: records restating everything the
log must keep, so older segments can go.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from meter.config import CounterConfig
from meter.core.counts import PeriodUnits
from meter.core.gate import pool_key
from meter.core.gauging import Gauging
from meter.core.idempotency import RequestIds
from meter.core.keycache import KeyCache
from meter.core.keys import Key
from meter.core.leases import Lease
from meter.core.reserving import Reserving, dim_keys, mono, wall
from meter.core.table import CounterTable
from meter.core.uniques import Uniques
from meter.wal import records as R
from meter.wal.records import spent_from_log
from meter.wal.replay import lease_dims

#: Items per record when the state is restated in a checkpoint.
CHECKPOINT_ITEMS = 1000


class Journal:
    """Undo and checkpoints over one node's table, request ids and reservations."""

    def __init__(
        self,
        table: CounterTable,
        keys: KeyCache,
        ids: RequestIds,
        reserving: Reserving,
        config: CounterConfig,
        gauging: Gauging,
        uniques: Uniques,
        units: PeriodUnits | None = None,
    ) -> None:
        self.table = table
        self.keys = keys
        self.ids = ids
        self.reserving = reserving
        self.config = config
        #: Gauges' observations: undone by their records; their unstored readings restated.
        self.gauging = gauging
        #: Unique values' claims: outcomes undone; claims without one restated.
        self.uniques = uniques
        #: The units taken for storage by period: restated after the keys' states.
        self.units = units if units is not None else PeriodUnits()
        #: Keys a restart is reading ahead (recovery's warm-up) and may not have loaded yet:
        #: checkpoints list them as warm until the warm-up ends.
        self.warming: list[Key] = []

    def warm_up_started(self, keys: list[Key]) -> None:
        """A restart's warm-up reads ``keys`` ahead: checkpoints list them until it ends."""
        self.warming = keys

    def warm_up_done(self, keys: list[Key]) -> None:
        """The warm-up of ``keys`` has read them (unless a later one took its place)."""
        if self.warming is keys:
            self.warming = []

    def undo(self, records: list[list[Any]]) -> None:
        """Take back the effects of records whose log write failed (newest first): units,
        leases, ids, and what the calls took from strict shares and credit pools."""
        res = self.reserving
        shares = res.gate.shares
        for rec in records[::-1]:
            kind = rec[0]
            if kind == R.TRACK or kind == R.TRACK_ID:
                self._undo_track(rec, 1)
            elif kind == R.TRACK_MANY:
                for item in rec[1][::-1]:
                    self._undo_track(item, 0)
            elif kind == R.RESERVE:
                lease_id, t, f, p, qty = rec[1:6]
                if res.reservations.get(lease_id) is not None:
                    lease = res.reservations.close(lease_id)
                    for key in ((t, f, p), *dim_keys(lease)):
                        self.table.release(key, qty)
                    if lease_id in res.escrowed:  # its share's units go back, unused
                        res.escrowed.discard(lease_id)
                        shares.settle((t, f, p), qty, qty)
                if rec[7] is not None:
                    self.ids.forget(rec[7])
            elif kind == R.VOID:  # counted again, and not voided
                rid, qty, keys = rec[1:4]
                for t, f, p in keys:
                    self.table.incr((t, f, p), qty, check=False)
                effect = self.ids.effect(rid)
                if effect is not None and qty:  # (a repeat, qty 0, voided nothing)
                    self.ids.count_again(effect)
                # The credits it gave back are spent again; those whose pool share left memory
                # meanwhile stay given back, and the call keeps none of them to give again.
                given = spent_from_log(rec[8] if len(rec) > 8 else False) or ()
                kept = [t for t, n in given if not shares.readmit(pool_key(t), n, 0)]
                if kept and effect is not None and effect.credits:
                    effect.credits = tuple(c for c in effect.credits if c[0] not in kept)
                if rec[4] is not None:
                    self.ids.forget(rec[4])
                if qty and len(rec) > 9:  # a unique value: not to be marked voided
                    for t, f, p in keys:
                        self.uniques.voids.unvoided((t, f, p), rec[9][0])
            elif kind == R.GAUGE:
                self.gauging.undo(rec)
            elif kind == R.CLAIMED:
                self.uniques.undo(rec)
            elif kind == R.SHARES:  # written again with the next commit
                shares.relog([(t, f, p) for t, f, p, _, _ in rec[1]])
            elif kind == R.EXPIRE:  # open again; the next expiry tick that can log it ends it
                lease_id, t, f, p, qty, deadline, escrowed = rec[1:8]
                key = (t, f, p)
                if escrowed and shares.readmit(key, qty, qty):
                    res.escrowed.add(lease_id)
                lease = Lease(lease_id, key, qty, mono(deadline), lease_dims(rec, 8))
                for held in (key, *dim_keys(lease)):
                    self.table.reserve(held, qty, None, check=False)
                res.reservations.open_again(lease)
            elif kind == R.COMMIT or kind == R.RELEASE:
                lease_id, t, f, p, qty, deadline = rec[1:7]
                key = (t, f, p)
                # Units a strict share got back are spoken for again (never fewer than used).
                back = qty if kind == R.RELEASE else max(0, qty - (rec[7] or 0))
                if shares.readmit(key, back, qty):
                    res.escrowed.add(lease_id)
                lease = Lease(
                    lease_id,
                    key,
                    qty,
                    mono(deadline),
                    lease_dims(rec, 13 if kind == R.COMMIT else 11),
                )
                for held in (key, *dim_keys(lease)):
                    if kind == R.COMMIT and rec[7]:
                        self.table.incr(held, -rec[7], check=False)
                    self.table.reserve(held, qty, None, check=False)
                res.reservations.open_again(lease)
                res.done.forget(lease_id)
                rid = rec[10] if kind == R.COMMIT else rec[8]
                if rid is not None:
                    self.ids.forget(rid)
        # What the calls took from strict shares and credit pools (tracks, commits above their
        # reservation), given back after the readmits above.
        res.gate.give_back()

    def closing(self) -> list[list[Any]]:
        """Records that end each commit of the log: the shares' admitted counts the commit's
        calls changed (``SHARES``), so a successor closes them at that, not at their cap."""
        changes = self.reserving.gate.shares.admitted_changes()
        return [[R.SHARES, changes]] if changes else []

    def _undo_track(self, rec: list[Any], at: int) -> None:
        t, f, p, qty = rec[at : at + 4]
        if qty:
            self.table.incr((t, f, p), -qty, check=False)
        if len(rec) > at + 4:
            self.ids.forget(rec[at + 4])

    def checkpoint(self) -> Iterator[list[Any]]:
        """Records restating everything the log must keep, then the warm keys (``WARM``: a
        hint for the next start's warm-up, not state).

        What to restate is listed now (every key with unstored units, every lease and id, every
        warm key); each record is read when it is yielded, so it holds the state as it is then.
        """
        res = self.reserving
        keys = self.table.unstored_keys()
        leases = [lease.id for lease in res.reservations.held()]
        ids = (self.ids.ids(), res.done.ids())
        # The warm keys as they are now (a copy of the table's key list); read a chunk at a time.
        warm = self.table.keys() if self.config.warm_up_max_keys > 0 else []
        return self._restate(keys, leases, ids, self.warming, warm)

    def _restate(
        self,
        keys: list[Key],
        leases: list[str],
        ids: tuple[list[str], list[str]],
        warming: list[Key],
        warm: list[Key],
    ) -> Iterator[list[Any]]:
        res = self.reserving
        for start in range(0, len(keys), CHECKPOINT_ITEMS):
            state = self.table.unstored_state(keys[start : start + CHECKPOINT_ITEMS])
            yield [R.STATE, [[*k, seq, inflight, pending] for k, seq, inflight, pending in state]]
        # The counts, and the takes in flight they hold: a retry of one, logged later under
        # the same sequence, is not a new take. One record: a checkpoint cut short leaves all
        # or none (replay then runs from the one before, and its records).
        units = self.units
        if units.by_period or units.inflight:
            yield [
                R.UNITS,
                [[p, f, n] for p, f, n in units.items()],
                [[*k, seq] for k, seq in units.inflight.items()],
            ]
        readings = self.gauging.table.dirty()
        for start in range(0, len(readings), CHECKPOINT_ITEMS):
            part = readings[start : start + CHECKPOINT_ITEMS]
            yield [R.GAUGES, [[*k, kind, *reading] for k, kind, reading in part]]
        claims = self.uniques.unresolved()
        for start in range(0, len(claims), CHECKPOINT_ITEMS):
            items = self.uniques.restated(claims[start : start + CHECKPOINT_ITEMS])
            if items:
                yield [R.CLAIMS, items]
        unmarked = self.uniques.voids.restated()
        for start in range(0, len(unmarked), CHECKPOINT_ITEMS):
            yield [R.VALUE_VOIDS, unmarked[start : start + CHECKPOINT_ITEMS]]
        for start in range(0, len(leases), CHECKPOINT_ITEMS):
            items = []
            for lease_id in leases[start : start + CHECKPOINT_ITEMS]:
                lease = res.reservations.get(lease_id)
                if lease is not None:
                    item = [lease.id, *lease.key, lease.qty, wall(lease.deadline)]
                    if lease.dims:
                        item.append(list(lease.dims))
                    items.append(item)
            if items:
                yield [R.LEASES, items]
        shares = res.gate.shares.admitted_all()
        for start in range(0, len(shares), CHECKPOINT_ITEMS):
            chunk = shares[start : start + CHECKPOINT_ITEMS]
            # Read now, written in a later pass: the batch that writes it ends with the
            # counts changed since (closing), which the replay takes last.
            res.gate.shares.relog([(t, f, p) for t, f, p, _, _ in chunk])
            yield [R.SHARES, chunk]
        for kind, registry, listed in ((R.IDS, self.ids, ids[0]), (R.DONE, res.done, ids[1])):
            for start in range(0, len(listed), CHECKPOINT_ITEMS):
                now = time.time()
                items = []
                for rid in listed[start : start + CHECKPOINT_ITEMS]:
                    entry = registry.get(rid)
                    if entry is not None and entry[2] > now:
                        effect = registry.effect(rid)
                        if effect is None:
                            items.append([rid, *entry])
                        elif effect.unique is None:
                            items.append([rid, *entry, effect.to_log()])
                        else:
                            value, won_by = effect.unique
                            items.append([rid, *entry, effect.to_log(), [value, list(won_by)]])
                if items:
                    yield [kind, items]
        yield from self._warm_records(warming, warm)

    def _warm_records(self, warming: list[Key], warm: list[Key]) -> Iterator[list[Any]]:
        """``WARM`` records: the keys a warm-up is still reading ahead, then the table's keys
        used since the last eviction pass, then its other keys; only keys of a current
        period, at most ``warm_up_max_keys`` of them. Read a chunk at a time, like the rest
        of a checkpoint (a key evicted meanwhile is left out)."""
        left = self.config.warm_up_max_keys
        if left <= 0:
            return
        now = time.time()
        is_current = self.keys.is_current
        already = set(warming) if warming and warm else None
        recently_used = self.table.recently_used
        for source, used in ((warming, None), (warm, True), (warm, False)):
            for start in range(0, len(source), CHECKPOINT_ITEMS):
                chunk = source[start : start + CHECKPOINT_ITEMS]
                if used is not None:
                    flags = recently_used(chunk)
                    chunk = [k for k, u in zip(chunk, flags, strict=True) if u is used]
                    if already is not None:
                        chunk = [k for k in chunk if k not in already]
                items = [[*k] for k in chunk if is_current(k, now)]
                if not items:
                    continue
                if len(items) >= left:
                    yield [R.WARM, items[:left]]
                    return
                left -= len(items)
                yield [R.WARM, items]
