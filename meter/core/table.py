"""The counter table: every warm counter of this node, in memory. Pure: no I/O, no asyncio.

One row per key. A row keeps the parts of its value apart, so no operation can lose or double
a unit by mixing them up::

    value = base + inflight + pending_flush + reserved + remote

``base``
    the stored total as of the stored snapshot this row was last re-based on; that snapshot's
    per-node flush sequences are kept with it (this node's as ``own_applied``, the peers' in
    ``peer_seqs``).
``inflight``
    this node's delta taken for flushing under sequence ``own_seq`` and not yet known to be
    applied. It is retried unchanged (same sequence, same amount) until the storage answers.
``pending_flush``
    this node's units added since the last flush take; they will be written under
    ``own_seq + 1``.
``pending_gossip``
    this node's units added since the last gossip take, all tagged ``own_seq + 1``;
    ``sealed`` holds not-yet-gossiped units whose flush sequence is already fixed, until they
    are gossiped or that sequence is stored (then storage and announcements carry them).
``remote``
    deltas gossiped by peers, per peer and per the flush sequence they will be written under.
    A snapshot whose sequence for that peer has reached the tag contains them, so re-basing
    drops exactly those: the view neither double-counts nor dips.
``reserved``
    units held by unfinished reservations: in ``value``, never flushed or gossiped.

A key absent from the table is *cold*. A row is *unseeded* when it was created without a stored
snapshot (storage unreachable): its units are kept, but its value is unknown (``None``) and it
is not flushed until a snapshot arrives, because only the snapshot says which of this node's
sequences the store already holds.

Memory: a warm key costs its key tuple, one dict entry and one small :class:`Row` of eight
slots. Reservations, peers and sealed gossip, rare per key, live in an optional :class:`Ext`;
their sum is kept in ``Row.extra`` so the value needs no branch. The dirty and touched sets are
flag bits plus append-only lists compacted when read, not hash sets. The table stores the key
tuples it is given: the strings in them are shared between keys only if the caller shares them
(:class:`~meter.core.keycache.KeyCache` builds keys from one copy of each name and period).

Why one module: every operation on a row (count, take for flushing, re-base, apply gossip,
reserve, evict, restore) must hold the same lock and keep the same column invariant; split
across modules, a row's arithmetic would be written in several places that must agree.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Container, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from meter.core.keys import QTY_MAX, QTY_MIN, SHORT_MAX, SHORT_MIN, Key
from meter.core.missed import Heard, Missed
from meter.errors import InvalidArgument, LimitExceeded, Unavailable
from storage.base import Snapshot

# The hot paths' range checks test values against SHORT_MIN and SHORT_MAX, and _refusal
# decides exactly past them; try_incr writes them as literals.
assert (SHORT_MIN, SHORT_MAX) == (-4611686018427387904, 4611686018427387903)

Tagged = tuple[int, int]
"""``(flush sequence, delta)``: a delta and the sequence it is (or will be) flushed under."""

# Row.flags bits.
SEEDED = 1  # the stored base is known
INFLIGHT = 2  # ``inflight`` was taken under ``own_seq`` and is not known to be stored
GOSSIP_OPEN = 4  # units tagged ``own_seq + 1`` were gossiped: that sequence must be written
DIRTY = 8  # listed in the dirty list
TOUCHED = 16  # listed in the touched list
USED = 32  # used since the last eviction sweep


class Ext:
    """The parts of a row most keys never need: holds, peers' deltas, sealed gossip."""

    __slots__ = ("leases", "peer_seqs", "remote", "remote_total", "reserved", "sealed")

    def __init__(self) -> None:
        self.reserved = 0
        #: Open reservations on the row (a lease of 0 units holds nothing but pins the row).
        self.leases = 0
        self.peer_seqs: dict[str, int] | None = None
        self.remote: dict[str, dict[int, int]] | None = None
        self.remote_total = 0
        self.sealed: list[Tagged] | None = None

    def empty(self) -> bool:
        return (
            self.reserved == 0
            and self.leases == 0
            and self.peer_seqs is None
            and self.remote is None
            and self.remote_total == 0
            and self.sealed is None
        )


class Row:
    """One counter's columns. Mutated only under the table's lock.

    ``value = base + inflight + pending_flush + extra`` where ``extra`` is
    ``ext.reserved + ext.remote_total`` (0 without ``ext``).
    """

    __slots__ = ("base", "ext", "extra", "flags", "inflight", "own_seq", "pending_flush",
                 "pending_gossip")  # fmt: skip

    def __init__(self) -> None:
        self.base = 0
        self.flags = USED
        self.own_seq = 0
        self.inflight = 0
        self.pending_flush = 0
        self.pending_gossip = 0
        self.extra = 0
        self.ext: Ext | None = None

    def value(self) -> int:
        return self.base + self.inflight + self.pending_flush + self.extra

    @property
    def seeded(self) -> bool:
        return bool(self.flags & SEEDED)

    @property
    def inflight_seq(self) -> int:
        """The sequence of the delta in flight, 0 if none."""
        return self.own_seq if self.flags & INFLIGHT else 0

    @property
    def own_applied(self) -> int:
        """This node's sequence in the snapshot ``base`` comes from.

        Sequences advance one at a time, each only after the previous one is known stored, so
        the snapshot holds ``own_seq`` unless that is still in flight.
        """
        return self.own_seq - 1 if self.flags & INFLIGHT else self.own_seq

    def x(self) -> Ext:
        """The row's :class:`Ext`, created on first need."""
        ext = self.ext
        if ext is None:
            ext = self.ext = Ext()
        return ext

    def tidy(self) -> None:
        """Drop an :class:`Ext` that holds nothing any more."""
        if self.ext is not None and self.ext.empty():
            self.ext = None

    def idle(self) -> bool:
        return (
            self.flags & (SEEDED | INFLIGHT | GOSSIP_OPEN) == SEEDED
            and self.pending_flush == 0
            and self.pending_gossip == 0
            and (self.ext is None or (self.ext.leases == 0 and not self.ext.remote
                                      and not self.ext.sealed))
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class TableStats:
    """Counts for ``status``."""

    warm: int
    dirty: int
    touched: int
    unseeded: int
    inflight: int
    reserved_keys: int


class CounterTable:
    """All warm counters of one node, guarded by one lock.

    ``node`` is this node's stable id: the name its flush sequences are stored under. With
    ``gossip=False`` (a node alone) no gossip column is kept: nobody would take it.

    Why one class: its methods are the only writers of one dict of rows under one lock, each
    a step of the same state machine (docs/correctness.md, C and G ids); the property tests
    drive them together, and a second class would need the same lock and rows.
    """

    def __init__(self, node: str, *, gossip: bool = True) -> None:
        self.node = node
        self.gossip = gossip
        self._lock = threading.Lock()
        self._rows: dict[Key, Row] = {}
        self._by_period: dict[tuple[str, str], list[str]] = {}
        #: (account, period) -> its direct children (``acme/alice``) with a row in the period,
        #: sorted (a page of them is one bisection).
        self._below: dict[tuple[str, str], list[str]] = {}
        self._dirty: list[Key] = []
        self._touched: list[Key] = []
        self._unseeded: set[Key] = set()
        #: Peers' deltas to dimension counters of listed features held cold here.
        self.missed = Missed()
        #: The freshness epoch of seeding reads (see :meth:`seed`): bumped by every eviction
        #: pass that drops keys (a read issued before one may be older than a flush of a key
        #: that was warm meanwhile) and by :meth:`refuse_earlier_reads` (the node (re)gained
        #: its id: a read issued before may be older than the last holder's writes).
        self.epoch = 0

    # -- reads ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._rows)

    def is_warm(self, key: Key) -> bool:
        """Whether ``key`` has a row (seeded or not)."""
        return key in self._rows

    def is_seeded(self, key: Key) -> bool:
        """Whether ``key`` has a row whose stored base is known."""
        row = self._rows.get(key)
        return row is not None and row.flags & SEEDED != 0

    def value(self, key: Key) -> int | None:
        """This node's view of the cluster-wide total; ``None`` if cold or unseeded."""
        with self._lock:
            row = self._rows.get(key)
            if row is None or not row.flags & SEEDED:
                return None
            row.flags |= USED
            return row.base + row.inflight + row.pending_flush + row.extra

    def inflight_seq(self, key: Key) -> int:
        """The sequence of ``key``'s delta in flight, 0 if none (or the key is cold)."""
        with self._lock:
            row = self._rows.get(key)
            return 0 if row is None else row.inflight_seq

    def pending(self, key: Key) -> int:
        """This node's units for ``key`` not yet known to be stored (in flight + pending)."""
        with self._lock:
            row = self._rows.get(key)
            return row.inflight + row.pending_flush if row is not None else 0

    def pending_units(self, keys: Iterable[Key]) -> int:
        """:meth:`pending` summed over ``keys``, under one lock (``status`` sums a backlog of
        every warm key: one lock each made it tens of ms at 100,000 keys)."""
        total = 0
        with self._lock:
            rows = self._rows
            for key in keys:
                row = rows.get(key)
                if row is not None:
                    total += row.inflight + row.pending_flush
        return total

    def unflushed(self, exclude: Container[Key]) -> list[tuple[Key, int]]:
        """Keys holding units storage does not have, each once (dirty keys, and unseeded ones
        with units that are not dirty), but those in ``exclude``, each with those units. One
        walk under one lock (``status`` and the metrics read it at 100,000s of keys)."""
        with self._lock:
            rows = self._rows
            self._dirty = _compact(self._dirty, rows, DIRTY)
            out: list[tuple[Key, int]] = []
            for key in self._dirty:
                if key not in exclude:
                    row = rows[key]
                    out.append((key, row.inflight + row.pending_flush))
            for key in self._unseeded:
                cold = rows.get(key)
                # (An unseeded key is usually dirty too: counted above, not twice.)
                if cold is None or cold.flags & DIRTY or key in exclude:
                    continue
                n = cold.inflight + cold.pending_flush
                if n:
                    out.append((key, n))
            return out

    def columns(self, key: Key) -> dict[str, int] | None:
        """Every column of a row, for diagnostics and tests."""
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                return None
            ext = row.ext or Ext()
            gossip = row.pending_gossip + sum(d for _, d in ext.sealed or ())
            return {
                "value": row.value(),
                "base": row.base,
                "seeded": int(row.seeded),
                "own_seq": row.own_seq,
                "own_applied": row.own_applied,
                "inflight": row.inflight,
                "inflight_seq": row.inflight_seq,
                "pending_flush": row.pending_flush,
                "pending_gossip": gossip,
                "sealed": len(ext.sealed or ()),
                "remote": ext.remote_total,
                "reserved": ext.reserved,
            }

    def all_for(
        self, tenant: str, period: str, *, use: bool | AbstractSet[str] = False
    ) -> dict[str, int]:
        """Feature -> value for every warm, seeded counter of ``tenant`` in ``period``;
        ``use`` marks them used, as a call would (a watched counter is not evicted): all of
        them (``True``) or those of the features it holds."""
        every = use is True
        named: AbstractSet[str] = frozenset() if isinstance(use, bool) else use
        with self._lock:
            out: dict[str, int] = {}
            for feature in self._by_period.get((tenant, period), ()):
                row = self._rows[(tenant, feature, period)]
                if row.flags & SEEDED:
                    out[feature] = row.value()
                    if every or feature in named:
                        row.flags |= USED
            return out

    def children_of(
        self, parent: str, feature: str, period: str, after: str | None, upto: str | None, n: int
    ) -> list[tuple[str, int | None]]:
        """``(tenant, value)`` of warm counters of ``feature`` in ``period`` of ``parent``'s
        direct children after ``after`` up to ``upto`` (``None``: no bound), in tenant order,
        until ``n`` of them are unseeded (``None``) or not 0; each marked used, as by a read."""
        with self._lock:
            out: list[tuple[str, int | None]] = []
            below = self._below.get((parent, period), [])
            start = 0 if after is None else bisect.bisect_right(below, after)
            end = len(below) if upto is None else bisect.bisect_right(below, upto)
            counted = 0
            for i in range(start, end):  # (no copy of a long list)
                child = below[i]
                row = self._rows.get((child, feature, period))
                if row is not None:
                    row.flags |= USED
                    value = row.value() if row.flags & SEEDED else None
                    out.append((child, value))
                    counted += value != 0
                    if counted == n:
                        break
            return out

    def unseeded_features(self, tenant: str, period: str) -> list[str]:
        """The features of ``tenant``'s unseeded counters in ``period``."""
        with self._lock:
            return [
                f
                for f in self._by_period.get((tenant, period), ())
                if not self._rows[(tenant, f, period)].flags & SEEDED
            ]

    def dirty_keys(self) -> list[Key]:
        """Keys with units to flush (pending or in flight)."""
        with self._lock:
            self._dirty = _compact(self._dirty, self._rows, DIRTY)
            return list(self._dirty)

    def touched_keys(self) -> list[Key]:
        """Keys with units to gossip."""
        with self._lock:
            self._touched = _compact(self._touched, self._rows, TOUCHED)
            return list(self._touched)

    def unseeded_keys(self) -> list[Key]:
        """Keys whose stored base is not known yet."""
        with self._lock:
            return list(self._unseeded)

    def stats(self) -> TableStats:
        """Counts of warm, dirty, touched, unseeded, in-flight and reserved keys."""
        with self._lock:
            rows = self._rows.values()
            self._dirty = _compact(self._dirty, self._rows, DIRTY)
            self._touched = _compact(self._touched, self._rows, TOUCHED)
            return TableStats(
                warm=len(self._rows),
                dirty=len(self._dirty),
                touched=len(self._touched),
                unseeded=len(self._unseeded),
                inflight=sum(1 for r in rows if r.flags & INFLIGHT),
                reserved_keys=sum(1 for r in rows if r.ext is not None and r.ext.leases),
            )

    # -- local mutations ---------------------------------------------------------------------

    def _row(self, key: Key) -> Row:
        row = self._rows.get(key)
        if row is None:
            row = Row()
            self._rows[key] = row
            self._unseeded.add(key)
            tenant, feature, period = key
            features = self._by_period.get((tenant, period))
            if features is None:
                self._by_period[(tenant, period)] = [feature]
                _list_below(self._below, tenant, period, True)
            else:
                features.append(feature)
        else:
            row.flags |= USED
        return row

    def _mark(self, key: Key, row: Row) -> None:
        """Put ``key`` on the dirty list, and on the touched list if gossip is kept."""
        flags = row.flags
        if not flags & DIRTY:
            self._dirty.append(key)
        if self.gossip and not flags & TOUCHED:
            self._touched.append(key)
            flags |= TOUCHED
        row.flags = flags | DIRTY

    def seed(self, key: Key, snap: Snapshot, epoch: int | None = None) -> bool:
        """Give a cold or unseeded key its stored snapshot. Warm seeded keys are left alone.

        ``snap`` must come from a read issued while the key was cold or unseeded (then it holds
        every sequence this node ever stored for the key: nothing is flushed before seeding).
        The key may have been seeded, flushed and evicted while the read was on its way, or
        the read issued while another process still wrote under this node's id, so a caller
        that cannot rule that out passes :attr:`epoch` as it was when the read was issued:
        after any eviction pass or claim of the id since, the snapshot is refused (``False``:
        read again).
        """
        with self._lock:
            row = self._rows.get(key)
            if row is not None and row.flags & SEEDED:
                row.flags |= USED
                return False
            if epoch is not None and epoch != self.epoch:
                return False
            row = self._row(key)
            self._rebase_row(row, snap)
            self._unseeded.discard(key)
            if (
                row.pending_flush
                or row.flags & INFLIGHT
                or (row.ext is not None and row.ext.sealed)  # restored gossip to send
            ):
                self._mark(key, row)
            return True

    def seed_many(self, snaps: Iterable[tuple[Key, Snapshot]], epoch: int) -> tuple[int, list[Key]]:
        """:meth:`seed` for a batch read issued when :attr:`epoch` was ``epoch``, under one
        lock hold. Returns how many keys it seeded, and the keys it refused because an
        eviction pass or a claim of the id came since (read them again). Keys seeded already
        are left alone, as :meth:`seed` does."""
        with self._lock:
            rows = self._rows
            if epoch != self.epoch:
                refused = []
                for key, _ in snaps:
                    row = rows.get(key)
                    if row is None or not row.flags & SEEDED:
                        refused.append(key)
                return 0, refused
            seeded = 0
            node = self.node
            by_period = self._by_period
            for key, snap in snaps:
                row = rows.get(key)
                if row is not None:
                    if row.flags & SEEDED:
                        row.flags |= USED
                        continue
                    # Unseeded (counted while storage was down, or restored): the general way.
                    seeded += 1
                    self._rebase_row(row, snap)
                    self._unseeded.discard(key)
                    if row.pending_flush or row.flags & INFLIGHT or (row.ext and row.ext.sealed):
                        self._mark(key, row)
                    continue
                # A cold key: a new row with nothing of its own yet, straight from the snapshot.
                row = Row()
                row.base = snap.total
                seqs = snap.seqs
                if seqs:
                    peers = dict(seqs)
                    row.own_seq = peers.pop(node, 0)
                    if peers:
                        row.ext = ext = Ext()
                        ext.peer_seqs = peers
                row.flags = SEEDED | USED
                rows[key] = row  # (only once built: a bad snapshot leaves no half row)
                seeded += 1
                tenant, feature, period = key
                features = by_period.get((tenant, period))
                if features is None:
                    by_period[(tenant, period)] = [feature]
                    _list_below(self._below, tenant, period, True)
                else:
                    features.append(feature)
            return seeded, []

    def incr(self, key: Key, qty: int, *, check: bool = True) -> int | None:
        """Count ``qty`` units; return the new value, or ``None`` if the key is unseeded.

        A cold key gets an unseeded row: the units are kept whatever the store's state.
        Raises :class:`InvalidArgument` (nothing counted) if the count would leave the signed
        64-bit range (see :func:`_refusal`); ``check=False`` (taking back a count whose log
        write failed) skips that.
        """
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                row = self._row(key)
            pending = row.pending_flush + qty
            flags = row.flags
            value: int | None = None
            if flags & SEEDED:
                value = row.base + row.inflight + pending + row.extra
                if check and (  # the range check, as in try_incr
                    (
                        value > 9223372036854775807
                        or pending > 9223372036854775807
                        or value < -9223372036854775808
                    )
                    if qty >= 0
                    else (
                        value < -9223372036854775808
                        or pending < -9223372036854775808
                        or value > 9223372036854775807
                        or row.ext is not None
                    )
                ):
                    err = _refusal(key, row, qty)
                    if err is not None:
                        raise err
            elif check and not -9223372036854775808 <= pending <= 9223372036854775807:
                err = _refusal(key, row, qty)
                if err is not None:
                    raise err
            row.pending_flush = pending
            if self.gossip:
                row.pending_gossip += qty
                if not flags & TOUCHED:
                    self._touched.append(key)
                    flags |= TOUCHED
            if not flags & DIRTY:
                self._dirty.append(key)
            row.flags = flags | DIRTY | USED
            return value

    def try_incr(self, key: Key, qty: int) -> int | None:
        """:meth:`incr` if ``key`` is seeded; else count nothing and return ``None``.

        The warm path of ``track``: one lookup decides and counts. Raises
        :class:`InvalidArgument` (nothing counted) as :meth:`incr` does.
        """
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                return None
            flags = row.flags
            if not flags & SEEDED:
                return None
            pending = row.pending_flush + qty
            value = row.base + row.inflight + pending + row.extra
            # The range check (see _refusal), split on the sign of qty to save compares: units
            # added can only pass the top (or fail to bring a value back from the bottom), and
            # only units taken away need the held units. Against SHORT_MAX and SHORT_MIN, as
            # literals: past them _refusal decides exactly (see SHORT_MAX).
            if (
                (
                    value > 4611686018427387903
                    or pending > 4611686018427387903
                    or value < -4611686018427387904
                )
                if qty >= 0
                else (
                    value < -4611686018427387904
                    or pending < -4611686018427387904
                    or value > 4611686018427387903
                    or row.ext is not None
                )
            ):
                err = _refusal(key, row, qty)
                if err is not None:
                    raise err
            row.pending_flush = pending
            if self.gossip:
                row.pending_gossip += qty
                if not flags & TOUCHED:
                    self._touched.append(key)
                    flags |= TOUCHED
            if not flags & DIRTY:
                self._dirty.append(key)
            row.flags = flags | DIRTY | USED
            return value

    def incr_prefix(self, items: Sequence[tuple[Key, int]]) -> list[int]:
        """:meth:`try_incr` for the leading items whose keys are seeded, under one lock hold.

        Stops at the first cold or unseeded key, or the first item the range check refuses
        (counting nothing from it on), and returns the new values of the items counted, in
        order: the server's pipelined ``track`` batches.
        """
        with self._lock:
            return self._count_run(items)

    def incr_seeded(self, items: Sequence[tuple[Key, int]]) -> list[int] | None:
        """:meth:`incr` for every ``(key, qty)``, under one lock hold, if every key is seeded.

        Returns the new values in order. If any key is cold or unseeded nothing is counted and
        the answer is ``None``: the caller seeds first, so a batch is counted all or nothing
        (``track_many`` must never answer an error after counting part of a batch). Items the
        range check refuses are not counted and the others are: then :class:`PartlyRefused`
        is raised, carrying every item's answer (its new value, or its refusal).
        """
        with self._lock:
            rows = self._rows
            for key, _ in items:
                row = rows.get(key)
                if row is None or not row.flags & SEEDED:
                    return None
            out = self._count_run(items)
            if len(out) < len(items):
                raise PartlyRefused(self._count_refusing(items, out))
            return out

    def _count_refusing(
        self, items: Sequence[tuple[Key, int]], done: list[int]
    ) -> list[int | InvalidArgument]:
        """The rest of a seeded batch after ``_count_run`` stopped at a refused item: count
        each item the range check accepts, keep the refusals. The caller holds the lock."""
        out: list[int | InvalidArgument] = list(done)
        rows = self._rows
        for key, qty in items[len(done) :]:
            row = rows[key]
            err = _refusal(key, row, qty)
            if err is not None:
                out.append(err)
                continue
            self._mark(key, row)
            row.pending_flush += qty
            if self.gossip:
                row.pending_gossip += qty
            row.flags |= USED
            out.append(row.value())
        return out

    def _count_run(self, items: Sequence[tuple[Key, int]]) -> list[int]:
        """Count items up to the first cold or unseeded key, or the first item the range
        check refuses; the caller holds the lock."""
        out: list[int] = []
        rows = self._rows
        gossip = self.gossip
        lo, hi = SHORT_MIN, SHORT_MAX  # (past them _refusal decides exactly)
        for key, qty in items:
            row = rows.get(key)
            if row is None:
                break
            flags = row.flags
            if not flags & SEEDED:
                break
            pending = row.pending_flush + qty
            value = row.base + row.inflight + pending + row.extra
            if (  # the range check, as in try_incr
                (value > hi or pending > hi or value < lo)
                if qty >= 0
                else (value < lo or pending < lo or value > hi or row.ext is not None)
            ) and _refusal(key, row, qty) is not None:
                break
            row.pending_flush = pending
            if gossip:
                row.pending_gossip += qty
                if not flags & TOUCHED:
                    self._touched.append(key)
                    flags |= TOUCHED
            if not flags & DIRTY:
                self._dirty.append(key)
            row.flags = flags | DIRTY | USED
            out.append(value)  # (not a local alias: compiled, this is a direct list append)
        return out

    def reserve(self, key: Key, qty: int, limit: int | None, *, check: bool = True) -> int | None:
        """Hold ``qty`` units against ``limit``; return the value including them.

        Raises :class:`LimitExceeded` (nothing held) if the value would pass ``limit``, and
        :class:`Unavailable` if a limit is given but the key's total is unknown.
        :class:`InvalidArgument` (nothing held) if the value would leave the signed 64-bit
        range; ``check=False`` (putting back a hold whose release was undone, recovery) skips
        that.
        """
        with self._lock:
            row = self._row(key)
            if limit is not None:
                if not row.flags & SEEDED:
                    raise Unavailable("the counter's stored total is unknown; cannot check limit")
                current = row.value()
                if current + qty > limit:
                    raise LimitExceeded(
                        f"{key[0]}/{key[1]}: {current} + {qty} would exceed the limit {limit}"
                    )
            if check and row.flags & SEEDED and row.value() + qty > QTY_MAX:
                raise _out_of_range(key, "the total with its reserved units", row.value() + qty)
            ext = row.x()
            ext.reserved += qty
            ext.leases += 1
            row.extra += qty
            return row.value() if row.flags & SEEDED else None

    def commit(self, key: Key, reserved: int, actual: int) -> int | None:
        """Turn a reservation of ``reserved`` units into ``actual`` units of usage.

        Raises :class:`InvalidArgument` (nothing changed: the reservation still holds) if the
        value or this node's unstored units would pass the signed 64-bit range.
        """
        with self._lock:
            row = self._row(key)
            if row.pending_flush + actual > QTY_MAX:
                raise _out_of_range(
                    key, "this node's units not stored yet", row.pending_flush + actual
                )
            value = row.value() - reserved + actual
            if row.flags & SEEDED and not QTY_MIN <= value <= QTY_MAX:
                raise _out_of_range(key, "the total", value)
            ext = row.x()
            ext.reserved -= reserved
            ext.leases -= 1
            row.extra -= reserved
            row.tidy()
            row.pending_flush += actual
            if self.gossip:
                row.pending_gossip += actual
            self._mark(key, row)
            return row.value() if row.flags & SEEDED else None

    def release(self, key: Key, reserved: int) -> None:
        """Give back a reservation of ``reserved`` units."""
        with self._lock:
            row = self._row(key)
            ext = row.x()
            ext.reserved -= reserved
            ext.leases -= 1
            row.extra -= reserved
            row.tidy()

    def restore(self, key: Key, seq: int, inflight: int, pending: int) -> None:
        """Recovery: put back this node's units for ``key`` that the store may not hold.

        ``inflight`` was taken for flushing under ``seq`` (0: nothing in flight) and may or
        may not be stored; ``pending`` was counted after it. The row is unseeded: seeding
        (a fresh read) then says whether ``seq`` landed, and the flusher re-sends it unchanged
        if not. The units are gossiped again once seeded: peers forgot this node's earlier
        incarnation.
        """
        with self._lock:
            row = self._row(key)
            if row.flags & SEEDED:
                raise ValueError(f"restore of a seeded key {key!r}")
            if seq:
                row.own_seq = seq
                row.inflight = inflight
                row.flags |= INFLIGHT
                if self.gossip and inflight:
                    ext = row.x()
                    ext.sealed = [*(ext.sealed or ()), (seq, inflight)]
            row.pending_flush += pending
            if self.gossip:
                row.pending_gossip += pending
            self._mark(key, row)

    def unstored_keys(self) -> list[Key]:
        """Keys holding units of this node's that may not be stored (in flight or pending)."""
        with self._lock:
            return [k for k, r in self._rows.items() if r.flags & INFLIGHT or r.pending_flush]

    def unstored_state(self, keys: Iterable[Key]) -> list[tuple[Key, int, int, int]]:
        """``(key, seq in flight or 0, inflight, pending)`` of each key (zeros if cold)."""
        out: list[tuple[Key, int, int, int]] = []
        with self._lock:
            for key in keys:
                row = self._rows.get(key)
                if row is None:
                    out.append((key, 0, 0, 0))
                elif row.flags & INFLIGHT:
                    out.append((key, row.own_seq, row.inflight, row.pending_flush))
                else:
                    out.append((key, 0, 0, row.pending_flush))
        return out

    # -- takes (flusher and broadcaster) -----------------------------------------------------

    def take_flush(self, key: Key) -> Tagged | None:
        """The ``(seq, delta)`` to write for ``key`` next, or ``None`` if nothing to write.

        An unacknowledged take is returned again unchanged (retry under the same sequence);
        otherwise ``pending_flush`` moves in flight under the next sequence. The column is
        reduced by what was read, so units added concurrently stay pending.
        """
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                return None
            flags = row.flags
            if not flags & SEEDED:
                return None
            if flags & INFLIGHT:
                return (row.own_seq, row.inflight)
            if row.pending_flush == 0 and not flags & GOSSIP_OPEN:
                row.flags = flags & ~DIRTY
                return None
            row.own_seq += 1
            row.flags = (flags | INFLIGHT) & ~GOSSIP_OPEN
            row.inflight = row.pending_flush
            row.pending_flush -= row.inflight
            if row.pending_gossip:
                # These units now travel under a fixed sequence; seal them with it.
                ext = row.x()
                if ext.sealed is None:
                    ext.sealed = []
                ext.sealed.append((row.own_seq, row.pending_gossip))
                row.pending_gossip = 0
            return (row.own_seq, row.inflight)

    def take_gossip(self, key: Key) -> list[Tagged]:
        """This node's not-yet-gossiped units for ``key``, each tagged with its flush sequence."""
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                return []
            row.flags &= ~TOUCHED
            if not row.flags & SEEDED:
                # Its flush sequence is unknown until seeded; seed() marks it touched again.
                return []
            out: list[Tagged] = []
            if row.ext is not None and row.ext.sealed is not None:
                out = row.ext.sealed
                row.ext.sealed = None
                row.tidy()
            if row.pending_gossip:
                out.append((row.own_seq + 1, row.pending_gossip))
                row.pending_gossip = 0
                row.flags |= GOSSIP_OPEN
            return out

    def take_gossip_all(self) -> list[tuple[str, str, str, int, int]]:
        """:meth:`take_gossip` of every touched key under one lock, as ``(tenant, feature,
        period, seq, delta)`` items (zero deltas left out), in the order keys were touched."""
        out: list[tuple[str, str, str, int, int]] = []
        append = out.append
        with self._lock:
            rows = self._rows
            touched, self._touched = self._touched, []
            for key in touched:
                row = rows.get(key)
                if row is None or not row.flags & TOUCHED:
                    continue  # evicted, or listed twice
                row.flags &= ~TOUCHED
                if not row.flags & SEEDED:
                    continue  # as in take_gossip: seed() marks it touched again
                t, f, p = key
                ext = row.ext
                if ext is not None and ext.sealed is not None:
                    for seq, delta in ext.sealed:
                        if delta:
                            append((t, f, p, seq, delta))
                    ext.sealed = None
                    row.tidy()
                if row.pending_gossip:
                    append((t, f, p, row.own_seq + 1, row.pending_gossip))
                    row.pending_gossip = 0
                    row.flags |= GOSSIP_OPEN
        return out

    def flush_failed(self, key: Key) -> None:
        """Keep ``key`` dirty after a failed write, so the in-flight delta is retried."""
        with self._lock:
            row = self._rows.get(key)
            if row is not None and not row.flags & DIRTY:
                self._dirty.append(key)
                row.flags |= DIRTY

    # -- authoritative totals and peers ------------------------------------------------------

    def rebase(self, key: Key, snap: Snapshot, source: str = "flush") -> bool:
        """Re-base ``key`` on a stored snapshot (``source``: ``flush``/``gossip``/``read``).

        Applied only if the snapshot is at least as new as the row's (its per-node sequences
        all at least the row's), so a late, older answer never moves the view backwards. If the
        snapshot holds this node's in-flight sequence, the in-flight delta is done. Remote
        deltas the snapshot contains are dropped. Cold and unseeded keys are skipped (returns
        ``False``): only :meth:`seed`, with a fresh read, may seed a row, because a stale
        snapshot could carry an old sequence of ours and the next flush would reuse it.
        """
        return self.rebase_moved(key, snap, source) is not None

    def rebase_moved(self, key: Key, snap: Snapshot, source: str = "flush") -> int | None:
        """:meth:`rebase`, answering how far it moved the view (``None``: not applied), so
        a peer's announcement or a resync that moves a view is heard like a delta."""
        del source  # every source is handled alike: the sequences say what the total holds
        with self._lock:
            row = self._rows.get(key)
            if row is None or not row.flags & SEEDED:
                if row is None and self.missed.features:
                    self.missed.note(key, snap)
                return None
            if not _covers(snap, self.node, row):
                return None
            before = row.base + row.inflight + row.pending_flush + row.extra
            self._rebase_row(row, snap)
            if row.pending_flush == 0 and not row.flags & (INFLIGHT | GOSSIP_OPEN):
                row.flags &= ~DIRTY
            return row.base + row.inflight + row.pending_flush + row.extra - before

    def based_on(self, key: Key) -> Snapshot | None:
        """The stored snapshot a seeded row is based on (its base and the per-node sequences
        it holds), or ``None`` if the key is cold or unseeded."""
        with self._lock:
            row = self._rows.get(key)
            if row is None or not row.flags & SEEDED:
                return None
            seqs = dict(row.ext.peer_seqs or {}) if row.ext is not None else {}
            seqs[self.node] = row.own_applied
            return Snapshot(row.base, seqs)

    def reseed(self, key: Key, snap: Snapshot) -> bool:
        """Re-base a seeded row on ``snap`` even though it is older than the row's snapshot.

        For a stored item that went back (expired by TTL and made again by a write, or a
        restored table): the peers' sequences and the total in ``snap`` are now the truth. This
        node's in-flight delta is done if ``snap`` holds its sequence. Returns ``False`` if the
        key is cold or unseeded.
        """
        with self._lock:
            row = self._rows.get(key)
            if row is None or not row.flags & SEEDED:
                return False
            self._rebase_row(row, snap)
            if row.pending_flush == 0 and not row.flags & (INFLIGHT | GOSSIP_OPEN):
                row.flags &= ~DIRTY
            return True

    def _rebase_row(self, row: Row, snap: Snapshot) -> None:
        own = snap.seq_of(self.node)
        row.base = snap.total
        if row.flags & INFLIGHT and own >= row.own_seq:
            row.inflight = 0
            row.flags &= ~INFLIGHT
        if own > row.own_seq:
            # The store knows later sequences of ours than we do (we restarted): continue
            # after them. Nothing can be in flight or gossiped yet, the row was unseeded.
            row.own_seq = own
        row.flags |= SEEDED
        peers = {n: s for n, s in snap.seqs.items() if n != self.node} or None
        ext = row.ext
        if peers is not None:
            ext = row.x()
        if ext is None:
            return
        ext.peer_seqs = peers
        sealed = ext.sealed
        if sealed and sealed[0][0] <= row.own_applied:
            # Gossip sealed under a sequence the store now holds: every snapshot a peer can be
            # announced or read has these units, so there is nothing left to tell. Kept, they
            # would pile up one entry per flush while the bus is down (and pin the row).
            applied = row.own_applied
            ext.sealed = [t for t in sealed if t[0] > applied] or None
        if ext.remote:
            upto = peers or {}
            for peer in list(ext.remote):
                by_seq = ext.remote[peer]
                limit = upto.get(peer, 0)
                for seq in [s for s in by_seq if s <= limit]:
                    units = by_seq.pop(seq)
                    ext.remote_total -= units
                    row.extra -= units
                if not by_seq:
                    del ext.remote[peer]
            if not ext.remote:
                ext.remote = None
        row.tidy()

    def apply_remote(self, key: Key, peer: str, seq: int, delta: int) -> bool:
        """Add a peer's gossiped ``delta``, tagged with the flush ``seq`` it goes under.

        Skipped (``False``) for cold or unseeded keys (they seed from the store, which has
        every flushed delta), for our own id, and when the row's snapshot already holds it.
        """
        with self._lock:
            row = self._rows.get(key)
            if row is None or not row.flags & SEEDED or peer == self.node:
                if row is None and self.missed.features:
                    self.missed.note(key, (peer, seq, delta))
                return False
            ext = row.x()
            if ext.peer_seqs is not None and ext.peer_seqs.get(peer, 0) >= seq:
                row.tidy()
                return False
            if ext.remote is None:
                ext.remote = {}
            by_seq = ext.remote.setdefault(peer, {})
            by_seq[seq] = by_seq.get(seq, 0) + delta
            ext.remote_total += delta
            row.extra += delta
            return True

    def apply_remote_many(self, peer: str, items: Iterable[tuple[str, str, str, int, int]]) -> int:
        """:meth:`apply_remote` of ``(tenant, feature, period, seq, delta)`` items of one
        ``peer`` under one lock; return how many were applied."""
        if peer == self.node:
            return 0
        applied = 0
        with self._lock:
            rows = self._rows
            listed = bool(self.missed.features)
            for t, f, p, seq, delta in items:
                row = rows.get((t, f, p))
                if row is None or not row.flags & SEEDED:
                    if row is None and listed:
                        self.missed.note((t, f, p), (peer, seq, delta))
                    continue
                ext = row.ext
                if ext is None:
                    ext = row.ext = Ext()
                elif ext.peer_seqs is not None and ext.peer_seqs.get(peer, 0) >= seq:
                    continue
                remote = ext.remote
                if remote is None:
                    remote = ext.remote = {}
                by_seq = remote.get(peer)
                if by_seq is None:
                    by_seq = remote[peer] = {}
                by_seq[seq] = by_seq.get(seq, 0) + delta
                ext.remote_total += delta
                row.extra += delta
                applied += 1
        return applied

    def take_missed(self) -> dict[Key, list[Heard]]:
        """What :attr:`missed` holds (by key), forgotten."""
        with self._lock:
            return self.missed.take()

    def forget_peer(self, peer: str) -> int:
        """Drop every remote delta of ``peer``; return the units dropped.

        For a peer that died: what it gossiped but never flushed will never reach the store
        under those sequences, so keeping it would hold views above the truth for good.
        """
        with self._lock:
            dropped = 0
            for row in self._rows.values():
                ext = row.ext
                if ext is not None and ext.remote and peer in ext.remote:
                    units = sum(ext.remote.pop(peer).values())
                    ext.remote_total -= units
                    row.extra -= units
                    dropped += units
                    if not ext.remote:
                        ext.remote = None
                    row.tidy()
            return dropped

    # -- housekeeping ------------------------------------------------------------------------

    def refuse_earlier_reads(self) -> None:
        """Refuse every seeding read issued before now (:meth:`seed`, :meth:`seed_many`): the
        node has just (re)gained its id, and another process may have written under it since
        they were issued. Their keys are read again."""
        with self._lock:
            self.epoch += 1

    def evict_idle(self) -> int:
        """Drop clean keys not used since the previous call; return how many were dropped.

        Called periodically: a key survives one full interval after its last use. Keys with
        anything pending, in flight or from peers, or an open reservation (even of 0 units),
        are never dropped.
        """
        with self._lock:
            doomed: list[Key] = []
            for key, row in self._rows.items():
                if row.flags & USED:
                    row.flags &= ~USED
                elif row.idle():
                    doomed.append(key)
            if not doomed:
                return 0
            self.epoch += 1
            self.missed.stop_noting()  # (every listing is out of date: listed again)
            affected: set[tuple[str, str]] = set()
            for key in doomed:
                # A dirty or touched mark left by incr(key, 0) goes with the row: the lists
                # are compacted against the rows when read.
                del self._rows[key]
                affected.add((key[0], key[2]))
            for tenant, period in affected:
                features = [
                    f for f in self._by_period[(tenant, period)]
                    if (tenant, f, period) in self._rows
                ]  # fmt: skip
                if features:
                    self._by_period[(tenant, period)] = features
                else:
                    del self._by_period[(tenant, period)]
                    _list_below(self._below, tenant, period, False)
            return len(doomed)

    def keys(self) -> list[Key]:
        """A snapshot of every warm key, in the order they were loaded."""
        with self._lock:
            return list(self._rows)

    def recently_used(self, keys: Iterable[Key]) -> list[bool | None]:
        """For each key: whether it was used since the last eviction pass (``None``: cold)."""
        out: list[bool | None] = []
        with self._lock:
            rows = self._rows
            for key in keys:
                row = rows.get(key)
                out.append(None if row is None else bool(row.flags & USED))
        return out


class PartlyRefused(Exception):
    """:meth:`CounterTable.incr_seeded` counted a batch except the items the range check
    refused. ``answers`` has one entry per item: its new value, or its refusal."""

    def __init__(self, answers: list[int | InvalidArgument]) -> None:
        super().__init__(f"{sum(isinstance(a, InvalidArgument) for a in answers)} items refused")
        self.answers = answers


def _list_below(
    below: dict[tuple[str, str], list[str]], tenant: str, period: str, listed: bool
) -> None:
    """``tenant`` has its first row in ``period`` (``listed``), or its last went: listed under
    its account, if any, or no longer."""
    cut = tenant.rfind("/")
    if cut <= 0:
        return
    children = below.setdefault((tenant[:cut], period), [])
    i = bisect.bisect_left(children, tenant)
    if listed:
        children.insert(i, tenant)
    elif i < len(children) and children[i] == tenant:
        del children[i]
    if not children:
        del below[(tenant[:cut], period)]


def _refusal(key: Key, row: Row, qty: int) -> InvalidArgument | None:
    """Why counting ``qty`` on ``row`` must be refused, or ``None`` if it may be counted.

    Every answer and every log record carries a counter's numbers as MessagePack integers,
    so they stay inside the signed 64-bit range: this node's units not stored yet (what the
    flusher writes and the log restates), and for a seeded row its value with its held units
    and, as holds can always be released, without them (units taken away can only lower the
    latter; held units are never negative). A value that left the range anyway (units counted
    while the total was unknown, peers' units, a stored total) only refuses the counts that
    would keep it outside.
    """
    pending = row.pending_flush + qty
    if not QTY_MIN <= pending <= QTY_MAX:
        return _out_of_range(key, "this node's units not stored yet", pending)
    if not row.flags & SEEDED:
        return None
    value = row.value() + qty
    if not QTY_MIN <= value <= QTY_MAX:
        return _out_of_range(key, "the total", value)
    if qty < 0 and row.ext is not None and value - row.ext.reserved < QTY_MIN:
        return _out_of_range(key, "the total without its reserved units", value - row.ext.reserved)
    return None


def _out_of_range(key: Key, what: str, value: int) -> InvalidArgument:
    return InvalidArgument(
        f"{key[0][:64]}/{key[1][:64]}: {what} would be {value}, outside the signed 64-bit range "
        f"{QTY_MIN}..{QTY_MAX}; nothing was counted"
    )


def _compact(listed: list[Key], rows: dict[Key, Row], bit: int) -> list[Key]:
    """The keys of ``listed`` whose row still carries ``bit``, each once, in order."""
    out: list[Key] = []
    seen: set[Key] = set()
    for key in listed:
        row = rows.get(key)
        if row is not None and row.flags & bit and key not in seen:
            seen.add(key)
            out.append(key)
    return out


def _covers(snap: Snapshot, node: str, row: Row) -> bool:
    """Whether ``snap`` is at least as new as the snapshot ``row`` was based on."""
    if snap.seq_of(node) < row.own_applied:
        return False
    peers = row.ext.peer_seqs if row.ext is not None else None
    if peers:
        for peer, seq in peers.items():
            if snap.seq_of(peer) < seq:
                return False
    return True
