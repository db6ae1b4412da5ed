"""What a sequence of log records leaves to recover. Pure: records in, state out.

Replaying applies the records in log order to a small model of the node's unstored state:

- per key, the delta in flight (``seq``, ``inflight``; ``seq`` 0 when none) and the units
  pending after it. A ``TRACK`` adds to ``pending``; a ``FLUSH`` under a new sequence moves
  ``delta`` from ``pending`` into flight (the previous sequence was stored: the table takes a
  new one only then); a ``STATE`` sets all three;
- open reservations, finished reservations and remembered request ids, by id;
- claims of unique values whose outcome no record holds (claimed again after the restart);
- the keys the records name, with the record that named each last, and the keys checkpoints
  listed as warm (``WARM``): what a restarted node reads ahead (:meth:`Replay.warm_keys`).

The arithmetic is the table's own (``take`` subtracts what it read), so whatever the
interleaving of calls and flushes, the replayed ``inflight + pending`` of a key equals the
units the log holds that the store may not. See docs/adr/0003-write-ahead-log.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from meter.core.keys import Key
from meter.wal import records as R
from meter.wal.records import UNSAID, Spent, Won, spent_from_log
from storage.base import GaugeReading as Reading
from storage.base import reading_wins


def is_dimension(feature: str) -> bool:
    """Whether a counter name is a dimension counter's (as meter.core.dims says: it holds a
    separator; the log may not import that module)."""
    return "\x1f" in feature or "\x1e" in feature


Counted = tuple[int, tuple[Key, ...], bool, Spent, Won | None]
"""What a call under a request id counted: ``(qty, keys, voided, credits, unique)``."""


@dataclass(slots=True)
class RowState:
    """A key's unstored units: ``inflight`` under ``seq`` (0: none), then ``pending``; and the
    number of the last record that named the key (for :meth:`Replay.warm_keys`)."""

    seq: int = 0
    inflight: int = 0
    pending: int = 0
    named: int = 0


@dataclass(frozen=True, slots=True)
class LeaseState:
    """An open reservation: ``qty`` units of ``key`` until ``deadline`` (epoch seconds)."""

    key: Key
    qty: int
    deadline: float
    #: The dimension counters its commit counts on too.
    dims: tuple[str, ...] = ()


#: ``(fingerprint, answer, expires)`` of a remembered request id; for a finished reservation
#: the fingerprint is :data:`COMMITTED` or :data:`RELEASED` and a commit's answer is
#: ``[actual, value]``.
IdEntry = tuple[int, Any, float]
COMMITTED = 1
RELEASED = 2


@dataclass(slots=True)
class Replay:
    """The state the records applied so far leave behind."""

    #: Every key a record named (with nothing unstored, its state is zeros).
    rows: dict[Key, RowState] = field(default_factory=dict)
    leases: dict[str, LeaseState] = field(default_factory=dict)
    ids: dict[str, IdEntry] = field(default_factory=dict)
    #: What the calls under ``ids`` counted (those a void may take back), by request id:
    #: ``(qty, keys, voided, credits)`` (meter.core.idempotency.Effect).
    effects: dict[str, Counted] = field(default_factory=dict)
    done: dict[str, IdEntry] = field(default_factory=dict)
    records: int = 0
    #: The segment number of the last complete checkpoint seen (0: none).
    checkpoint: int = 0
    #: The keys ``WARM`` records listed, one run per segment, each most recently used first.
    listed: list[list[Key]] = field(default_factory=list)
    #: ``(key, process run)`` -> the units that process had admitted under its share.
    shares: dict[tuple[Key, str], int] = field(default_factory=dict)
    #: Gauges' readings the records hold, by key: ``(kind, reading)``, each record's merged
    #: into the one before (writing them again is harmless: storage keeps the winner).
    gauges: dict[Key, tuple[str, Reading]] = field(default_factory=dict)
    #: Claims of unique values without a logged outcome: ``(key, value)`` by claimant.
    claims: dict[str, tuple[Key, str]] = field(default_factory=dict)
    #: Voided unique values not known marked in storage: claimant by ``(key, value)``.
    unmarked: dict[tuple[Key, str], str] = field(default_factory=dict)
    #: The units taken for storage, by period and feature (meter.core.counts.PeriodUnits),
    #: and the last take counted in them, by key (a ``FLUSH`` of another sequence is a new
    #: take; ``STATE`` records do not move it: a take whose record a failed write lost is
    #: counted by its retry's).
    units: dict[str, dict[str, int]] = field(default_factory=dict)
    counted: dict[Key, int] = field(default_factory=dict)
    _segment: int = 0
    _listed_in: int = -1
    _mode: str | None = None

    def apply_all(self, records: Iterable[list[Any]]) -> None:
        """Apply records in order."""
        for rec in records:
            self.apply(rec)

    def apply(self, rec: list[Any]) -> None:
        """Apply one record. Unknown record types raise ``ValueError`` (a newer format)."""
        self.records += 1
        kind = rec[0]
        if kind == R.TRACK or kind == R.TRACK_ID:
            self._track(rec, 1)
        elif kind == R.TRACK_MANY:
            for item in rec[1]:
                self._track(item, 0)
        elif kind == R.FLUSH:
            for t, f, p, seq, delta in rec[1]:
                row = self._row((t, f, p))
                if row.seq != seq:
                    row.seq = seq
                    row.inflight = delta
                    row.pending -= delta
                if self.counted.get((t, f, p)) != seq and not is_dimension(f):
                    self.counted[(t, f, p)] = seq
                    held = self.units.setdefault(p, {})
                    held[f] = held.get(f, 0) + delta
        elif kind == R.UNITS:  # (every count as it was then)
            self.units = {}
            for p, f, n in rec[1]:
                self.units.setdefault(p, {})[f] = n
            self.counted = {(t, f, p): seq for t, f, p, seq in rec[2]}
        elif kind == R.STATE:
            for t, f, p, seq, inflight, pending in rec[1]:
                row = self._row((t, f, p))
                row.seq = seq
                row.inflight = inflight
                row.pending = pending
        elif kind == R.RESERVE:
            lease, t, f, p, qty, deadline, rid, fp, expires = rec[1:10]
            self.leases[lease] = LeaseState((t, f, p), qty, deadline, lease_dims(rec, 10))
            self._row((t, f, p))
            if rid is not None:
                self._id(rid, (fp, lease, expires))
        elif kind == R.COMMIT:
            lease, t, f, p, qty, deadline, actual, answer, done_exp, rid, fp, expires = rec[1:13]
            self.leases.pop(lease, None)
            self._row((t, f, p)).pending += actual
            for name in lease_dims(rec, 13):
                self._row((t, name, p)).pending += actual
            self.done[lease] = (COMMITTED, [actual, answer], done_exp)
            if rid is not None:
                names = lease_dims(rec, 13)
                keys = ((t, f, p), *((t, n, p) for n in names))
                spent = spent_from_log(rec[14] if len(rec) > 14 else UNSAID)
                self._id(rid, (fp, answer, expires), (actual, keys, False, spent, None))
        elif kind == R.RELEASE:
            lease, t, f, p, qty, deadline, done_exp, rid, fp, expires = rec[1:11]
            self.leases.pop(lease, None)
            self._row((t, f, p))
            self.done[lease] = (RELEASED, None, done_exp)
            if rid is not None:
                self._id(rid, (fp, None, expires))
        elif kind == R.EXPIRE:
            lease, t, f, p = rec[1:5]
            self.leases.pop(lease, None)
            self._row((t, f, p))
        elif kind == R.GAUGE:
            t, f, p, gauge, value, at_ms, node = rec[1:8]
            self._gauge((t, f, p), gauge, (value, at_ms, node))
            if rec[9] is not None:
                self._id(rec[9], (rec[10], rec[11], rec[12]))
        elif kind == R.GAUGES:
            for t, f, p, gauge, value, at_ms, node in rec[1]:
                self._gauge((t, f, p), gauge, (value, at_ms, node))
        elif kind == R.CLAIM:
            t, f, p, value, claimant = rec[1:6]
            self.claims[claimant] = ((t, f, p), value)
            self._row((t, f, p))
        elif kind == R.CLAIMED:
            t, f, p, value, claimant, won, rid, fp, answer, expires = rec[1:11]
            self.claims.pop(claimant, None)
            row = self._row((t, f, p))
            if won:
                row.pending += 1
            if rid is not None:
                won_it: Counted | None = None
                if won and len(rec) > 11:  # (the levels it won: a void takes them back)
                    keys = ((t, f, p), *((t2, f2, p2) for t2, f2, p2, _ in rec[11]))
                    won_by = (claimant, *(str(c) for *_, c in rec[11]))
                    won_it = (1, keys, False, (), (value, won_by))
                self._id(rid, (fp, answer, expires), won_it)
        elif kind == R.CLAIMS:
            for t, f, p, value, claimant in rec[1]:
                self.claims[claimant] = ((t, f, p), value)
        elif kind == R.VALUE_VOIDS:
            for t, f, p, value, claimant in rec[1]:
                self.unmarked[((t, f, p), value)] = claimant
        elif kind == R.SHARES:
            if self._mode == "fsync":  # (an interval segment may have lost answered ones)
                for t, f, p, run, admitted in rec[1]:
                    self.shares[((t, f, p), run)] = admitted
        elif kind == R.IDS:
            for item in rec[1]:
                rid, fp, answer, expires = item[:4]
                counted: Counted | None = None
                if len(item) > 4:  # (what its call counted: a void may take it back)
                    qty, keys, voided, spent = item[4]
                    keyed = tuple((t, f, p) for t, f, p in keys)
                    unique: Won | None = None
                    if len(item) > 5:  # (a unique value: it, and the claimant of each key)
                        unique = (item[5][0], tuple(item[5][1]))
                    counted = (qty, keyed, voided, spent_from_log(spent), unique)
                self._id(rid, (fp, answer, expires), counted)
        elif kind == R.VOID:
            rid, qty, keys, vid, fp, answer, expires = rec[1:8]
            for t, f, p in keys:
                self._row((t, f, p)).pending -= qty
            voided = self.effects.get(rid)
            if voided is not None:
                self.effects[rid] = (*voided[:2], True, *voided[3:])
            if qty and len(rec) > 9:  # a unique value: marked voided in storage
                value, claimants = rec[9]
                for (t, f, p), claimant in zip(keys, claimants, strict=True):
                    self.unmarked[((t, f, p), value)] = claimant
            if vid is not None:
                self._id(vid, (fp, answer, expires))
        elif kind == R.LEASES:
            for item in rec[1]:
                lease, t, f, p, qty, deadline = item[:6]
                self.leases[lease] = LeaseState((t, f, p), qty, deadline, lease_dims(item, 6))
                self._row((t, f, p))
        elif kind == R.DONE:
            for lease, code, answer, expires in rec[1]:
                self.done[lease] = (code, answer, expires)
        elif kind == R.WARM:
            if self._listed_in != self._segment:
                self._listed_in = self._segment
                self.listed.append([])
            self.listed[-1].extend((t, f, p) for t, f, p in rec[1])
        elif kind == R.CHECKPOINT_END:
            self.checkpoint = rec[1]
        elif kind == R.SEGMENT:
            self._segment = rec[3]
            self._mode = rec[6] if len(rec) > 6 else None
        elif kind != R.NOOP and kind != R.SYNCED:
            raise ValueError(f"unknown record type {kind!r}")

    def _gauge(self, key: Key, kind: str, reading: Reading) -> None:
        held = self.gauges.get(key)
        if held is None or reading_wins(kind, reading, held[1]):
            self.gauges[key] = (kind, reading)

    def _row(self, key: Key) -> RowState:
        """The state of ``key`` (a zero one if none yet), now named by the current record."""
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = RowState()
        row.named = self.records
        return row

    def _track(self, rec: list[Any], at: int) -> None:
        t, f, p, qty = rec[at : at + 4]
        self._row((t, f, p)).pending += qty
        if len(rec) > at + 4:
            rid, fp, answer, expires = rec[at + 4 : at + 8]
            counted: Counted | None = None
            if at == 1:  # a TRACK_ID record: its one key (then the credits it spent)
                spent = spent_from_log(rec[9] if len(rec) > 9 else UNSAID)
                counted = (qty, ((t, f, p),), False, spent, None)
            elif len(rec) > at + 8:  # an item that names the other keys it counted on
                others = tuple((t2, f2, p2) for t2, f2, p2 in rec[at + 8])
                spent = spent_from_log(rec[at + 9] if len(rec) > at + 9 else UNSAID)
                counted = (qty, ((t, f, p), *others), False, spent, None)
            # (an item an older build wrote, without them: not known, so never voided)
            self._id(rid, (fp, answer, expires), counted)

    def _id(self, rid: str, entry: IdEntry, counted: Counted | None = None) -> None:
        """Remember ``rid`` as the record says, with what its call counted if it did (an
        id reused after its window, by a call that counts nothing, drops the old one)."""
        self.ids[rid] = entry
        if counted is None:
            self.effects.pop(rid, None)
        else:
            self.effects[rid] = counted

    def inflight_takes(self) -> dict[Key, int]:
        """The counted takes still in flight after the replay (their keys' delta not known
        stored), by key: their sequence."""
        return {
            key: seq
            for key, seq in self.counted.items()
            if (row := self.rows.get(key)) is not None and row.seq == seq and row.inflight
        }

    def warm_keys(self) -> list[Key]:
        """The keys a restart should read ahead, most recent first, each once: every key the
        replayed records name (the last named first), then those the checkpoints listed as
        warm (the newest checkpoint's first, each in its order)."""
        rows = self.rows
        # Newest first; keys named by one record keep their order (the sort is stable).
        out = sorted(rows, key=lambda k: rows[k].named, reverse=True)
        done: set[Key] = set()
        for run in reversed(self.listed):
            for key in run:
                if key not in rows and key not in done:
                    done.add(key)
                    out.append(key)
        return out

    def unstored(self) -> dict[Key, RowState]:
        """Keys holding units the store may not have (in flight or pending)."""
        return {k: r for k, r in self.rows.items() if r.seq or r.pending}

    def live_ids(self, now: float) -> dict[str, IdEntry]:
        """Request ids whose window has not ended at ``now``."""
        return {k: v for k, v in self.ids.items() if v[2] > now}

    def live_done(self, now: float) -> dict[str, IdEntry]:
        """Finished reservations still remembered at ``now``."""
        return {k: v for k, v in self.done.items() if v[2] > now}


def lease_dims(rec: list[Any], at: int) -> tuple[str, ...]:
    """A reservation's dimension counters, kept at ``rec[at]`` if there (older records: none)."""
    return tuple(rec[at]) if len(rec) > at and rec[at] else ()
