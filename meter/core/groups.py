"""A feature's dimension counters on this node: listed from storage, bounded, grouped.

A group-by reads every dimension counter of a (tenant, feature, period); a call that would
make a new one is checked against the feature's bound on them. Both need every such counter
storage holds, so the first of them on this node lists them (one range read,
:meth:`storage.base.Counters.list_between`) and seeds them into the table; later ones answer
from memory while that listing holds: until an eviction pass or a claim of the node id moves
the table's epoch on, or a peer gossips about a dimension counter of it this node holds cold
(the table keeps such deltas and announced snapshots, :class:`~meter.core.table.Missed`; the
next listing seeds that counter and applies them, skipping what its snapshot holds). Names
of dimension counters are those of :mod:`meter.core.dims`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from meter.core.dims import LAST, FeatureSpec, decode, dimension_counters, group, shown
from meter.core.keys import Key
from meter.core.missed import Heard
from meter.core.table import CounterTable
from meter.errors import InvalidArgument, Unavailable
from storage.base import EMPTY, Counters, Snapshot, StorageError

#: Most (tenant, feature, period) listings remembered; the memory starts over when full.
MAX_LISTINGS = 65_536
#: Listing rounds one read makes while peers keep gossiping counters it lacks.
MAX_ROUNDS = 3


class TooManyCombinations(InvalidArgument):
    """A call would pass a feature's bound on its dimension counters (nothing counted)."""


class Groups:
    """The dimension counters this node holds in full (see the module docstring)."""

    def __init__(self, table: CounterTable, storage: Counters) -> None:
        self.table = table
        self.storage = storage
        # (tenant, feature, period) -> the table's epoch and missed.lost when its listing
        # was seeded.
        self._listed: dict[Key, tuple[int, int]] = {}
        # (tenant, feature, period) -> what peers said of its dimension counters held cold
        # here (by counter name: deltas, announced snapshots), applied once they are seeded.
        self._missed: dict[Key, dict[str, list[Heard]]] = {}
        # (tenant, feature, period) -> new dimension counters calls claimed and are counting.
        self._incoming: dict[Key, dict[str, int]] = {}
        #: Listings read from storage, and calls refused by a bound, since start.
        self.listings = 0
        self.refused = 0

    def listed(self, tenant: str, feature: str, period: str) -> bool:
        """Whether this node holds every dimension counter of the feature it knows of."""
        self._drain_missed()
        key = (tenant, feature, period)
        table = self.table
        stamp = (table.epoch, table.missed.lost)
        return key not in self._missed and self._listed.get(key) == stamp

    def _drain_missed(self) -> None:
        table = self.table
        if not table.missed.heard:
            return
        for (tenant, name, period), heard in table.take_missed().items():
            feature, _, _ = decode(name)
            level = (tenant, feature, period)
            names = self._missed.get(level)
            if names is None:
                if len(self._missed) >= MAX_LISTINGS:
                    self._missed.clear()
                    self._listed.clear()
                names = self._missed[level] = {}
            names.setdefault(name, []).extend(heard)

    async def refresh(self, tenant: str, feature: str, period: str) -> None:
        """Seed the feature's total and every dimension counter storage holds, or a peer
        gossiped, into the table; what peers said of them while they were cold here is
        applied then."""
        table = self.table
        key = (tenant, feature, period)
        for _ in range(MAX_ROUNDS):
            epoch, lost = table.epoch, table.missed.lost
            table.missed.listen(key)  # (from the read on: deltas gossiped meanwhile are kept)
            self._drain_missed()
            missed = self._missed.pop(key, {})
            try:
                stored = await self.storage.list_between(tenant, period, feature, feature + LAST)
            except StorageError as exc:
                self._missed.setdefault(key, {}).update(missed)
                raise Unavailable(f"storage is unreachable: {exc}") from None
            self.listings += 1
            # (the read covers every name in the range: one it lacks is stored nowhere yet)
            snaps = dict(stored)
            snaps.setdefault(feature, EMPTY)
            for name in [*missed, *table.unseeded_features(tenant, period)]:
                if name == feature or dimension_counters((name,), feature):
                    snaps.setdefault(name, EMPTY)
            refused = [
                name
                for name, snap in snaps.items()
                if not table.seed((tenant, name, period), snap, epoch)
                and not table.is_seeded((tenant, name, period))
            ]
            for name, heard in missed.items():
                if name in refused:
                    self._missed.setdefault(key, {}).setdefault(name, []).extend(heard)
                    continue
                counter = (tenant, name, period)
                for said in heard:  # (what the row's snapshot holds is skipped)
                    if isinstance(said, Snapshot):
                        table.rebase(counter, said, "gossip")
                    else:
                        table.apply_remote(counter, *said)
            if refused:
                continue  # an eviction pass or a claim of the node id overtook the read
            self._drain_missed()
            if key not in self._missed and (table.epoch, table.missed.lost) == (epoch, lost):
                if len(self._listed) >= MAX_LISTINGS:
                    self._listed.clear()
                self._listed[key] = (epoch, lost)
                return
        # Peers kept gossiping counters it lacked: what is seeded answers, not remembered.
        if not table.is_seeded(key):
            raise Unavailable("counters were evicted (or the node id claimed) while listed; retry")

    def counters(self, tenant: str, feature: str, period: str) -> dict[str, int]:
        """The feature's dimension counters this node holds, seeded ones, by name."""
        held = self.table.all_for(tenant, period, use=True)
        return {name: held[name] for name in dimension_counters(held, feature)}

    def claim(self, spec: FeatureSpec, keys: Iterable[Key]) -> list[Key]:
        """Claim the dimension counters among ``keys`` this node does not hold, within
        ``spec``'s bound on each feature's (counted with those it holds and those other calls
        claimed and are still counting); :class:`TooManyCombinations` (nothing claimed) past
        it. The listings of their features must be held (:meth:`listed`). Release with
        :meth:`unclaim` once the call counted or failed."""
        new: dict[Key, list[Key]] = {}
        table = self.table
        for key in keys:
            tenant, name, period = key
            if table.is_warm(key):
                continue
            base, pairs, _ = decode(name)
            if pairs:
                new.setdefault((tenant, base, period), []).append(key)
        if not new:
            return []
        for (tenant, base, period), adding in new.items():
            names = {*table.all_for(tenant, period), *table.unseeded_features(tenant, period)}
            incoming = self._incoming.get((tenant, base, period), {})
            known = set(dimension_counters(names, base)) | set(incoming)
            more = {k[1] for k in adding} - known
            if len(known) + len(more) > spec.max_combinations:
                self.refused += 1
                example = shown(min(known)) if known else "-"
                raise TooManyCombinations(
                    f"{tenant}/{base}: {len(more)} more dimension counter(s) would pass the "
                    f"bound of {spec.max_combinations} (max_combinations) in the period "
                    f"{period}; it has {len(known)}, e.g. {example}; nothing counted"
                )
        claimed: list[Key] = []
        for level, adding in new.items():
            incoming = self._incoming.setdefault(level, {})
            for key in adding:
                incoming[key[1]] = incoming.get(key[1], 0) + 1
                claimed.append(key)
        return claimed

    def unclaim(self, claimed: list[Key]) -> None:
        """Release what :meth:`claim` claimed."""
        for tenant, name, period in claimed:
            level = (tenant, decode(name)[0], period)
            incoming = self._incoming.get(level)
            if incoming is None:
                continue
            left = incoming.get(name, 0) - 1
            if left > 0:
                incoming[name] = left
            else:
                incoming.pop(name, None)
                if not incoming:
                    del self._incoming[level]

    def read(self, key: Key, group_by: tuple[str, ...]) -> Any:
        """``usage`` with ``group_by`` of the feature of ``key`` (its total's key): the
        answer, or a coroutine that lists the feature's counters first."""
        tenant, feature, period = key
        if self.listed(tenant, feature, period):
            total = self.table.value(key)
            if total is not None:
                return group(total, self.counters(tenant, feature, period), group_by)
        return self._read_listed(key, group_by)

    async def _read_listed(self, key: Key, group_by: tuple[str, ...]) -> dict[str, Any]:
        tenant, feature, period = key
        await self.refresh(tenant, feature, period)
        total = self.table.value(key)
        if total is None:
            raise Unavailable("storage is unreachable and this counter's total is not known")
        return group(total, self.counters(tenant, feature, period), group_by)
