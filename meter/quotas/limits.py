"""Plans, per-tenant overrides and the effective limit of a (tenant, feature). Pure: no I/O.

A *plan* maps features to limits; each tenant may be assigned one plan and may have overrides
of single features. The effective limit of ``(tenant, feature)`` is the override, else the
tenant's plan's feature, else none (docs/quotas.md).

Storage keeps the limits as opaque records ``(scope, name, feature, body)`` plus a version
that every change bumps (:mod:`storage.base`); this module turns records into a
:class:`LimitBook` and back. The book answers the hot path on demand (:attr:`LimitBook.by_pair`:
the override, else the tenant's plan's feature; nothing is built per tenant x feature, so a
change costs the same with 100,000 tenants on 20-feature plans), and is falsy when no limit
exists anywhere.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from meter.core.cycles import Schedule
from meter.core.cycles import decode as decode_schedule
from meter.core.cycles import encode as encode_schedule
from meter.core.dims import FeatureSpec, parse_shown, spec_body, spec_from_body, where_limit
from meter.core.keys import QTY_MAX, check_feature
from meter.errors import InvalidArgument

Kind = Literal["hard", "soft"]
Enforcement = Literal["fast", "strict"]
KINDS: tuple[Kind, ...] = ("hard", "soft")
ENFORCEMENTS: tuple[Enforcement, ...] = ("fast", "strict")

#: Most features in one plan (a plan is one stored record).
MAX_PLAN_FEATURES = 1000
#: Plan names: like feature names.
PLAN_RE = re.compile(r"[A-Za-z0-9_\-.:]+")
MAX_PLAN_BYTES = 128

#: Record scopes, as storage keeps them.
PLAN = "plan"  # name = plan, feature = "", body = {feature: limit spec} as JSON
ASSIGN = "assign"  # name = tenant, feature = "", body = plan name
OVERRIDE = "limit"  # name = tenant, feature = feature, body = limit spec as JSON
DECLARE = "feature"  # name = feature, feature = "", body = its declaration (meter.core.dims)
CYCLE = "cycle"  # name = tenant, feature = "", body = its schedule (meter.core.cycles)
SCOPES = (PLAN, ASSIGN, OVERRIDE, DECLARE, CYCLE)

Record = tuple[str, str, str, str]
"""``(scope, name, feature, body)``."""

SOFT_STRICT = "a soft limit never refuses, so it cannot be strict; strict limits are hard"

#: Most credits one unit of a credit-metered feature may cost (docs/ledger.md).
PRICE_MAX = 10**12
#: Alert thresholds of one limit: at most this many percentages, each 1..ALERT_PCT_MAX.
MAX_ALERTS = 10
ALERT_PCT_MAX = 1000


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit: at most ``limit`` units per counting period."""

    limit: int
    kind: Kind = "hard"
    enforcement: Enforcement = "fast"
    #: Alert thresholds in percent of ``limit`` (sorted, distinct; empty: no alerts).
    alerts: tuple[int, ...] = ()
    #: Credits one unit costs (0: the feature is not credit-metered; docs/ledger.md).
    price: int = 0

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "limit": self.limit,
            "kind": self.kind,
            "enforcement": self.enforcement,
        }
        if self.alerts:  # (absent when none: records without alerts stay as they were)
            out["alerts"] = list(self.alerts)
        if self.price:
            out["price"] = self.price
        return out


@dataclass(frozen=True, slots=True)
class Effective:
    """The limit that applies to one (tenant, feature), and where it comes from:
    ``"override"`` or ``"plan:<name>"``."""

    limit: int
    kind: Kind
    enforcement: Enforcement
    source: str
    #: Alert thresholds in percent of ``limit`` (sorted, distinct; empty: no alerts).
    alerts: tuple[int, ...] = ()
    #: Credits one unit costs (0: not credit-metered).
    price: int = 0

    @property
    def hard(self) -> bool:
        return self.kind == "hard"

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "limit": self.limit,
            "kind": self.kind,
            "enforcement": self.enforcement,
            "source": self.source,
        }
        if self.alerts:
            out["alerts"] = list(self.alerts)
        if self.price:
            out["price"] = self.price
        return out


def check_plan_name(name: object) -> str:
    """``name`` if it is a valid plan name, else :class:`InvalidArgument`."""
    if isinstance(name, bytes | bytearray):
        try:
            name = bytes(name).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument("plan is not valid UTF-8") from None
    if not isinstance(name, str):
        raise InvalidArgument(f"plan must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidArgument("plan must not be empty")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_PLAN_BYTES:
        raise InvalidArgument(f"plan is longer than {MAX_PLAN_BYTES} bytes")
    if PLAN_RE.fullmatch(name) is None:
        raise InvalidArgument(f"plan {name[:64]!r} has characters outside {PLAN_RE.pattern}")
    return name


def parse_alerts(value: object, what: str = "limit") -> tuple[int, ...]:
    """A limit's ``alerts``: a list of at most :data:`MAX_ALERTS` distinct integer
    percentages 1..:data:`ALERT_PCT_MAX`, returned sorted; :class:`InvalidArgument` names
    ``what`` otherwise."""
    if not isinstance(value, list | tuple):
        raise InvalidArgument(
            f"{what}: alerts must be a list of percentages, got {type(value).__name__}"
        )
    if len(value) > MAX_ALERTS:
        raise InvalidArgument(f"{what}: alerts has {len(value)} thresholds; at most {MAX_ALERTS}")
    seen: set[int] = set()
    for pct in value:
        if isinstance(pct, bool) or not isinstance(pct, int):
            raise InvalidArgument(
                f"{what}: each of alerts must be an integer percentage, got {type(pct).__name__}"
            )
        if not 1 <= pct <= ALERT_PCT_MAX:
            raise InvalidArgument(f"{what}: alerts must be 1..{ALERT_PCT_MAX} (percent), got {pct}")
        if pct in seen:
            raise InvalidArgument(f"{what}: alerts lists {pct} twice")
        seen.add(pct)
    return tuple(sorted(seen))


def parse_limit(spec: object, what: str = "limit") -> Limit:
    """A limit spec ``{limit, kind?, enforcement?, alerts?}`` validated (``kind`` defaults to
    hard, ``enforcement`` to fast, ``alerts`` to none); :class:`InvalidArgument` names ``what``
    otherwise."""
    if isinstance(spec, dict) and "price" in spec:  # credit-metered: a limit is optional
        if "alerts" in spec and "limit" not in spec:
            raise InvalidArgument(f"{what}: alerts are percentages of a limit: give a limit")
        rest = {k: v for k, v in spec.items() if k != "price"}
        rest.setdefault("limit", QTY_MAX)
        return replace(parse_limit(rest, what), price=parse_price(spec["price"], what))
    if isinstance(spec, dict) and "alerts" in spec:  # the rest first, then the thresholds
        rest = {k: v for k, v in spec.items() if k != "alerts"}
        parsed = parse_limit(rest, what)
        alerts = parse_alerts(spec["alerts"], what)
        if alerts and parsed.limit == 0:
            raise InvalidArgument(f"{what}: alerts are percentages of a limit: 0 has none")
        return replace(parsed, alerts=alerts)
    if not isinstance(spec, dict):
        raise InvalidArgument(
            f"{what} must be a map {{limit, kind, enforcement, alerts}}, got {type(spec).__name__}"
        )
    for name in spec:
        if name not in ("limit", "kind", "enforcement"):
            raise InvalidArgument(
                f"{what}: unknown field {str(name)[:32]!r} "
                "(allowed: alerts, enforcement, kind, limit, price)"
            )
    if "limit" not in spec:
        raise InvalidArgument(f"{what}: limit is missing")
    n = spec["limit"]
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidArgument(f"{what}: limit must be an integer, got {type(n).__name__}")
    if not 0 <= n <= QTY_MAX:
        raise InvalidArgument(f"{what}: limit must be 0..{QTY_MAX}, got {n}")
    kind = spec.get("kind", "hard")
    if kind not in KINDS:
        raise InvalidArgument(f"{what}: kind must be hard or soft, got {str(kind)[:32]!r}")
    enforcement = spec.get("enforcement", "fast")
    if enforcement not in ENFORCEMENTS:
        raise InvalidArgument(
            f"{what}: enforcement must be fast or strict, got {str(enforcement)[:32]!r}"
        )
    if enforcement == "strict" and kind == "soft":
        raise InvalidArgument(f"{what}: {SOFT_STRICT}")
    return Limit(n, kind, enforcement)


def parse_price(value: object, what: str = "limit") -> int:
    """A feature's price in credits per unit: an integer 1..PRICE_MAX."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what}: price must be an integer, got {type(value).__name__}")
    if not 1 <= value <= PRICE_MAX:
        raise InvalidArgument(f"{what}: price must be 1..{PRICE_MAX} credits a unit, got {value}")
    return value


def parse_features(spec: object) -> dict[str, Limit]:
    """A plan's ``{feature: limit spec}`` map, validated."""
    if not isinstance(spec, dict):
        raise InvalidArgument(f"plan features must be a map, got {type(spec).__name__}")
    if len(spec) > MAX_PLAN_FEATURES:
        raise InvalidArgument(f"a plan has at most {MAX_PLAN_FEATURES} features")
    out: dict[str, Limit] = {}
    for name, limit in spec.items():
        f = limit_feature(name)
        out[f] = parse_limit(limit, f"feature {name!r}")
    return out


def limit_feature(name: object, where: object = None) -> str:
    """The counter a limit is on: a feature, or one dimension value of it given as ``where``
    (``{name: value}``) or written ``feature{name=value}`` (plans)."""
    if isinstance(name, str) and where is None:
        name, dims = parse_shown(name)
        if dims:
            where = dims
    feature = check_feature(name)
    return feature if where is None else where_limit(feature, where)


# -- records ---------------------------------------------------------------------------------


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def plan_record(name: str, features: Mapping[str, Limit]) -> Record:
    return (PLAN, name, "", _dump({f: lim.to_wire() for f, lim in features.items()}))


def assign_record(tenant: str, plan: str | None) -> tuple[str, str, str, str | None]:
    """The record assigning ``plan`` to ``tenant`` (body ``None``: unassign)."""
    return (ASSIGN, tenant, "", plan)


def cycle_record(tenant: str, schedule: Schedule) -> Record:
    """The record of ``tenant``'s billing-cycle schedule (meter.core.cycles)."""
    return (CYCLE, tenant, "", encode_schedule(schedule))


def override_record(
    tenant: str, feature: str, limit: Limit | None
) -> tuple[str, str, str, str | None]:
    """The record of an override (body ``None``: clear it)."""
    return (OVERRIDE, tenant, feature, None if limit is None else _dump(limit.to_wire()))


def declare_record(feature: str, spec: FeatureSpec) -> Record:
    """The record declaring ``feature`` (meter.core.dims)."""
    return (DECLARE, feature, "", spec_body(spec))


def _stored_limit(value: Any) -> Limit:
    """A stored limit spec; strict ones written by a later build are kept as they are."""
    if not isinstance(value, dict):
        raise ValueError("not a map")
    n, kind, enforcement = value.get("limit"), value.get("kind"), value.get("enforcement")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= QTY_MAX:
        raise ValueError(f"bad limit {n!r}")
    if kind not in KINDS or enforcement not in ENFORCEMENTS:
        raise ValueError(f"bad kind or enforcement {kind!r} {enforcement!r}")
    alerts: tuple[int, ...] = ()
    if "alerts" in value:
        try:
            alerts = parse_alerts(value["alerts"])
        except InvalidArgument as exc:
            raise ValueError(f"bad alerts: {exc.message}") from None
    price = 0
    if "price" in value:
        try:
            price = parse_price(value["price"])
        except InvalidArgument as exc:
            raise ValueError(f"bad price: {exc.message}") from None
    return Limit(n, kind, enforcement, alerts, price)


# -- the book --------------------------------------------------------------------------------

Pair = tuple[str, str]
"""``(tenant, feature)``."""


class PairLimits:
    """``(tenant, feature)`` -> its effective limit, looked up when asked: the override, else
    the feature of the tenant's plan. Falsy when no pair has a limit."""

    __slots__ = ("_assigned", "_overrides", "_plans", "count")

    def __init__(
        self,
        overrides: dict[Pair, Effective],
        assigned: dict[str, str],
        plans: dict[str, dict[str, Effective]],
    ) -> None:
        self._overrides = overrides
        self._assigned = assigned
        self._plans = plans
        #: How many pairs have a limit (counted once per change, for ``status``).
        self.count = sum(len(plans.get(plan, ())) for plan in assigned.values()) + sum(
            1
            for tenant, feature in overrides
            if feature not in plans.get(assigned.get(tenant, ""), ())
        )

    def get(self, pair: Pair) -> Effective | None:
        eff = self._overrides.get(pair)
        if eff is not None:
            return eff
        plan = self._assigned.get(pair[0])
        if plan is None:
            return None
        features = self._plans.get(plan)
        return None if features is None else features.get(pair[1])

    def __contains__(self, pair: object) -> bool:
        return isinstance(pair, tuple) and len(pair) == 2 and self.get(pair) is not None

    def __bool__(self) -> bool:
        return self.count > 0

    def __len__(self) -> int:
        return self.count


@dataclass(slots=True)
class LimitBook:
    """Every plan, assignment and override a node knows, as of storage version ``version``."""

    version: int = 0
    plans: dict[str, dict[str, Limit]] = field(default_factory=dict)
    assigned: dict[str, str] = field(default_factory=dict)
    overrides: dict[tuple[str, str], Limit] = field(default_factory=dict)
    #: (tenant, feature) -> its effective limit, looked up on demand (the hot path's).
    by_pair: PairLimits = field(default_factory=lambda: PairLimits({}, {}, {}))
    #: Records that could not be decoded (``(scope, name, feature)`` and why), skipped.
    bad: list[tuple[tuple[str, str, str], str]] = field(default_factory=list)
    #: Whether any limit has alert thresholds (the hot path's one test for alerts).
    alerting: bool = False
    #: Declared features (``set_feature``), by name.
    features: dict[str, FeatureSpec] = field(default_factory=dict)
    #: Tenants with a billing cycle (``assign_plan``'s anchor): each one's schedule.
    cycles: dict[str, Schedule] = field(default_factory=dict)

    @classmethod
    def from_records(cls, version: int, records: Iterable[Record]) -> LimitBook:
        """The book of storage version ``version``; undecodable records, and undecodable
        features of a plan, are listed in :attr:`bad` and skipped (one bad record or feature
        must not lift every other limit)."""
        book = cls(version)
        for scope, name, feature, body in records:
            try:
                if scope == PLAN:
                    raw = json.loads(body)
                    if not isinstance(raw, dict):
                        raise ValueError("plan body is not a map")
                    plan: dict[str, Limit] = {}
                    for f, v in raw.items():
                        try:
                            plan[str(f)] = _stored_limit(v)
                        except (ValueError, TypeError) as exc:  # only this feature is lost
                            book.bad.append(((scope, name, str(f)), str(exc)))
                    book.plans[name] = plan
                elif scope == ASSIGN:
                    book.assigned[name] = body
                elif scope == OVERRIDE:
                    book.overrides[(name, feature)] = _stored_limit(json.loads(body))
                elif scope == DECLARE:
                    book.features[name] = spec_from_body(body)
                elif scope == CYCLE:
                    book.cycles[name] = decode_schedule(body)
                else:
                    raise ValueError(f"unknown scope {scope!r}")
            except (ValueError, TypeError) as exc:
                book.bad.append(((scope, name, feature), str(exc)))
        book._index()
        return book

    def _index(self) -> None:
        # Per plan and per override, never per tenant x feature (see the module doc).
        plans = {
            name: {
                f: Effective(
                    lim.limit, lim.kind, lim.enforcement, f"plan:{name}", lim.alerts, lim.price
                )
                for f, lim in features.items()
            }
            for name, features in self.plans.items()
        }
        overrides = {
            pair: Effective(lim.limit, lim.kind, lim.enforcement, "override", lim.alerts, lim.price)
            for pair, lim in self.overrides.items()
        }
        self.by_pair = PairLimits(overrides, self.assigned, plans)
        self.alerting = any(lim.alerts for lim in self.overrides.values()) or any(
            lim.alerts for features in self.plans.values() for lim in features.values()
        )

    def effective(self, tenant: str, feature: str) -> Effective | None:
        """The limit on ``(tenant, feature)``, ``None`` if there is none."""
        return self.by_pair.get((tenant, feature))

    def for_tenant(self, tenant: str) -> dict[str, Effective]:
        """Every effective limit of ``tenant``, by feature."""
        out: dict[str, Effective] = {}
        plan = self.assigned.get(tenant)
        if plan is not None:
            for feature in self.plans.get(plan, {}):
                eff = self.by_pair.get((tenant, feature))
                if eff is not None:
                    out[feature] = eff
        for t, feature in self.overrides:
            if t == tenant:
                eff = self.by_pair.get((t, feature))
                if eff is not None:
                    out[feature] = eff
        return out


def plans_from_toml(data: Mapping[str, Any], where: str) -> dict[str, dict[str, Limit]]:
    """The plans of a plans file: ``[plans.NAME]`` tables of ``feature = LIMIT`` (hard, fast)
    or ``feature = {limit = N, kind = "soft", alerts = [80, 100]}``; :class:`InvalidArgument`
    names the first bad entry (``where``: the file, for the message)."""
    for key in data:
        if key != "plans":
            raise InvalidArgument(f"{where}: unknown key {key!r} (only [plans.NAME] tables)")
    plans = data.get("plans", {})
    if not isinstance(plans, dict):
        raise InvalidArgument(f"{where}: plans must be tables [plans.NAME]")
    out: dict[str, dict[str, Limit]] = {}
    for name, features in plans.items():
        try:
            plan = check_plan_name(name)
            if not isinstance(features, dict):
                raise InvalidArgument("must be a table of feature = limit")
            specs = {f: {"limit": v} if type(v) is int else v for f, v in features.items()}
            out[plan] = parse_features(specs)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}: plan {str(name)[:64]!r}: {exc.message}") from None
    return out
