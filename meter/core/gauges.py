"""Gauges: counters of a ``max`` or ``latest`` feature, in memory. Pure: no I/O, no asyncio.

A gauge's state is a *reading* ``(value, at_ms, node)``: for ``max`` the largest value
observed in the period (``at_ms`` and ``node`` say when and where), for ``latest`` the value
of the latest observation by ``(at_ms, node)``. Readings merge by :func:`wins` (a join: any
order of merges gives the same reading), so a reading is applied any number of times, from
any source (this node's calls, peers' gossip, storage), and flushes need no sequences: storage
keeps a reading only if it wins over the one stored (docs/dimensions.md, "Gauges").

A row keeps apart what this node knows (its *reading*, every reading merged) and *mine*: the
best of this node's own observations storage may not hold yet. A flush writes *mine* until
storage answers a reading that wins over it or equals it (then it is stored); a peer's reading
that beats it in the view does not make it stored (that peer may never store its own), so
checkpoints restate it and eviction keeps the row. Gossip sends the rows whose view moved
since the last tick (*touched*, kept only when a gossip layer takes them). A row with no
stored reading read yet is *unseeded*: its value is unknown (``None``) until storage answers,
as for a counter (:mod:`meter.core.table`).

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

    __slots__ = ("clock_ms", "kind", "mine", "reading", "seeded", "stored", "used")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        #: What this node knows: every reading merged (None: none yet).
        self.reading: Reading | None = None
        #: The best of this node's observations storage may not hold (None: none).
        self.mine: Reading | None = None
        #: The best reading storage is known to hold (None: none, or not read yet).
        self.stored: Reading | None = None
        #: The time given to this node's last observation on its own clock (ms; 0: none).
        self.clock_ms = 0
        self.seeded = False
        self.used = True

    def stored_now(self, stored: Reading | None, node: str) -> None:
        """Storage holds ``stored`` (a fresh read or a write's answer): merged into the view;
        *mine* is done once storage holds it or a reading that wins over it; a reading of
        this node's (``node``) moves its clock order past it."""
        if stored is None:
            return
        if stored[2] == node:
            self.clock_ms = max(self.clock_ms, stored[1])
        kind = self.kind
        if wins(kind, stored, self.reading):
            self.reading = stored
        if wins(kind, stored, self.stored):
            self.stored = stored
        mine = self.mine
        if mine is not None and not wins(kind, mine, self.stored):
            self.mine = None


#: Within this many ms of the node's clock, an observation in the millisecond of the node's
#: previous one (or a clock gone back) is taken 1 ms after it; past it (over 1,000 calls in
#: one millisecond on one gauge), at its own time: readings never run ahead of the clock by
#: more than this.
MAX_CLOCK_LEAD_MS = 1000


class GaugeTable:
    """Every warm gauge of one node, guarded by one lock (see the module docstring).

    ``gossip``: a gossip layer takes the touched rows (:meth:`take_touched`); without one
    nothing is kept for it."""

    def __init__(self, node: str, gossip: bool = True) -> None:
        self.node = node
        self.gossip = gossip
        self._lock = threading.Lock()
        self._rows: dict[Key, GaugeRow] = {}
        # Rows whose view moved since the last take (gossip).
        self._touched: set[Key] = set()
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
    ) -> tuple[int, Reading | None, Reading, Reading | None]:
        """Merge this node's observation of ``value`` at ``at_ms`` (the row is made if cold,
        unseeded); the value after it, the view and *mine* before it (to undo it), and the
        observation's reading. ``now``: ``at_ms`` is the node's clock, and the observation
        comes after this node's previous one on its clock (1 ms later if the clock has not
        moved past it, see :data:`MAX_CLOCK_LEAD_MS`), so calls in one millisecond keep their
        order for ``latest``."""
        with self._lock:
            row = self._row(key, kind)
            before, before_mine = row.reading, row.mine
            if now:
                if at_ms <= row.clock_ms < at_ms + MAX_CLOCK_LEAD_MS - 1:
                    at_ms = row.clock_ms + 1
                row.clock_ms = max(row.clock_ms, at_ms)
            observed = (value, at_ms, self.node)
            if wins(kind, observed, row.mine) and wins(kind, observed, row.stored):
                row.mine = observed
            if wins(kind, observed, before):
                row.reading = observed
                if self.gossip:
                    self._touched.add(key)
            row.used = True
            after = row.reading
            assert after is not None
            return after[0], before, observed, before_mine

    def undo(
        self, key: Key, before: Reading | None, observed: Reading, before_mine: Reading | None
    ) -> bool:
        """Take back an observation whose log write failed (no flush took it: the flusher
        takes at commit boundaries): *mine* back to ``before_mine``, and the view back to
        ``before`` if it still holds ``observed`` (readings merged since that ``observed``
        beat are lost until storage is read again: the row is unseeded then). Returns whether
        the view went back."""
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                return False
            if row.mine == observed:
                row.mine = before_mine
            if row.reading != observed:
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
            row.stored_now(stored, self.node)
            row.seeded = True

    def stored(self, key: Key, stored: Reading | None) -> None:
        """Storage answered a write of ``key`` with the reading it holds now (ours, or one
        that wins over it): merged, known stored, and the row seeded (the answer is a read)."""
        with self._lock:
            row = self._rows.get(key)
            if row is not None:
                row.stored_now(stored, self.node)
                row.seeded = True

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

    def unseeded_in(self, tenant: str, period: str) -> list[tuple[Key, str]]:
        """``tenant``'s gauges in ``period`` held unread: ``(key, kind)``."""
        with self._lock:
            out: list[tuple[Key, str]] = []
            for feature in self._by_period.get((tenant, period), ()):
                key = (tenant, feature, period)
                row = self._rows[key]
                if not row.seeded:
                    out.append((key, row.kind))
            return out

    def dirty(self) -> list[tuple[Key, str, Reading]]:
        """Every row's *mine* storage may not hold: ``(key, kind, reading)``, what a flush
        writes (no read first: storage keeps a reading only if it wins) and a checkpoint of
        the log restates (seeded rows or not)."""
        with self._lock:
            return [(key, row.kind, row.mine) for key, row in self._rows.items()
                    if row.mine is not None]  # fmt: skip

    def take_touched(self) -> list[tuple[Key, str, Reading]]:
        """The readings of rows whose view this node's observations moved since the last
        take, for gossip."""
        with self._lock:
            out: list[tuple[Key, str, Reading]] = []
            for key in self._touched:
                row = self._rows.get(key)
                if row is not None and row.reading is not None:
                    out.append((key, row.kind, row.reading))
            self._touched.clear()
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
                elif row.seeded and row.mine is None and key not in self._touched:
                    doomed.append(key)
            for key in doomed:
                del self._rows[key]
                features = self._by_period[(key[0], key[2])]
                features.discard(key[1])
                if not features:
                    del self._by_period[(key[0], key[2])]
            return len(doomed)

    def restore(self, items: Iterable[tuple[Key, str, Reading]]) -> None:
        """Put back this node's readings replayed from the log (unseeded rows: read before
        use; each is *mine* until storage is known to hold it)."""
        with self._lock:
            for key, kind, reading in items:
                row = self._row(key, kind)
                row.clock_ms = max(row.clock_ms, reading[1])  # (a restart within its lead)
                if wins(kind, reading, row.mine):
                    row.mine = reading
                if wins(kind, reading, row.reading):
                    row.reading = reading
                    if self.gossip:
                        self._touched.add(key)
