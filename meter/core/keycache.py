"""Validated names and the keys of the current UTC day: one copy of each, checked once.

The request path asks :meth:`KeyCache.key_for` for the key of every call. Validation and
period building then happen once per (tenant, feature) per day instead of once per call, and
every row of a pair shares one key tuple. Pure: no I/O.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Mapping
from typing import Any

from meter.core.cycles import Schedule, period_name
from meter.core.dims import UNDECLARED, FeatureSpec, Pairs, counter_names, is_dimension
from meter.core.keys import Key, PeriodKind, check_feature, check_tenant, period_start
from meter.core.periods import ByFeature, next_keys
from meter.errors import InvalidArgument, PeriodClosed, Unavailable
from storage import periods as named_periods
from storage.periods import Cycle, bounds, following

#: Most levels of a tenant name with the tenant hierarchy on (``a/b/c/d``).
MAX_LEVELS = 4
#: Most (tenant, feature) pairs whose current key is cached; the cache starts over when full.
#: (65,536 made track_many leave its fast path past that many active pairs: 2.5x per item.)
KEY_CACHE_SIZE = 262_144
#: Most names kept in one copy, per kind (tenants, features, periods); each starts over when full.
NAME_CACHE_SIZE = 262_144
#: Most steps of the trie of checked dimension maps (:class:`DimNode`); it starts over when
#: full. A map of two dimensions takes one to two steps beyond those it shares.
DIM_NODES_SIZE = 131_072
#: How long, beyond ``period_grace_s``, a calendar no tenant follows any more is still in use
#: (its last period, cut short by a change, may end by its name up to a month later).
CALENDAR_KEPT_S = 40 * 86400.0


class DimNode:
    """One step of the trie of dimension maps checked before (:meth:`KeyCache.known_dims`):
    from the feature, each name then value in the order the map was sent. Hashed by identity,
    so a batch sums its items' units by the node their map ends on."""

    __slots__ = ("names", "next")

    def __init__(self) -> None:
        #: The map's next name (or value) -> the step after it.
        self.next: dict[str, DimNode] = {}
        #: Where a checked map ends: the names of the counters a call giving it counts on,
        #: the feature's own first (meter.core.dims).
        self.names: tuple[str, ...] | None = None


class KeyCache:
    """The keys and names one node has validated (see the module docstring)."""

    def __init__(self, periods: Mapping[str, PeriodKind], hierarchy: bool, grace_s: float) -> None:
        #: Feature -> its period kind (features not listed count per month); a dimension
        #: counter's is its feature's.
        self.periods: Mapping[str, PeriodKind] = ByFeature(periods)
        #: A call with ``at`` in an ended period counts until its end plus this (seconds).
        self.grace_s = grace_s
        #: ``acme/alice`` also counts on ``acme`` (ADR 0008): :meth:`levels` spreads keys.
        self.hierarchy = hierarchy
        # (tenant, feature) -> its validated key in the current period. Valid only within
        # [day_start, day_end): a stretch of the current UTC day inside which no period of
        # any calendar in use changes (a billing cycle's days start at its zone's midnight, its
        # months there too or at its anchor's time of day).
        self.cache: dict[tuple[str, str], Key] = {}
        self.day_start = 0.0
        self.day_end = 0.0
        #: The current day's period of each kind, made once a day (see new_day).
        self.day_periods: dict[PeriodKind, str] = {}
        # Names already validated, each the one copy every key made since shares: a name
        # decoded from a request is a new string each time, and a key keeps the strings of the
        # request that made it, so without these a million keys would hold a million copies
        # of a hundred feature names (and of each tenant's, and of the period). Bounded dicts,
        # not sys.intern: names come from clients, and interned strings are never freed on
        # 3.12 releases before the gh-113993 backport (August 2024) nor on free-threaded
        # builds. Not tied to the day: a name's validity never changes.
        self.tenants: dict[str, str] = {}
        self.features: dict[str, str] = {}
        self.period_names: dict[str, str] = {}
        #: Declared features (``set_feature``, meter.core.dims), as the limits' book has them
        #: (``None`` until they are first read).
        self.specs: Mapping[str, FeatureSpec] | None = None
        # Feature -> the trie of the dimension maps calls gave it that were checked already,
        # whatever the tenant, while the declarations do not change (:meth:`known_dims`): a
        # map is found again without a tuple made of it. One copy of each counter name,
        # shared by every tenant's keys.
        self._dims: dict[str, DimNode] = {}
        self._dim_nodes = 0
        #: Tenants with a billing cycle (``assign_plan``): each one's schedule
        #: (meter.core.cycles); any other tenant's periods are UTC calendar ones.
        self.cycles: Mapping[str, Schedule] = {}
        # The calendars those schedules use, and every instant one of them changes.
        self._calendars: list[Cycle] = []
        self._changes: list[float] = []

    def new_cycles(self, cycles: Mapping[str, Schedule]) -> None:
        """Name the periods of the tenants in ``cycles`` by their schedules from now on."""
        if cycles == self.cycles:
            return
        self.cycles = cycles
        # (a calendar no tenant has used for longer than its last period and the grace has
        # no period a call may still count in: its periods are no longer marked nor read)
        since = time.time() - CALENDAR_KEPT_S - self.grace_s
        self._calendars = sorted(
            {
                c
                for sched in cycles.values()
                for i, (_, c) in enumerate(sched)
                if c is not None and (i + 1 == len(sched) or sched[i + 1][0] > since)
            }
        )
        self._changes = sorted({start for sched in cycles.values() for start, _ in sched})
        self.day_end = 0.0  # (the next key_for starts the cache over)

    def schedule(self, tenant: str) -> Schedule | None:
        """``tenant``'s billing-cycle schedule (``None``: UTC calendar periods); with the
        hierarchy on, its root account's, so every level of a call counts in one period."""
        if self.hierarchy and "/" in tenant:
            tenant = tenant.split("/", 1)[0]
        return self.cycles.get(tenant) or None  # (no change kept: the UTC calendar)

    def calendars(self) -> list[Cycle | None]:
        """The calendars periods may follow: the UTC one and every billing cycle in use."""
        return [None, *self._calendars]

    def new_specs(self, specs: Mapping[str, FeatureSpec]) -> None:
        """Count by the declarations ``specs`` from now on."""
        self.specs = specs
        self._dims.clear()
        self._dim_nodes = 0

    def spec(self, feature: str) -> FeatureSpec:
        """How ``feature`` is declared (undeclared: a sum without dimensions);
        :class:`Unavailable` while the declarations were never read (storage unreachable
        since the start): a call giving dimensions cannot be checked yet."""
        specs = self.specs
        if specs is None:
            raise Unavailable("feature declarations are not read yet (storage unreachable); retry")
        return specs.get(feature, UNDECLARED)

    def spread(self, key: Key, pairs: Pairs, dims: dict[str, str] | None = None) -> list[Key]:
        """The keys a call giving dimensions ``pairs`` on ``key`` counts on: on every level
        (:meth:`levels`), the feature's total then its dimension counters (meter.core.dims);
        ``key`` first. ``dims``: the call's map as sent (checked: ``pairs``), remembered for
        :meth:`known_dims`."""
        if dims is None:
            return self.spread_names(key, (key[1], *counter_names(key[1], pairs)))
        node = self.known_dims(key[1], dims)
        names = node.names if node is not None else None
        if names is None:
            names = (key[1], *counter_names(key[1], pairs))
            self._remember(key[1], dims, names)
        return self.spread_names(key, names)

    def known_dims(self, feature: object, dims: dict[Any, Any]) -> DimNode | None:
        """Where ``dims``, exactly as sent (same names, values and order), ends in the trie
        of maps checked on ``feature`` before; ``None`` if it was not (check it)."""
        if type(feature) is not str:
            return None
        node = self._dims.get(feature)
        if node is None:
            return None
        for name, value in dims.items():
            if type(name) is not str or type(value) is not str:
                return None
            node = node.next.get(name)
            if node is None:
                return None
            node = node.next.get(value)
            if node is None:
                return None
        return node if node.names is not None else None

    def _remember(self, feature: str, dims: dict[str, str], names: tuple[str, ...]) -> None:
        if self._dim_nodes + 1 + 2 * len(dims) > DIM_NODES_SIZE:
            self._dims.clear()
            self._dim_nodes = 0
        node = self._dims.get(feature)
        if node is None:
            node = self._dims[feature] = DimNode()
            self._dim_nodes += 1
        for name, value in dims.items():
            for step in (name, value):
                after = node.next.get(step)
                if after is None:
                    after = node.next[step] = DimNode()
                    self._dim_nodes += 1
                node = after
        node.names = names

    def spread_names(self, key: Key, names: tuple[str, ...]) -> list[Key]:
        """:meth:`spread` of a call whose counters' names are known: ``names``."""
        if self.hierarchy and "/" in key[0]:
            return [(level[0], name, level[2]) for level in self.levels(key) for name in names]
        tenant, period = key[0], key[2]
        return [(tenant, name, period) for name in names]

    def valid_now(self, now: float) -> bool:
        """Whether the cached keys are those of the day containing ``now``."""
        return self.day_start <= now < self.day_end

    def key_for(self, tenant: object, feature: object, at: float | None = None) -> Key:
        """Validate names and build the key of the period containing ``at`` (default now)."""
        if at is None and type(tenant) is str and type(feature) is str:
            now = time.time()
            if self.day_start <= now < self.day_end:
                key = self.cache.get((tenant, feature))
                if key is not None:
                    return key
            else:
                self.new_day(now)
            t = self.tenants.get(tenant)
            if t is None:
                t = one_copy(self.tenants, check_tenant(tenant))
            f = self.features.get(feature)
            if f is None:
                f = one_copy(self.features, check_feature(feature))
            kind = self.periods.get(f, "month")
            schedule = self.schedule(t) if self.cycles else None
            if schedule is None:
                key = (t, f, self.day_periods[kind])
            else:
                key = (t, f, one_copy(self.period_names, self._named(schedule, kind, now)))
            if len(self.cache) >= KEY_CACHE_SIZE:
                self.cache.clear()
            self.cache[(t, f)] = key
            return key
        t = self.tenant(tenant)
        f = one_copy(self.features, check_feature(feature))
        return (t, f, one_copy(self.period_names, self.period_of(t, self.kind_of(f), at)))

    def period_of(self, tenant: str, kind: PeriodKind, at: float | None = None) -> str:
        """The name of ``tenant``'s period of ``kind`` holding ``at`` (default now)."""
        schedule = self.schedule(tenant) if self.cycles else None
        if schedule is None:
            return period_start(kind, at)
        return self._named(schedule, kind, time.time() if at is None else at)

    @staticmethod
    def _named(schedule: Schedule, kind: PeriodKind, at: float) -> str:
        try:
            return period_name(schedule, kind, at)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None

    def check_open(self, key: Key, at: float, now: float) -> None:
        """Raise :class:`PeriodClosed` if ``key``'s period (the one holding ``at``) ended
        ``grace_s`` or more before ``now``: a call may count there no more."""
        if at + self.grace_s >= now:
            return  # (its period ends after ``at``: open, whatever its kind; no date math)
        closes = bounds(key[2])[1] + self.grace_s
        if now >= closes:
            raise PeriodClosed(
                f"period {key[2]} of {key[1]!r} closed for calls at {closes:.0f} (its end plus"
                f" period_grace_s {self.grace_s:g}); nothing counted"
            )

    def tenant(self, tenant: object) -> str:
        """``tenant`` validated, as this node's one copy of the name."""
        if type(tenant) is str:
            t = self.tenants.get(tenant)
            if t is not None:
                return t
        return one_copy(self.tenants, check_tenant(tenant))

    def feature(self, feature: str) -> str:
        """This node's one copy of the (validated) feature name ``feature``."""
        return one_copy(self.features, feature)

    def period(self, period: str) -> str:
        """This node's one copy of the period name ``period``."""
        return one_copy(self.period_names, period)

    def kinds(self) -> set[PeriodKind]:
        """The period kinds counters have: ``month`` and any configured."""
        return {"month", *self.periods.values()}

    def kind_of(self, feature: str) -> PeriodKind:
        """The period kind of ``feature``."""
        return self.periods.get(feature, "month")

    def current_keys(self, keys: Iterable[Key], limit: int) -> tuple[list[Key], int]:
        """The first ``limit`` keys of ``keys`` whose period is the current one for their
        feature, each made of this node's one copy of its names, and how many keys were passed
        over for a period that is not current (recovery's warm-up: names from the log were
        validated when their calls were accepted)."""
        now = time.time()
        if not self.day_start <= now < self.day_end:
            self.new_day(now)
        current = self.day_periods
        periods = self.periods
        tenants, features = self.tenants, self.features
        cycles = self.cycles
        named: dict[tuple[Schedule, PeriodKind], str] = {}
        out: list[Key] = []
        skipped = 0
        for t, f, p in keys:
            if len(out) >= limit:
                break
            kind = periods.get(f, "month")
            schedule = self.schedule(t) if cycles else None
            if schedule is None:
                period = current[kind]
            else:
                period = named.get((schedule, kind)) or named.setdefault(
                    (schedule, kind), self._current(schedule, kind, now)
                )
            if p != period:
                skipped += 1
                continue
            # (A dimension counter's name is not added to the validated names: key_for trusts
            # those, and a call may not name one.)
            name = f if is_dimension(f) else features.get(f) or one_copy(features, f)
            out.append((tenants.get(t) or one_copy(tenants, t), name, period))
        return out, skipped

    def _current(self, schedule: Schedule, kind: PeriodKind, now: float) -> str:
        try:
            return one_copy(self.period_names, period_name(schedule, kind, now))
        except ValueError:
            return ""  # (no period: no key is of it)

    def is_current(self, key: Key, now: float) -> bool:
        """Whether ``key`` is of its tenant's current period of its feature's kind."""
        if not self.day_start <= now < self.day_end:
            self.new_day(now)
        kind = self.periods.get(key[1], "month")
        schedule = self.schedule(key[0]) if self.cycles else None
        if schedule is None:
            return key[2] == self.day_periods[kind]
        return key[2] == self._current(schedule, kind, now)

    def new_day(self, now: float) -> None:
        """Start the key cache over for the stretch of the UTC day containing ``now`` in
        which no calendar in use changes period."""
        self.cache.clear()
        start = now - now % 86400
        end = start + 86400
        for c in self._calendars:  # (a cycle's months start at one of its days' start, or
            # at its anchor's time of day)
            for kind in ("day", "month") if c.minute else ("day",):
                try:
                    cut_start, cut_end = bounds(named_periods.name(c, kind, now))
                except ValueError:
                    continue
                start, end = max(start, cut_start), min(end, cut_end)
        i = bisect.bisect_right(self._changes, now)
        if i:
            start = max(start, self._changes[i - 1])
        if i < len(self._changes):
            end = min(end, self._changes[i])
        self.day_start, self.day_end = start, end
        names = self.period_names
        self.day_periods = {
            "month": one_copy(names, period_start("month", now)),
            "day": one_copy(names, period_start("day", now)),
        }

    def next_keys(
        self, kind: PeriodKind, now: float, keys: Iterable[Key], calendar: Cycle | None = None
    ) -> list[Key]:
        """The next period's key of each of ``keys`` in the period of ``kind`` in
        ``calendar`` (``None``: UTC) holding ``now`` (:mod:`meter.core.periods`), sharing this
        node's copy of the period name."""
        current = one_copy(self.period_names, named_periods.name(calendar, kind, now))
        upcoming = one_copy(self.period_names, following(current))
        return next_keys(keys, kind, current, upcoming, self.periods)

    def levels(self, key: Key) -> list[Key]:
        """``key`` and, with the tenant hierarchy on, the same counter of every ancestor of
        its tenant, leaf first: ``acme/alice`` -> ``[acme/alice, acme]``."""
        tenant = key[0]
        if not self.hierarchy or "/" not in tenant:
            return [key]
        parts = tenant.split("/")
        if len(parts) > MAX_LEVELS:
            raise InvalidArgument(
                f"tenant {tenant[:64]!r} has {len(parts)} levels; at most {MAX_LEVELS}"
            )
        if "" in parts:
            raise InvalidArgument(f"tenant {tenant[:64]!r} has an empty level")
        names = self.tenants
        return [key] + [
            (one_copy(names, "/".join(parts[:n])), key[1], key[2])
            for n in range(len(parts) - 1, 0, -1)
        ]

    def levels_or_leaf(self, key: Key) -> list[Key]:
        """:meth:`levels`, or just ``key`` if its name has too many or empty levels (then it
        is refused when counted)."""
        try:
            return self.levels(key)
        except InvalidArgument:
            return [key]


def one_copy(names: dict[str, str], name: str) -> str:
    """The copy of ``name`` kept in ``names`` (``name`` itself, kept, if none yet)."""
    kept = names.get(name)
    if kept is None:
        if len(names) >= NAME_CACHE_SIZE:
            names.clear()
        names[name] = kept = name
    return kept
