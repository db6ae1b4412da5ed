"""The storage interface every backend implements, and the values that cross it.

A stored counter is identified by ``(tenant, feature, period)`` and holds a total plus, per node
that ever wrote to it, the last flush sequence of that node's that was applied. A delta travels
with ``(node, seq)``; a backend applies it only if ``seq`` is greater than the stored sequence
for that node, atomically with the add. A retry of a delta that already landed is therefore
refused ("duplicate") and answered with the item as it is: never counted twice.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Key = tuple[str, str, str]
"""``(tenant, feature, period)``; ``period`` is ``YYYY-MM`` or ``YYYY-MM-DD``."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A stored counter as read: its total and the last applied flush sequence per node."""

    total: int
    seqs: Mapping[str, int] = field(default_factory=dict)

    def seq_of(self, node: str) -> int:
        """The last applied sequence of ``node`` in this snapshot (0 if it never wrote)."""
        return self.seqs.get(node, 0)


EMPTY = Snapshot(0, {})
"""The snapshot of a counter that does not exist yet."""


@dataclass(frozen=True, slots=True)
class Delta:
    """One node's flush of one key: add ``delta`` unless ``(node, key, seq)`` already applied."""

    key: Key
    seq: int
    delta: int


@dataclass(frozen=True, slots=True)
class Applied:
    """The outcome of one :class:`Delta`.

    ``duplicate`` is true when the backend refused the delta because its sequence had already
    been applied; ``snapshot`` is then the item as it is now, which contains the delta.
    """

    snapshot: Snapshot
    duplicate: bool = False


class StorageError(Exception):
    """Base of the storage errors. ``retryable`` says whether trying again can succeed."""

    retryable = True


class StorageUnavailable(StorageError):
    """The backend could not be reached or refused for now (network, throttling, 5xx)."""


class StoragePermanentError(StorageError):
    """The request can never succeed as it is (validation error, bad key); do not retry it."""

    retryable = False


class BadItems(StoragePermanentError):
    """:meth:`Storage.load` read some items it cannot decode (damaged or foreign data).

    ``good`` holds the snapshots of the other keys, ``bad`` each undecodable key and why: one
    bad item must not keep every other key of the batch from being seeded.
    """

    def __init__(self, good: dict[Key, Snapshot], bad: dict[Key, str]) -> None:
        first = next(iter(bad.items()))
        super().__init__(f"{len(bad)} undecodable stored items, e.g. {first[0]}: {first[1]}")
        self.good = good
        self.bad = bad


class Storage(abc.ABC):
    """A place counters are flushed to and seeded from. Implementations are async-safe."""

    #: Short name shown in ``status`` (``sqlite``, ``memory``, ``dynamodb``).
    kind: str = "abstract"

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Open connections; called once before any other method."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; called once at shutdown."""

    async def init_schema(self) -> str:
        """Create tables/indexes if missing (idempotent); return a one-line report."""
        return f"{self.kind}: nothing to create"

    @abc.abstractmethod
    async def apply(self, node: str, deltas: Sequence[Delta]) -> dict[Key, Applied | StorageError]:
        """Apply a batch of one node's deltas; return each key's outcome.

        A key appears at most once per batch. Per key the result is an :class:`Applied` (the
        new or, for a duplicate, current snapshot) or the :class:`StorageError` that key hit.
        An exception raised instead means the whole batch's fate is unknown: each delta may or
        may not have been applied, and the caller retries the same ``(key, seq, delta)``.
        """

    @abc.abstractmethod
    async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]:
        """Read the current snapshot of each key (``EMPTY`` for keys never written).

        Raises :class:`BadItems` (with the good snapshots) if some stored items cannot be
        decoded, and only :class:`StorageError` subclasses otherwise."""

    async def purge_expired(self, now: float | None = None) -> int:
        """Delete counters past their expiry (period end, or last write if later, plus the
        retention); return how many. A no-op where the store expires items itself."""
        return 0

    @abc.abstractmethod
    async def list_period(self, tenant: str, period: str) -> dict[str, Snapshot]:
        """Every stored counter of ``tenant`` in ``period``, by feature."""
