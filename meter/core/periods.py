"""Period roll-over: which keys to read ahead before a period ends. Pure: no I/O, no asyncio.

Every period is a new key, so at 00:00 UTC on the 1st every active counter of a node is cold at
once. Shortly before a period ends, the node reads the next period's key of every warm key of
the ending one (:meth:`meter.node.lifecycle.Node` runs the loop,
:class:`meter.core.seeder.Seeder` reads them behind any request). Those reads are ordinary
fresh reads of cold keys (C06), made before anyone counts in the new period, so the first calls
of the new period find their keys seeded. See docs/adr/0005-read-ahead-at-period-roll-over.md."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TypeVar

from meter.core.dims import decode, is_dimension
from meter.core.keys import Key, PeriodKind

V = TypeVar("V")


def kinds_in_use(feature_periods: Mapping[str, PeriodKind]) -> list[PeriodKind]:
    """The period kinds counters can have: ``month`` (the default) and any configured."""
    kinds: list[PeriodKind] = ["month"]
    if "day" in feature_periods.values():
        kinds.append("day")
    return kinds


def next_keys(
    keys: Iterable[Key],
    kind: PeriodKind,
    current: str,
    upcoming: str,
    feature_periods: Mapping[str, PeriodKind],
) -> list[Key]:
    """The key of period ``upcoming`` of each key in ``keys`` that is of period ``current``
    (of ``kind``). Keys of other periods (older ones, named with ``at``, or of another
    calendar) and of features of another kind are skipped."""
    out: list[Key] = []
    for tenant, feature, period in keys:
        if period == current and feature_periods.get(feature, "month") == kind:
            out.append((tenant, feature, upcoming))
    return out


class ByFeature(Mapping[str, V]):
    """A mapping of features (``feature_periods``) that answers for their dimension counters
    as for the feature: a dimension counter is in its feature's periods."""

    def __init__(self, by_feature: Mapping[str, V]) -> None:
        self._by_feature = dict(by_feature)

    def __getitem__(self, name: str) -> V:
        try:
            return self._by_feature[name]
        except KeyError:
            if is_dimension(name):
                return self._by_feature[decode(name)[0]]
            raise

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_feature)

    def __len__(self) -> int:
        return len(self._by_feature)
