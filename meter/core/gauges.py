"""Gauges: counters of a ``max`` or ``latest`` feature, in memory. Pure: no I/O, no asyncio.

A gauge's state is a *reading* ``(value, at_ms, node)``: for ``max`` the largest value
observed in the period (``at_ms`` and ``node`` say when and where), for ``latest`` the value
of the latest observation by ``(at_ms, node)``. Readings merge by :func:`wins` (a join: any
order of merges gives the same reading), so a reading is applied any number of times, from
any source (this node's calls, peers' gossip, storage), and flushes need no sequences: storage
keeps a reading only if it wins over the one stored (docs/dimensions.md, "Gauges").

A row remembers the reading last known stored, so a flush writes only rows whose reading
moved past it (*dirty*) and gossip sends only rows that changed since the last tick
(*touched*). A row with no stored reading read yet is *unseeded*: its value is unknown
(``None``) until storage answers, as for a counter (:mod:`meter.core.table`).

Why one module (it is short): the row and the table that holds them must agree on one merge.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Literal

from meter.core.keys import Key
from storage.base import GaugeReading, reading_wins

GaugeKind = Literal["max", "latest"]
Reading = GaugeReading
"""``(value, at_ms, node)``."""

#: Whether reading ``a`` wins over ``b`` for a gauge of ``kind``: storage's order, so a node
#: and storage keep the same reading (a total order: any merges end with the same one).
wins = reading_wins


class GaugeRow:
    """One gauge. Mutated only under the table's lock."""

    __slots__ = ("kind", "reading", "seeded", "stored", "touched", "used")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        #: What this node knows: every reading merged (None: none yet).
        self.reading: Reading | None = None
        #: The reading storage is known to hold (None: none, or not read yet).
        self.stored: Reading | None = None
        self.seeded = False
        self.touched = False
        self.used = True

    def dirty(self, node: str) -> bool:
        """Whether this row holds a reading of ``node`` storage may not hold."""
        reading = self.reading
        return reading is not None and reading[2] == node and wins(self.kind, reading, self.stored)


class GaugeTable:
    """Every warm gauge of one node, guarded by one lock (see the module docstring)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._rows: dict[Key, GaugeRow] = {}
        # (tenant, period) -> its gauges' features (usage_all).
        self._by_period: dict[tuple[str, str], set[str]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def is_seeded(self, key: Key) -> bool:
        """Whether ``key`` has a row whose stored reading was read."""
        row = self._rows.get(key)
        return row is not None and row.seeded

    def reading(self, key: Key) -> Reading | None:
        """This node's reading of ``key`` (``None``: cold, unseeded or never observed)."""
        with self._lock:
            row = self._rows.get(key)
            if row is None or not row.seeded:
                return None
            row.used = True
            return row.reading

    def value(self, key: Key) -> int | None:
        """What ``usage`` answers: the reading's value, 0 for a gauge never observed,
        ``None`` if cold or unseeded."""
        with self._lock:
            row = self._rows.get(key)
            if row is None or not row.seeded:
                return None
            row.used = True
            return 0 if row.reading is None else row.reading[0]

    def observe(
        self, key: Key, kind: str, value: int, at_ms: int, now: bool = False
    ) -> tuple[int, Reading | None, Reading]:
        """Merge this node's observation of ``value`` at ``at_ms`` (the row is made if cold,
        unseeded); the value after it, the reading before it (to undo it) and the
        observation's reading. ``now``: ``at_ms`` is the node's clock, and the observation
        comes after this node's previous one (1 ms later if the clock has not moved past
        it), so two calls in one millisecond keep their order for ``latest``."""
        with self._lock:
            row = self._row(key, kind)
            before = row.reading
            if now and before is not None and before[2] == self.node and before[1] >= at_ms:
                at_ms = before[1] + 1
            mine = (value, at_ms, self.node)
            if wins(kind, mine, before):
                row.reading = mine
                row.touched = True
            row.used = True
            after = row.reading
            assert after is not None
            return after[0], before, mine

    def undo(self, key: Key, before: Reading | None, mine: Reading) -> bool:
        """Take back an observation whose log write failed: if the row still holds ``mine``,
        back to ``before`` (readings merged since that ``mine`` beat are lost until storage
        is read again: the row is unseeded then). Returns whether the row went back."""
        with self._lock:
            row = self._rows.get(key)
            if row is None or row.reading != mine:
                return False
            row.reading = before
            row.seeded = False  # (read again: a peer's reading may have been merged under it)
            return True

    def merge(self, key: Key, reading: Reading) -> bool:
        """Merge a peer's gossiped reading into a warm row (cold rows are skipped: they read
        storage when used); whether the view moved."""
        with self._lock:
            row = self._rows.get(key)
            if row is None or not wins(row.kind, reading, row.reading):
                return False
            row.reading = reading
            return True

    def seed(self, key: Key, kind: str, stored: Reading | None) -> None:
        """Give a row storage's reading (read fresh): merged into what this node knows."""
        with self._lock:
            row = self._row(key, kind)
            self._merge_stored(row, stored)
            row.seeded = True

    def stored(self, key: Key, stored: Reading | None) -> None:
        """Storage answered a write of ``key`` with the reading it holds now (ours, or one
        that wins over it): merged, known stored, and the row seeded (the answer is a read)."""
        with self._lock:
            row = self._rows.get(key)
            if row is not None:
                self._merge_stored(row, stored)
                row.seeded = True

    def _merge_stored(self, row: GaugeRow, stored: Reading | None) -> None:
        if stored is None:
            return
        if wins(row.kind, stored, row.reading):
            row.reading = stored
        if wins(row.kind, stored, row.stored):
            row.stored = stored

    def _row(self, key: Key, kind: str) -> GaugeRow:
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = GaugeRow(kind)
            self._by_period.setdefault((key[0], key[2]), set()).add(key[1])
        return row

    def all_for(self, tenant: str, period: str) -> dict[str, int]:
        """Feature -> value of ``tenant``'s seeded gauges in ``period``."""
        with self._lock:
            out: dict[str, int] = {}
            for feature in self._by_period.get((tenant, period), ()):
                row = self._rows[(tenant, feature, period)]
                if row.seeded:
                    out[feature] = 0 if row.reading is None else row.reading[0]
            return out

    def dirty(self) -> list[tuple[Key, str, Reading]]:
        """Every row whose reading is this node's and storage may not hold: ``(key, kind,
        reading)`` (a write needs no read first: storage keeps a reading only if it wins; a
        peer writes its own readings)."""
        with self._lock:
            node = self.node
            out: list[tuple[Key, str, Reading]] = []
            for key, row in self._rows.items():
                if row.dirty(node):
                    assert row.reading is not None
                    out.append((key, row.kind, row.reading))
            return out

    def unstored(self) -> list[tuple[Key, str, Reading]]:
        """What a checkpoint of the log restates: :meth:`dirty` (seeded rows or not)."""
        return self.dirty()

    def unseeded(self) -> list[tuple[Key, str]]:
        """Rows whose stored reading is to be read."""
        with self._lock:
            return [(key, row.kind) for key, row in self._rows.items() if not row.seeded]

    def take_touched(self) -> list[tuple[Key, str, Reading]]:
        """The readings of this node's observations since the last take, for gossip."""
        with self._lock:
            out: list[tuple[Key, str, Reading]] = []
            for key, row in self._rows.items():
                if row.touched:
                    row.touched = False
                    if row.reading is not None:
                        out.append((key, row.kind, row.reading))
            return out

    def take_readings(self) -> list[tuple[str, str, str, str, int, int, str]]:
        """:meth:`take_touched` as gossip items ``(tenant, feature, period, kind, value,
        at_ms, node)`` (:class:`cluster.api.GaugeSource`)."""
        return [
            (key[0], key[1], key[2], kind, reading[0], reading[1], reading[2])
            for key, kind, reading in self.take_touched()
        ]

    def merge_readings(self, items: Iterable[tuple[str, str, str, str, int, int, str]]) -> int:
        """Merge peers' readings (gossip items) into warm rows; how many moved a view."""
        moved = 0
        for t, f, p, _, value, at_ms, node in items:
            if self.merge((t, f, p), (value, at_ms, node)):
                moved += 1
        return moved

    def warm(self) -> list[tuple[Key, str]]:
        """Every seeded row: what a resync reads again."""
        with self._lock:
            return [(key, row.kind) for key, row in self._rows.items() if row.seeded]

    def evict_idle(self) -> int:
        """Drop rows not used since the previous call with nothing to write or send."""
        with self._lock:
            doomed: list[Key] = []
            for key, row in self._rows.items():
                if row.used:
                    row.used = False
                elif row.seeded and not row.touched and not row.dirty(self.node):
                    doomed.append(key)
            for key in doomed:
                del self._rows[key]
                features = self._by_period[(key[0], key[2])]
                features.discard(key[1])
                if not features:
                    del self._by_period[(key[0], key[2])]
            return len(doomed)

    def restore(self, items: Iterable[tuple[Key, str, Reading]]) -> None:
        """Put back readings replayed from the log (unseeded rows: read before use)."""
        with self._lock:
            for key, kind, reading in items:
                row = self._row(key, kind)
                if wins(kind, reading, row.reading):
                    row.reading = reading
                    row.touched = True
