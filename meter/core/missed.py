"""What peers said about counters a node holds cold, for the features it listed: kept for the
table (:attr:`~meter.core.table.CounterTable.missed`) and applied by
:class:`~meter.core.groups.Groups` when it seeds them. Pure: no I/O."""

from __future__ import annotations

from meter.core.keys import Key
from storage.base import Snapshot

#: Most peers' words :class:`Missed` keeps; past it every listing is out of date.
MAX_MISSED = 65_536

#: What :class:`Missed` keeps of a peer's word on a cold counter: a gossiped delta
#: ``(peer, seq, delta)`` or an announced snapshot.
Heard = tuple[str, int, int] | Snapshot


class Missed:
    """What peers gossiped about counters this node holds cold, for the features whose
    counters (their totals and dimension counters, docs/dimensions.md) it listed
    (:class:`~meter.core.groups.Groups`): such a listing is out of date, and once the counter
    is seeded the deltas are applied and the announced snapshots re-based on (as for any row,
    what the row's snapshot already holds is skipped). The table notes and takes under its
    lock; the rest runs on the node's event loop, as every call of the table does."""

    __slots__ = ("features", "heard", "lost", "noted")

    def __init__(self) -> None:
        #: (tenant, feature, period) of the features listed (the only ones noted).
        self.features: set[Key] = set()
        self.heard: dict[Key, list[Heard]] = {}
        self.noted = 0
        #: How often the notes were too many and forgotten (every listing out of date).
        self.lost = 0

    def listen(self, feature: Key) -> None:
        """Note what peers say of the total and dimension counters of ``feature`` (tenant,
        feature, period) from now on."""
        if len(self.features) >= MAX_MISSED:
            self.features.clear()
            self.lost += 1
        self.features.add(feature)

    def note(self, key: Key, heard: Heard) -> None:
        """Keep ``heard`` of the cold counter ``key`` if it is a listed feature's total or
        one of its dimension counters."""
        name = key[1]
        cut = name.find("\x1f")
        other = name.find("\x1e")
        if other >= 0 and (cut < 0 or other < cut):
            cut = other
        feature = name if cut < 0 else name[:cut]
        if (key[0], feature, key[2]) not in self.features:
            return
        if self.noted >= MAX_MISSED:
            self.heard.clear()
            self.noted = 0
            self.lost += 1
        got = self.heard.get(key)
        if got is None:
            got = self.heard[key] = []
        got.append(heard)
        self.noted += 1

    def stop_noting(self) -> None:
        """Note nothing until features are listed again (an eviction pass: every listing is
        out of date); what is kept stays, to apply at the next listing."""
        self.features.clear()

    def forget(self) -> None:
        """Every listing is out of date (a resync: peers' words may have been lost), and
        nothing is noted until the features are listed again."""
        self.features.clear()
        self.heard = {}
        self.noted = 0
        self.lost += 1

    def take(self) -> dict[Key, list[Heard]]:
        """What is kept (by key), forgotten."""
        out = self.heard
        self.heard = {}
        self.noted = 0
        return out
