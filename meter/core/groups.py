"""A feature's dimension counters on this node: listed from storage, bounded, grouped.

A group-by reads every dimension counter of a (tenant, feature, period); a call that would
make a new one is checked against the feature's bound on them. Both need every such counter
storage holds, so the first of them on this node lists them (one range read,
:meth:`storage.base.Counters.list_between`) and seeds them into the table; later ones answer
from memory while that listing holds: until an eviction pass or a claim of the node id moves
the table's epoch on, a resync gives up on gossip (:meth:`~meter.core.missed.Missed.forget`),
or a peer gossips about a counter of the feature this node holds cold (the table keeps such
deltas and announced snapshots, :class:`~meter.core.missed.Missed`; the next listing seeds
that counter and applies them, skipping what its snapshot holds).

Every dimension counter in the table got there within its feature's bound: listed from
storage, restored from the log, or made by a call that *entered* it (:meth:`Groups.enter`)
first. Reads never make one: a value no call gave reads 0. Names of dimension counters are
those of :mod:`meter.core.dims`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from meter.core.dims import LAST, FeatureSpec, Pairs, decode, dimension_counters, group, shown
from meter.core.keys import Key
from meter.core.missed import Heard
from meter.core.table import CounterTable
from meter.errors import InvalidArgument, Unavailable
from storage.base import EMPTY, Counters, Snapshot, StorageError

#: Most (tenant, feature, period) listings remembered; the memory starts over when full.
MAX_LISTINGS = 65_536
#: Most peers' words kept for listings to come (beyond: every listing is read again).
MAX_HEARD = 65_536
#: Listing rounds one read makes while peers keep gossiping counters it lacks.
MAX_ROUNDS = 3
#: Decoded counter names kept for group-bys (beyond: the memory starts over).
MAX_DECODED = 65_536


class TooManyCombinations(InvalidArgument):
    """A call would pass a feature's bound on its dimension counters (nothing counted)."""


class Groups:
    """The dimension counters this node holds in full (see the module docstring)."""

    def __init__(self, table: CounterTable, storage: Counters) -> None:
        self.table = table
        self.storage = storage
        # (tenant, feature, period) -> the table's epoch and missed.lost when its listing
        # was seeded.
        self._stamps: dict[Key, tuple[int, int]] = {}
        # (tenant, feature, period) -> what peers said of its counters held cold here (by
        # counter name: deltas, announced snapshots), applied once they are seeded.
        self._heard: dict[Key, dict[str, list[Heard]]] = {}
        self._heard_count = 0
        # (tenant, feature, period) -> new dimension counters calls entered and are making.
        self._entering: dict[Key, dict[str, int]] = {}
        # Counter name -> its pairs, and for a combination those as a map (group-bys).
        self._decoded: dict[str, tuple[Pairs, dict[str, str] | None]] = {}
        #: Listings read from storage, and calls refused by a bound, since start.
        self.listings = 0
        self.refused = 0

    def listed(self, tenant: str, feature: str, period: str) -> bool:
        """Whether this node holds every dimension counter of the feature it knows of."""
        self._drain_missed()
        key = (tenant, feature, period)
        table = self.table
        stamp = (table.epoch, table.missed.lost)
        return key not in self._heard and self._stamps.get(key) == stamp

    def _drain_missed(self) -> None:
        table = self.table
        if not table.missed.heard:
            return
        for (tenant, name, period), heard in table.take_missed().items():
            feature, _, _ = decode(name)
            level = (tenant, feature, period)
            if self._heard_count + len(heard) > MAX_HEARD:
                # Too much kept: forget it all; every listing is read again (and storage
                # holds what the peers flush meanwhile).
                self._heard.clear()
                self._heard_count = 0
                self._stamps.clear()
            self._heard.setdefault(level, {}).setdefault(name, []).extend(heard)
            self._heard_count += len(heard)

    def _keep_heard(self, level: Key, heard: dict[str, list[Heard]]) -> None:
        """Put back what :meth:`refresh` took and could not apply."""
        kept = self._heard.setdefault(level, {})
        for name, words in heard.items():
            kept.setdefault(name, []).extend(words)

    async def refresh(self, tenant: str, feature: str, period: str) -> None:
        """Seed the feature's total and every dimension counter storage holds, or a peer
        gossiped, into the table; what peers said of them while they were cold here is
        applied then."""
        table = self.table
        key = (tenant, feature, period)
        for _ in range(MAX_ROUNDS):
            epoch, lost = table.epoch, table.missed.lost
            table.missed.listen(key)  # (from the read on: what peers say meanwhile is kept)
            self._drain_missed()
            heard = self._heard.pop(key, {})
            self._heard_count -= sum(len(words) for words in heard.values())
            try:
                stored = await self.storage.list_between(tenant, period, feature, feature + LAST)
            except StorageError as exc:
                self._keep_heard(key, heard)
                raise Unavailable(f"storage is unreachable: {exc}") from None
            except BaseException:  # (cancelled: what peers said is still to apply)
                self._keep_heard(key, heard)
                raise
            self.listings += 1
            # (the read covers every name in the range: one it lacks is stored nowhere yet)
            snaps = dict(stored)
            snaps.setdefault(feature, EMPTY)
            for name in [*heard, *table.unseeded_features(tenant, period)]:
                if name == feature or dimension_counters((name,), feature):
                    snaps.setdefault(name, EMPTY)
            refused = [
                name
                for name, snap in snaps.items()
                if not table.seed((tenant, name, period), snap, epoch)
                and not table.is_seeded((tenant, name, period))
            ]
            for name, words in heard.items():
                if name in refused:
                    self._keep_heard(key, {name: words})
                    continue
                counter = (tenant, name, period)
                for said in words:  # (what the row's snapshot holds is skipped)
                    if isinstance(said, Snapshot):
                        table.rebase(counter, said, "gossip")
                    else:
                        table.apply_remote(counter, *said)
            if refused:
                continue  # an eviction pass or a claim of the node id overtook the read
            self._drain_missed()
            if key not in self._heard and (table.epoch, table.missed.lost) == (epoch, lost):
                if len(self._stamps) >= MAX_LISTINGS:
                    self._stamps.clear()
                self._stamps[key] = (epoch, lost)
                return
        # Peers kept gossiping counters it lacked: what is seeded answers, not remembered.
        if not table.is_seeded(key):
            raise Unavailable("counters were evicted (or the node id claimed) while listed; retry")

    async def enter_new(self, spec: FeatureSpec, keys: list[Key]) -> list[Key]:
        """The dimension counters among ``keys`` new to this node, entered within their
        features' bound (:meth:`enter`): each level's listing is read first, if not held.
        Release with :meth:`leave` once the call counted or failed."""
        table = self.table
        if all(table.is_warm(k) for k in keys):
            return []
        levels = sorted({(k[0], decode(k[1])[0], k[2]) for k in keys})
        for _ in range(MAX_ROUNDS):
            stale = [level for level in levels if not self.listed(*level)]
            if not stale:
                break
            for level in stale:
                await self.refresh(*level)
        return self.enter(spec, keys)

    def enter(self, spec: FeatureSpec, keys: Iterable[Key]) -> list[Key]:
        """Enter the dimension counters among ``keys`` this node does not hold, within
        ``spec``'s bound on each feature's (counted with those it holds and those other calls
        entered and are still making); :class:`TooManyCombinations` (nothing entered) past
        it. The listings of their features should be held (:meth:`listed`). Release with
        :meth:`leave` once the call counted or failed."""
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
            entering = self._entering.get((tenant, base, period), {})
            known = set(dimension_counters(names, base)) | set(entering)
            more = {k[1] for k in adding} - known
            if len(known) + len(more) > spec.max_combinations:
                self.refused += 1
                example = shown(min(known)) if known else "-"
                raise TooManyCombinations(
                    f"{tenant}/{base}: {len(more)} more dimension counter(s) would pass the "
                    f"bound of {spec.max_combinations} (max_combinations) in the period "
                    f"{period}; it has {len(known)}, e.g. {example}; nothing counted"
                )
        entered: list[Key] = []
        for level, adding in new.items():
            entering = self._entering.setdefault(level, {})
            for key in adding:
                entering[key[1]] = entering.get(key[1], 0) + 1
                entered.append(key)
        return entered

    def leave(self, entered: list[Key]) -> None:
        """Release what :meth:`enter` entered."""
        for tenant, name, period in entered:
            level = (tenant, decode(name)[0], period)
            entering = self._entering.get(level)
            if entering is None:
                continue
            left = entering.get(name, 0) - 1
            if left > 0:
                entering[name] = left
            else:
                entering.pop(name, None)
                if not entering:
                    del self._entering[level]

    def counters(self, tenant: str, feature: str, period: str) -> dict[str, int]:
        """The feature's dimension counters this node holds, seeded ones, by name."""
        held = self.table.all_for(tenant, period, use=True)
        return {name: held[name] for name in dimension_counters(held, feature)}

    def read(self, key: Key, group_by: tuple[str, ...]) -> Any:
        """``usage`` with ``group_by`` of the feature of ``key`` (its total's key): the
        answer, or a coroutine that lists the feature's counters first."""
        tenant, feature, period = key
        if self.listed(tenant, feature, period):
            total = self.table.value(key)
            if total is not None:
                return self._group(total, tenant, feature, period, group_by)
        return self._read_listed(key, group_by)

    async def _read_listed(self, key: Key, group_by: tuple[str, ...]) -> dict[str, Any]:
        tenant, feature, period = key
        await self.refresh(tenant, feature, period)
        total = self.table.value(key)
        if total is None:
            raise Unavailable("storage is unreachable and this counter's total is not known")
        return self._group(total, tenant, feature, period, group_by)

    def _group(
        self, total: int, tenant: str, feature: str, period: str, group_by: tuple[str, ...]
    ) -> dict[str, Any]:
        decoded = self._decoded
        if len(decoded) >= MAX_DECODED:
            decoded.clear()
        return group(total, self.counters(tenant, feature, period), group_by, decoded)

    def value(self, key: Key) -> Any:
        """``usage`` of the dimension counter ``key`` (one value's, ``where``): its value, or
        a coroutine that lists its feature first. A counter no call made reads 0; a read
        makes none."""
        value = self.table.value(key)
        if value is not None:
            return value
        return self._value_listed(key)

    async def _value_listed(self, key: Key) -> int:
        tenant, name, period = key
        feature = decode(name)[0]
        if not self.listed(tenant, feature, period):
            await self.refresh(tenant, feature, period)
        if not self.table.is_warm(key):
            return 0  # neither stored nor made here: no call gave that value yet
        value = self.table.value(key)
        if value is None:
            raise Unavailable("storage is unreachable and this counter's total is not known")
        return value
