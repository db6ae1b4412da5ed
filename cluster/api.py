"""What ``cluster/`` needs from the rest of the node, as structural types (no imports of it).

The counter table satisfies :class:`GossipTable`; the flusher's ``Applied`` values satisfy
:class:`AppliedView`. The node hands over a ``make_snapshot`` function (the storage
``Snapshot`` class itself) so announcements become the snapshot type the table re-bases on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Protocol, TypeVar

from cluster.codec import ReadingItem, ValueItem

Key = tuple[str, ...]
"""``(tenant, feature, period)``."""

S_contra = TypeVar("S_contra", contravariant=True)


class GossipSource(Protocol):
    """What the broadcaster takes gossip from."""

    def touched_keys(self) -> list[Key]:
        """Keys with units to gossip."""
        ...

    def take_gossip_all(self) -> list[tuple[str, str, str, int, int]]:
        """Every touched key's not-yet-gossiped units, as ``(tenant, feature, period,
        flush_seq, delta)`` items, taken at once."""
        ...


class GossipTable(GossipSource, Protocol[S_contra]):
    """The counter table's public API as the gossip layer uses it."""

    def apply_remote_many(self, peer: str, items: Iterable[tuple[str, str, str, int, int]]) -> int:
        """Add a peer's ``(tenant, feature, period, flush_seq, delta)`` items; return how
        many were applied."""
        ...

    def rebase(self, key: Key, snap: S_contra, source: str = ...) -> bool:
        """Re-base on a stored snapshot if it is at least as new as the row's."""
        ...

    def rebase_moved(self, key: Key, snap: S_contra, source: str = ...) -> int | None:
        """:meth:`rebase`, answering how far the view moved (``None``: not applied)."""
        ...

    def forget_peer(self, peer: str) -> int:
        """Drop every remote delta of a dead ``peer``; return the units dropped."""
        ...

    def keys(self) -> Iterable[Key]:
        """Every warm key."""
        ...


class SnapshotView(Protocol):
    """A stored counter as written: total and last applied sequence per node."""

    @property
    def total(self) -> int: ...

    @property
    def seqs(self) -> Mapping[str, int]: ...


class AppliedView(Protocol):
    """A flusher outcome: the snapshot the write produced."""

    @property
    def snapshot(self) -> SnapshotView: ...


class ValueSource(Protocol):
    """Unique features' values the node knows claimed, as the gossip layer uses them (a hint:
    a value told is one storage holds; a value never told is claimed again and lost)."""

    def take_values(self) -> list[ValueItem]:
        """The values this node learned claimed since the last take."""
        ...

    def learn_values(self, items: Iterable[ValueItem]) -> int:
        """Know peers' values as claimed; how many were new here."""
        ...


class GaugeSource(Protocol):
    """The node's gauges as the gossip layer uses them (readings merge: any order, any
    repeats)."""

    def take_readings(self) -> list[ReadingItem]:
        """The readings of this node's observations since the last take."""
        ...

    def merge_readings(self, items: Iterable[ReadingItem]) -> int:
        """Merge peers' readings into the gauges held; how many moved a view."""
        ...

    def warm(self) -> list[tuple[Key, str]]:
        """Every gauge held, with its kind."""
        ...


#: Re-read the warm keys (and gauges) a filter picks (``None``: every one) from storage and
#: re-base on them.
Resync = Callable[[Callable[[Key], bool] | None], Awaitable[object]]
