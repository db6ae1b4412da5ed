"""The counter table: every warm counter of this node, in memory. Pure: no I/O, no asyncio.

One row per key. A row keeps the parts of its value apart, so no operation can lose or double
a unit by mixing them up::

    value = base + inflight + pending_flush + reserved + remote

``base``
    the stored total as of the stored snapshot this row was last re-based on; that snapshot's
    per-node flush sequences are kept with it (``own_applied`` and ``peer_seqs``).
``inflight``
    this node's delta taken for flushing under sequence ``inflight_seq`` and not yet known to be
    applied. It is retried unchanged (same sequence, same amount) until the storage answers.
``pending_flush``
    this node's units added since the last flush take; they will be written under
    ``own_seq + 1``.
``pending_gossip``
    this node's units added since the last gossip take, all tagged ``own_seq + 1``;
    ``sealed_gossip`` holds not-yet-gossiped units whose flush sequence is already fixed.
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
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from meter.errors import LimitExceeded, Unavailable
from meter.keys import Key
from storage.base import Snapshot

Tagged = tuple[int, int]
"""``(flush sequence, delta)``: a delta and the sequence it is (or will be) flushed under."""

PendingKind = Literal["flush", "gossip"]


class Row:
    """One counter's columns. Mutated only under the table's lock."""

    __slots__ = (
        "base",
        "gen",
        "gossip_open",
        "inflight",
        "inflight_seq",
        "own_applied",
        "own_seq",
        "peer_seqs",
        "pending_flush",
        "pending_gossip",
        "remote",
        "remote_total",
        "reserved",
        "sealed_gossip",
        "seeded",
    )

    def __init__(self, gen: int) -> None:
        self.base = 0
        self.seeded = False
        self.own_applied = 0
        self.peer_seqs: dict[str, int] | None = None
        self.own_seq = 0
        self.inflight = 0
        self.inflight_seq = 0  # 0: nothing in flight
        self.pending_flush = 0
        self.pending_gossip = 0
        self.sealed_gossip: list[Tagged] | None = None
        # True once units tagged ``own_seq + 1`` were gossiped: that sequence must then be
        # written, even with a net delta of zero, or peers would hold them in ``remote``
        # forever, waiting for a sequence that never reaches the store.
        self.gossip_open = False
        self.remote: dict[str, dict[int, int]] | None = None
        self.remote_total = 0
        self.reserved = 0
        self.gen = gen

    def value(self) -> int:
        return self.base + self.inflight + self.pending_flush + self.reserved + self.remote_total

    def idle(self) -> bool:
        return (
            self.seeded
            and self.inflight_seq == 0
            and self.pending_flush == 0
            and self.pending_gossip == 0
            and not self.sealed_gossip
            and not self.gossip_open
            and self.reserved == 0
            and not self.remote
        )


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

    ``node`` is this node's stable id: the name its flush sequences are stored under.
    """

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._rows: dict[Key, Row] = {}
        self._by_period: dict[tuple[str, str], set[str]] = {}
        self._dirty: set[Key] = set()
        self._touched: set[Key] = set()
        self._gen = 0
        #: Eviction passes that dropped keys. A seeding read issued before one may be older
        #: than a flush of a key that was warm meanwhile (see :meth:`seed`).
        self.evictions = 0

    # -- reads ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._rows)

    def is_warm(self, key: Key) -> bool:
        """Whether ``key`` has a row (seeded or not)."""
        return key in self._rows

    def is_seeded(self, key: Key) -> bool:
        """Whether ``key`` has a row whose stored base is known."""
        row = self._rows.get(key)
        return row is not None and row.seeded

    def value(self, key: Key) -> int | None:
        """This node's view of the cluster-wide total; ``None`` if cold or unseeded."""
        with self._lock:
            row = self._rows.get(key)
            if row is None or not row.seeded:
                return None
            row.gen = self._gen
            return row.value()

    def base(self, key: Key) -> int | None:
        """What this node believes the store holds for ``key`` (``None`` if unknown)."""
        with self._lock:
            row = self._rows.get(key)
            return row.base if row is not None and row.seeded else None

    def remote_since_rebase(self, key: Key) -> int:
        """Units of ``value`` that came from peers and are not in the base yet."""
        with self._lock:
            row = self._rows.get(key)
            return row.remote_total if row is not None else 0

    def pending(self, key: Key) -> int:
        """This node's units for ``key`` not yet known to be stored (in flight + pending)."""
        with self._lock:
            row = self._rows.get(key)
            return row.inflight + row.pending_flush if row is not None else 0

    def columns(self, key: Key) -> dict[str, int] | None:
        """Every column of a row, for diagnostics and tests."""
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                return None
            gossip = row.pending_gossip + sum(d for _, d in row.sealed_gossip or ())
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
                "remote": row.remote_total,
                "reserved": row.reserved,
            }

    def all_for(self, tenant: str, period: str) -> dict[str, int]:
        """Feature -> value for every warm, seeded counter of ``tenant`` in ``period``."""
        with self._lock:
            out: dict[str, int] = {}
            for feature in self._by_period.get((tenant, period), ()):
                row = self._rows[(tenant, feature, period)]
                if row.seeded:
                    out[feature] = row.value()
            return out

    def dirty_keys(self) -> list[Key]:
        """Keys with units to flush (pending or in flight)."""
        with self._lock:
            return list(self._dirty)

    def touched_keys(self) -> list[Key]:
        """Keys with units to gossip."""
        with self._lock:
            return list(self._touched)

    def unseeded_keys(self) -> list[Key]:
        """Keys whose stored base is not known yet."""
        with self._lock:
            return [k for k, r in self._rows.items() if not r.seeded]

    def stats(self) -> TableStats:
        """Counts of warm, dirty, touched, unseeded, in-flight and reserved keys."""
        with self._lock:
            rows = self._rows.values()
            return TableStats(
                warm=len(self._rows),
                dirty=len(self._dirty),
                touched=len(self._touched),
                unseeded=sum(1 for r in rows if not r.seeded),
                inflight=sum(1 for r in rows if r.inflight_seq),
                reserved_keys=sum(1 for r in rows if r.reserved),
            )

    # -- local mutations ---------------------------------------------------------------------

    def _row(self, key: Key) -> Row:
        row = self._rows.get(key)
        if row is None:
            row = Row(self._gen)
            self._rows[key] = row
            tenant, feature, period = key
            self._by_period.setdefault((tenant, period), set()).add(feature)
        else:
            row.gen = self._gen
        return row

    def seed(self, key: Key, snap: Snapshot, evictions: int | None = None) -> bool:
        """Give a cold or unseeded key its stored snapshot. Warm seeded keys are left alone.

        ``snap`` must come from a read issued while the key was cold or unseeded (then it holds
        every sequence this node ever stored for the key: nothing is flushed before seeding).
        The key may have been seeded, flushed and evicted while the read was on its way, so a
        caller that cannot rule that out passes :attr:`evictions` as it was when the read was
        issued: after any eviction since, the snapshot is refused (``False``: read again).
        """
        with self._lock:
            row = self._rows.get(key)
            if row is not None and row.seeded:
                row.gen = self._gen
                return False
            if evictions is not None and evictions != self.evictions:
                return False
            row = self._row(key)
            self._rebase_row(row, snap)
            if row.pending_flush or row.inflight_seq:
                self._dirty.add(key)
            if row.pending_gossip:
                self._touched.add(key)
            return True

    def incr(self, key: Key, qty: int) -> int | None:
        """Count ``qty`` units; return the new value, or ``None`` if the key is unseeded.

        A cold key gets an unseeded row: the units are kept whatever the store's state.
        """
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                row = self._row(key)
            else:
                row.gen = self._gen
            row.pending_flush += qty
            row.pending_gossip += qty
            self._dirty.add(key)
            self._touched.add(key)
            if row.seeded:  # row.value(), inlined: this is the hottest line of the node
                return row.base + row.inflight + row.pending_flush + row.reserved + row.remote_total
            return None

    def incr_seeded(self, items: Sequence[tuple[Key, int]]) -> list[int] | None:
        """:meth:`incr` for every ``(key, qty)``, under one lock hold, if every key is seeded.

        Returns the new values in order. If any key is cold or unseeded nothing is counted and
        the answer is ``None``: the caller seeds first, so a batch is counted all or nothing
        (``track_many`` must never answer an error after counting part of a batch).
        """
        with self._lock:
            rows, gen = self._rows, self._gen
            found: list[Row] = []
            for key, _ in items:
                row = rows.get(key)
                if row is None or not row.seeded:
                    return None
                found.append(row)
            out: list[int] = []
            append = out.append
            dirty, touched = self._dirty.add, self._touched.add
            for row, (key, qty) in zip(found, items, strict=True):
                row.gen = gen
                row.pending_flush += qty
                row.pending_gossip += qty
                dirty(key)
                touched(key)
                append(
                    row.base + row.inflight + row.pending_flush + row.reserved + row.remote_total
                )
        return out

    def reserve(self, key: Key, qty: int, limit: int | None) -> int | None:
        """Hold ``qty`` units against ``limit``; return the value including them.

        Raises :class:`LimitExceeded` (nothing held) if the value would pass ``limit``, and
        :class:`Unavailable` if a limit is given but the key's total is unknown.
        """
        with self._lock:
            row = self._row(key)
            if limit is not None:
                if not row.seeded:
                    raise Unavailable("the counter's stored total is unknown; cannot check limit")
                current = row.value()
                if current + qty > limit:
                    raise LimitExceeded(
                        f"{key[0]}/{key[1]}: {current} + {qty} would exceed the limit {limit}"
                    )
            row.reserved += qty
            return row.value() if row.seeded else None

    def commit(self, key: Key, reserved: int, actual: int) -> int | None:
        """Turn a reservation of ``reserved`` units into ``actual`` units of usage."""
        with self._lock:
            row = self._row(key)
            row.reserved -= reserved
            row.pending_flush += actual
            row.pending_gossip += actual
            self._dirty.add(key)
            self._touched.add(key)
            return row.value() if row.seeded else None

    def release(self, key: Key, reserved: int) -> None:
        """Give back a reservation of ``reserved`` units."""
        with self._lock:
            self._row(key).reserved -= reserved

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
                self._dirty.discard(key)
                return None
            if not row.seeded:
                return None
            if row.inflight_seq:
                return (row.inflight_seq, row.inflight)
            if row.pending_flush == 0 and not row.gossip_open:
                self._dirty.discard(key)
                return None
            row.gossip_open = False
            row.own_seq += 1
            row.inflight_seq = row.own_seq
            row.inflight = row.pending_flush
            row.pending_flush -= row.inflight
            if row.pending_gossip:
                # These units now travel under a fixed sequence; seal them with it.
                if row.sealed_gossip is None:
                    row.sealed_gossip = []
                row.sealed_gossip.append((row.own_seq, row.pending_gossip))
                row.pending_gossip = 0
            return (row.inflight_seq, row.inflight)

    def take_gossip(self, key: Key) -> list[Tagged]:
        """This node's not-yet-gossiped units for ``key``, each tagged with its flush sequence."""
        with self._lock:
            self._touched.discard(key)
            row = self._rows.get(key)
            if row is None or not row.seeded:
                # Its flush sequence is unknown until seeded; seed() marks it touched again.
                return []
            out = row.sealed_gossip or []
            row.sealed_gossip = None
            if row.pending_gossip:
                out.append((row.own_seq + 1, row.pending_gossip))
                row.pending_gossip = 0
                row.gossip_open = True
            return out

    def take_pending(self, key: Key, kind: PendingKind) -> list[Tagged]:
        """Take a pending column: ``flush`` as in :meth:`take_flush`, ``gossip`` as in
        :meth:`take_gossip`. Returns the tagged deltas taken (empty if none)."""
        if kind == "flush":
            taken = self.take_flush(key)
            return [] if taken is None else [taken]
        return self.take_gossip(key)

    def flush_failed(self, key: Key) -> None:
        """Keep ``key`` dirty after a failed write, so the in-flight delta is retried."""
        with self._lock:
            if key in self._rows:
                self._dirty.add(key)

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
        del source  # every source is handled alike: the sequences say what the total holds
        with self._lock:
            row = self._rows.get(key)
            if row is None or not row.seeded:
                return False
            if not _covers(snap, self.node, row):
                return False
            self._rebase_row(row, snap)
            if row.inflight_seq == 0 and row.pending_flush == 0 and not row.gossip_open:
                self._dirty.discard(key)
            return True

    def _rebase_row(self, row: Row, snap: Snapshot) -> None:
        own = snap.seq_of(self.node)
        row.base = snap.total
        row.own_applied = own
        peers = {n: s for n, s in snap.seqs.items() if n != self.node}
        row.peer_seqs = peers or None
        row.seeded = True
        if own > row.own_seq:
            # The store knows later sequences of ours than we do (we restarted): continue
            # after them. Nothing can be in flight or gossiped yet, the row was unseeded.
            row.own_seq = own
        if row.inflight_seq and own >= row.inflight_seq:
            row.inflight = 0
            row.inflight_seq = 0
        if row.remote:
            for peer in list(row.remote):
                upto = peers.get(peer, 0)
                by_seq = row.remote[peer]
                for seq in [s for s in by_seq if s <= upto]:
                    row.remote_total -= by_seq.pop(seq)
                if not by_seq:
                    del row.remote[peer]
            if not row.remote:
                row.remote = None

    def apply_remote(self, key: Key, peer: str, seq: int, delta: int) -> bool:
        """Add a peer's gossiped ``delta``, tagged with the flush ``seq`` it goes under.

        Skipped (``False``) for cold or unseeded keys (they seed from the store, which has
        every flushed delta), for our own id, and when the row's snapshot already holds it.
        """
        with self._lock:
            row = self._rows.get(key)
            if row is None or not row.seeded or peer == self.node:
                return False
            if row.peer_seqs is not None and row.peer_seqs.get(peer, 0) >= seq:
                return False
            if row.remote is None:
                row.remote = {}
            by_seq = row.remote.setdefault(peer, {})
            by_seq[seq] = by_seq.get(seq, 0) + delta
            row.remote_total += delta
            return True

    def forget_peer(self, peer: str) -> int:
        """Drop every remote delta of ``peer``; return the units dropped.

        For a peer that died: what it gossiped but never flushed will never reach the store
        under those sequences, so keeping it would hold views above the truth for good.
        """
        with self._lock:
            dropped = 0
            for row in self._rows.values():
                if row.remote and peer in row.remote:
                    units = sum(row.remote.pop(peer).values())
                    row.remote_total -= units
                    dropped += units
                    if not row.remote:
                        row.remote = None
            return dropped

    # -- housekeeping ------------------------------------------------------------------------

    def evict_idle(self) -> int:
        """Drop clean keys not used since the previous call; return how many were dropped.

        Called periodically: a key survives one full interval after its last use. Keys with
        anything pending, in flight, reserved or from peers are never dropped.
        """
        with self._lock:
            cutoff = self._gen
            self._gen += 1
            doomed = [k for k, r in self._rows.items() if r.gen < cutoff and r.idle()]
            if doomed:
                self.evictions += 1
            for key in doomed:
                del self._rows[key]
                # incr(key, 0) or commit(..., 0) leaves an idle row marked; unmark it too.
                self._dirty.discard(key)
                self._touched.discard(key)
                tenant, feature, period = key
                features = self._by_period.get((tenant, period))
                if features is not None:
                    features.discard(feature)
                    if not features:
                        del self._by_period[(tenant, period)]
            return len(doomed)

    def keys(self) -> Iterable[Key]:
        """A snapshot of every warm key."""
        with self._lock:
            return list(self._rows)


def _covers(snap: Snapshot, node: str, row: Row) -> bool:
    """Whether ``snap`` is at least as new as the snapshot ``row`` was based on."""
    if snap.seq_of(node) < row.own_applied:
        return False
    if row.peer_seqs:
        for peer, seq in row.peer_seqs.items():
            if snap.seq_of(peer) < seq:
                return False
    return True
