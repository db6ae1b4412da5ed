"""The unique values a node knows claimed, per counter: a cache that answers a value met again
from memory (meter.core.uniques), and the values told to and learned from peers by gossip.
Pure."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from cluster.codec import ValueItem
from meter.core.keys import Key

#: Values a node keeps in its caches at most; past it, the caches start again empty (a value
#: forgotten costs one storage round trip when next met, never a miscount).
MAX_CACHED_VALUES = 1_000_000

#: Values learned claimed a node keeps to tell its peers at most, between two gossip ticks
#: (past it, the rest are not told: a peer claims them and loses, counting nothing).
MAX_TOLD = 10_000


class KnownValues:
    """The unique values a node knows claimed (storage holds them), per key: a cache, bounded
    by :data:`MAX_CACHED_VALUES`, dropped with its key's row; and, with gossip, those it
    learned from its own claims since the last tick, to tell its peers (they then answer
    them from memory). Pure."""

    def __init__(self, gossip: bool = False, warm: Callable[[Key], bool] | None = None) -> None:
        self.seen: dict[Key, set[str]] = {}
        self.cached = 0
        self.gossip = gossip
        #: Whether a key's counter is held here: only such keys learn peers' values.
        self.warm = warm
        self._told: list[ValueItem] = []
        #: Values learned from peers since start.
        self.learned = 0

    def has(self, key: Key, value: str) -> bool:
        """Whether ``value`` is known claimed in ``key``."""
        held = self.seen.get(key)
        return held is not None and value in held

    def add(self, key: Key, value: str, tell: bool = True) -> None:
        """Know ``value`` claimed in ``key`` (``tell``: and tell peers, with gossip)."""
        held = self.seen.get(key)
        if held is None:
            held = self.seen[key] = set()
        if value in held:
            return
        if self.cached >= MAX_CACHED_VALUES:  # (all of them: one key may hold them all)
            held = set()
            self.seen = {key: held}
            self.cached = 0
        held.add(value)
        self.cached += 1
        if tell and self.gossip and len(self._told) < MAX_TOLD:
            self._told.append((key[0], key[1], key[2], value))

    def forget(self, key: Key, value: str) -> None:
        """No longer know ``value`` in ``key`` (its claim's outcome was undone)."""
        held = self.seen.get(key)
        if held is not None and value in held:
            held.discard(value)
            self.cached -= 1

    def take_values(self) -> list[ValueItem]:
        """The values learned from this node's claims since the last take (gossip's)."""
        told, self._told = self._told, []
        return told

    def learn_values(self, items: Iterable[ValueItem]) -> int:
        """Know peers' values as claimed, for the keys held here; how many were new."""
        new = 0
        warm = self.warm
        for t, f, p, value in items:
            key = (t, f, p)
            if (warm is None or warm(key)) and not self.has(key, value):
                self.add(key, value, tell=False)
                new += 1
        self.learned += new
        return new

    def evict_idle(self, warm: Callable[[Key], bool]) -> int:
        """Forget the values of keys not ``warm`` (the table dropped them); how many."""
        gone = [k for k in self.seen if not warm(k)]
        dropped = 0
        for k in gone:
            dropped += len(self.seen.pop(k))
        self.cached -= dropped
        return dropped
