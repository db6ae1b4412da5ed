"""Declared features and their dimensions: the declarations, the dimension counters' names,
and a group-by over them. Pure: no I/O.

A feature is declared once, fleet-wide (``set_feature``; stored with the limits, so versioned
and propagated like plans): its aggregation, the dimension names a call may give, and a bound
on its dimension counters. An undeclared feature is a sum without dimensions.

A call that gives dimensions counts, besides on the feature's counter (its *total*), on
ordinary counters named after them (docs/dimensions.md): one per dimension value given (a
*value counter*: ``tokens`` + ``\\x1f`` + ``model=gpt-4``, every call that gave that value,
whatever else it gave) and, when it gives two or more, one for the combination it gave (``tokens`` +
``\\x1e`` + ``model=gpt-4`` + ``\\x1f`` + ``region=eu``). They are flushed, gossiped, seeded,
logged and limited like any counter. The separators are control characters, which no feature
name, dimension name or dimension value may hold, so a name decodes one way only, and every
counter of a feature sorts right after it (``feature`` .. ``feature\\x1f\\U0010ffff``): one
range read lists them.

The combinations and the value counters together say exactly what each group of any group-by
holds: a value counter less the combinations holding its value is what calls gave with that
value alone, and the total less everything is what calls gave with no dimension
(:func:`group`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from meter.errors import InvalidArgument

Aggregation = Literal["sum", "max", "latest", "unique"]
#: The aggregations a feature may be declared with (docs/dimensions.md): ``sum`` counts units;
#: ``max`` and ``latest`` are gauges (:mod:`meter.core.gauges`), whose calls observe values;
#: ``unique`` counts distinct values (:mod:`meter.core.uniques`).
AGGREGATIONS: tuple[Aggregation, ...] = ("sum", "max", "latest", "unique")

#: Most dimensions a feature may declare.
MAX_DIMENSIONS = 4
#: Longest dimension name, in UTF-8 bytes; names are like feature names.
MAX_DIM_NAME_BYTES = 32
DIM_NAME_RE = re.compile(r"[A-Za-z0-9_\-.:]+")
#: Longest dimension value, in UTF-8 bytes; values are printable strings.
MAX_DIM_VALUE_BYTES = 64
#: The default and the largest bound on a feature's dimension counters per tenant and period.
DEFAULT_MAX_COMBINATIONS = 1000
MAX_COMBINATIONS_CAP = 100_000

#: Between a feature and a value counter's ``name=value``, and between a combination's pairs.
VALUE = "\x1f"
#: Between a feature and a combination's pairs.
COMBINATION = "\x1e"
#: Every counter name of a feature sorts in ``feature`` .. ``feature + LAST``.
LAST = "\x1f\U0010ffff"

Pairs = tuple[tuple[str, str], ...]
"""A call's dimensions, ``((name, value), ...)`` in the feature's declared order."""


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """What a feature is declared as (the defaults: an undeclared feature)."""

    aggregation: Aggregation = "sum"
    dimensions: tuple[str, ...] = ()
    #: Most dimension counters per (tenant, feature, period): one per distinct value of each
    #: dimension, one per distinct combination of two or more.
    max_combinations: int = DEFAULT_MAX_COMBINATIONS

    def to_wire(self) -> dict[str, Any]:
        """The declaration as ``set_feature`` takes it and ``get_feature`` answers it."""
        return {
            "aggregation": self.aggregation,
            "dimensions": list(self.dimensions),
            "max_combinations": self.max_combinations,
        }


UNDECLARED = FeatureSpec()

_SPEC_FIELDS = frozenset({"aggregation", "dimensions", "max_combinations"})


def check_dim_name(name: object) -> str:
    """``name`` if it is a valid dimension name, else :class:`InvalidArgument`."""
    if not isinstance(name, str):
        raise InvalidArgument(f"dimension name must be a string, got {type(name).__name__}")
    if not name or len(name.encode("utf-8", "surrogatepass")) > MAX_DIM_NAME_BYTES:
        raise InvalidArgument(f"dimension name must be 1..{MAX_DIM_NAME_BYTES} bytes")
    if DIM_NAME_RE.fullmatch(name) is None:
        raise InvalidArgument(
            f"dimension name {name[:32]!r} has characters outside {DIM_NAME_RE.pattern}"
        )
    return name


def check_dim_value(name: str, value: object) -> str:
    """``value`` if it is a valid value of dimension ``name``, else :class:`InvalidArgument`."""
    if not isinstance(value, str):
        raise InvalidArgument(
            f"dimension {name!r}: value must be a string, got {type(value).__name__}"
        )
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # invalid UTF-8 from the wire, decoded with surrogateescape
        raise InvalidArgument(f"dimension {name!r}: value is not valid UTF-8") from None
    if not 1 <= size <= MAX_DIM_VALUE_BYTES:
        raise InvalidArgument(f"dimension {name!r}: value must be 1..{MAX_DIM_VALUE_BYTES} bytes")
    if not value.isprintable():
        raise InvalidArgument(f"dimension {name!r}: value {value[:32]!r} is not printable")
    return value


def parse_spec(feature: str, options: object) -> FeatureSpec:
    """``set_feature``'s options, validated: ``{aggregation?, dimensions?, max_combinations?}``."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise InvalidArgument(f"set_feature: options must be a map, got {type(options).__name__}")
    for field in options:
        if field not in _SPEC_FIELDS:
            raise InvalidArgument(
                f"set_feature: unknown option {str(field)[:32]!r} "
                f"(allowed: {', '.join(sorted(_SPEC_FIELDS))})"
            )
    aggregation = options.get("aggregation", "sum")
    if aggregation not in AGGREGATIONS:
        raise InvalidArgument(
            f"set_feature {feature!r}: aggregation must be one of {', '.join(AGGREGATIONS)}, "
            f"got {str(aggregation)[:32]!r}"
        )
    names = options.get("dimensions", [])
    if not isinstance(names, list | tuple):
        raise InvalidArgument(
            f"set_feature {feature!r}: dimensions must be a list of names, "
            f"got {type(names).__name__}"
        )
    if len(names) > MAX_DIMENSIONS:
        raise InvalidArgument(
            f"set_feature {feature!r}: {len(names)} dimensions; at most {MAX_DIMENSIONS}"
        )
    dims = tuple(check_dim_name(n) for n in names)
    if len(set(dims)) != len(dims):
        raise InvalidArgument(f"set_feature {feature!r}: a dimension is named twice")
    if dims and aggregation != "sum":
        raise InvalidArgument(
            f"set_feature {feature!r}: dimensions on a {aggregation} feature are not supported "
            "yet (only on sums)"
        )
    bound = options.get("max_combinations", DEFAULT_MAX_COMBINATIONS)
    if isinstance(bound, bool) or not isinstance(bound, int):
        raise InvalidArgument(
            f"set_feature {feature!r}: max_combinations must be an integer, "
            f"got {type(bound).__name__}"
        )
    if not 1 <= bound <= MAX_COMBINATIONS_CAP:
        raise InvalidArgument(
            f"set_feature {feature!r}: max_combinations must be 1..{MAX_COMBINATIONS_CAP}, "
            f"got {bound}"
        )
    return FeatureSpec(cast(Aggregation, aggregation), dims, bound)


def spec_body(spec: FeatureSpec) -> str:
    """The stored body of a declaration."""
    return json.dumps(spec.to_wire(), sort_keys=True, separators=(",", ":"))


def spec_from_body(body: str) -> FeatureSpec:
    """A stored declaration; :class:`ValueError` if it cannot be read (a later build's
    aggregation included: the node then treats the feature as undeclared and says so)."""
    raw = json.loads(body)
    if not isinstance(raw, dict):
        raise ValueError("not a map")
    try:
        return parse_spec("(stored)", raw)
    except InvalidArgument as exc:
        raise ValueError(exc.message) from None


# -- counter names ---------------------------------------------------------------------------


def check_dims(feature: str, spec: FeatureSpec, dims: object, what: str = "dims") -> Pairs:
    """A call's ``dims`` map (or a read's ``where``: ``what``) checked against ``feature``'s
    declaration, as pairs in declared order (empty: the call gave none)."""
    if not isinstance(dims, dict):
        raise InvalidArgument(f"{what} must be a map of name to value, got {type(dims).__name__}")
    if not dims:
        return ()
    declared = spec.dimensions
    for name in dims:
        if name not in declared:
            if not declared:
                raise InvalidArgument(
                    f"feature {feature!r} declares no dimensions (set_feature it first)"
                )
            raise InvalidArgument(
                f"feature {feature!r} has no dimension {str(name)[:32]!r} "
                f"(declared: {', '.join(declared)})"
            )
    return tuple((n, check_dim_value(n, dims[n])) for n in declared if n in dims)


def value_counter(feature: str, name: str, value: str) -> str:
    """The counter name of ``feature``'s units given with ``name=value``."""
    return f"{feature}{VALUE}{name}={value}"


def counter_names(feature: str, pairs: Pairs) -> list[str]:
    """The dimension counters a call giving ``pairs`` counts on besides ``feature``: a
    value counter per pair and, for two or more, their combination."""
    out = [value_counter(feature, n, v) for n, v in pairs]
    if len(pairs) > 1:
        out.append(name_of(feature, pairs))
    return out


def name_of(feature: str, pairs: Pairs) -> str:
    """The counter of ``feature`` that ``pairs`` names: the total (none), a value counter (one)
    or a combination (more); :func:`decode`'s inverse."""
    if not pairs:
        return feature
    if len(pairs) == 1:
        return value_counter(feature, *pairs[0])
    return feature + COMBINATION + VALUE.join(f"{n}={v}" for n, v in pairs)


def is_dimension(name: str) -> bool:
    """Whether a counter name is a dimension counter (it holds a separator)."""
    return VALUE in name or COMBINATION in name


def decode(name: str) -> tuple[str, Pairs, bool]:
    """``(feature, pairs, combination)`` of a counter name; ``pairs`` is empty for a total."""
    cut = len(name)
    for sep in (VALUE, COMBINATION):
        at = name.find(sep)
        if 0 <= at < cut:
            cut = at
    if cut == len(name):
        return name, (), False
    combination = name[cut] == COMBINATION
    pairs = tuple(_pair(part) for part in name[cut + 1 :].split(VALUE))
    return name[:cut], pairs, combination


def _pair(part: str) -> tuple[str, str]:
    name, _, value = part.partition("=")
    return name, value


def where_name(feature: str, spec: FeatureSpec, where: object) -> str:
    """The counter of ``feature`` a ``where`` map names: ``{}`` the total, one dimension
    value its value counter (the only counters limits and reads may name besides the total)."""
    pairs = check_dims(feature, spec, where, "where")
    if not pairs:
        return feature
    if len(pairs) > 1:
        raise InvalidArgument(
            "where names one dimension value (a limit or a read of one group); "
            "use group_by to read combinations"
        )
    return value_counter(feature, *pairs[0])


def where_limit(feature: str, where: object) -> str:
    """The counter a limit with ``where`` (one dimension value, ``{name: value}``) is on; the
    dimension need not be declared yet (a limit may come before its feature's declaration)."""
    if not isinstance(where, dict) or len(where) != 1:
        raise InvalidArgument("where must name one dimension value: {name: value}")
    ((name, value),) = where.items()
    return value_counter(feature, check_dim_name(name), check_dim_value(str(name), value))


def shown(name: str) -> str:
    """A counter name as people read it: ``tokens{model=gpt-4}``, ``tokens{model=a,region=b}``."""
    feature, pairs, _ = decode(name)
    if not pairs:
        return name
    return feature + "{" + ",".join(f"{n}={v}" for n, v in pairs) + "}"


def parse_shown(text: str) -> tuple[str, dict[str, str]]:
    """``tokens{model=gpt-4}`` -> ``("tokens", {"model": "gpt-4"})`` (plans files): a
    feature and one dimension value; a name without braces has none."""
    if not text.endswith("}") or "{" not in text:
        return text, {}
    feature, _, inner = text[:-1].partition("{")
    name, eq, value = inner.partition("=")
    if not eq:
        raise InvalidArgument(f"{text[:64]!r}: write a dimension value as feature{{name=value}}")
    return feature, {name: value}


# -- group-by --------------------------------------------------------------------------------


def check_group_by(feature: str, spec: FeatureSpec, group_by: object) -> tuple[str, ...]:
    """A ``group_by`` list: distinct names of ``feature``'s declared dimensions."""
    if not isinstance(group_by, list | tuple) or not group_by:
        raise InvalidArgument("group_by must be a non-empty list of dimension names")
    names: list[str] = []
    for name in group_by:
        if name not in spec.dimensions:
            raise InvalidArgument(
                f"feature {feature!r} has no dimension {str(name)[:32]!r}"
                + (f" (declared: {', '.join(spec.dimensions)})" if spec.dimensions else "")
            )
        if name in names:
            raise InvalidArgument(f"group_by names {name!r} twice")
        names.append(name)
    return tuple(names)


#: Stands for "no value" in a group's values while groups are summed and sorted: above every
#: value (no value is a non-character), so those groups sort last.
_NONE = "\U0010ffff"


def group(
    total: int,
    counters: Mapping[str, int],
    group_by: tuple[str, ...],
    decoded: dict[str, tuple[Pairs, dict[str, str] | None]] | None = None,
) -> dict[str, Any]:
    """``{"total", "groups"}``: ``counters`` (a feature's dimension counters by name, its
    total's excluded) summed by the values of ``group_by``; calls that gave none of a name
    are in the group where it is ``None``. The groups add up to ``total``; empty ones are
    left out, the others are in the order of their values. ``decoded``: names decoded
    before, kept by the caller (:func:`parts`)."""
    if decoded is None:
        decoded = {}
    sums: dict[tuple[str, ...], int] = {}
    alone: dict[tuple[str, str], int] = {}
    rest = total
    for name, value in counters.items():
        pairs, given = parts(name, decoded)
        if given is not None:  # a combination: the calls that gave exactly these values
            rest -= value
            at = tuple([given.get(g, _NONE) for g in group_by])
            sums[at] = sums.get(at, 0) + value
            for pair in pairs:  # (a value counter holds its combinations' units too)
                alone[pair] = alone.get(pair, 0) - value
        elif pairs:
            pair = pairs[0]
            alone[pair] = alone.get(pair, 0) + value
    for (n, v), value in alone.items():  # the calls that gave that value alone
        if value:
            rest -= value
            at = tuple([v if g == n else _NONE for g in group_by])
            sums[at] = sums.get(at, 0) + value
    none = tuple([_NONE for _ in group_by])
    sums[none] = sums.get(none, 0) + rest
    groups: list[dict[str, Any]] = []
    for at, value in sorted(sums.items()):
        if value:
            dims: dict[str, str | None] = {}
            for i, g in enumerate(group_by):
                v = at[i]
                dims[g] = None if v == _NONE else v
            groups.append({"dims": dims, "value": value})
    return {"total": total, "groups": groups}


def parts(
    name: str, decoded: dict[str, tuple[Pairs, dict[str, str] | None]]
) -> tuple[Pairs, dict[str, str] | None]:
    """A counter name's pairs, and for a combination its pairs as a map (else ``None``),
    kept in ``decoded``."""
    got = decoded.get(name)
    if got is None:
        _, pairs, combination = decode(name)
        got = decoded[name] = (pairs, dict(pairs) if combination else None)
    return got


def dimension_counters(names: Iterable[str], feature: str) -> list[str]:
    """The names of ``names`` that are dimension counters of ``feature``."""
    lo, hi = feature + COMBINATION, feature + LAST
    return [n for n in names if lo <= n <= hi]
