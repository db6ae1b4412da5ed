"""An in-memory backend for unit tests: exact semantics, no persistence.

It can be told to fail: ``fail_next`` raises before applying (the write did not land) and
``lose_next_ack`` applies and then raises (the write landed, the caller never heard), which is
the case exactly-once flushing exists for.
"""

from __future__ import annotations

from collections.abc import Sequence

from storage.base import (
    EMPTY,
    Applied,
    Delta,
    Key,
    Snapshot,
    Storage,
    StorageError,
    StorageUnavailable,
)


class MemoryStorage(Storage):
    """Counters in a dict. Every operation is atomic (there is no await inside one)."""

    kind = "memory"

    def __init__(self) -> None:
        self.items: dict[Key, Snapshot] = {}
        self.fail_next = 0
        self.lose_next_ack = 0
        self.writes = 0

    async def apply(self, node: str, deltas: Sequence[Delta]) -> dict[Key, Applied | StorageError]:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise StorageUnavailable("injected failure before the write")
        out: dict[Key, Applied | StorageError] = {}
        for d in deltas:
            current = self.items.get(d.key, EMPTY)
            if current.seq_of(node) >= d.seq:
                out[d.key] = Applied(current, duplicate=True)
                continue
            seqs = dict(current.seqs)
            seqs[node] = d.seq
            snap = Snapshot(current.total + d.delta, seqs)
            self.items[d.key] = snap
            self.writes += 1
            out[d.key] = Applied(snap)
        if self.lose_next_ack > 0:
            self.lose_next_ack -= 1
            raise StorageUnavailable("injected loss of the response after the write")
        return out

    async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]:
        return {k: self.items.get(k, EMPTY) for k in keys}

    async def list_period(self, tenant: str, period: str) -> dict[str, Snapshot]:
        return {f: s for (t, f, p), s in self.items.items() if t == tenant and p == period}
