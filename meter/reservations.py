"""Reservations as leases: an id, the key and quantity held, and a deadline. Pure, no I/O.

The registry only remembers leases; the units themselves are held in the counter table's
``reserved`` column. Expiry is driven from outside (``expire(now)``), so tests control time.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
from dataclasses import dataclass

from meter.errors import NotFound
from meter.keys import Key


@dataclass(frozen=True, slots=True)
class Lease:
    """One reservation: ``qty`` units of ``key`` held until ``deadline`` (monotonic seconds)."""

    id: str
    key: Key
    qty: int
    deadline: float


class Reservations:
    """Open leases by id, plus a heap of deadlines for expiry."""

    def __init__(self) -> None:
        self._open: dict[str, Lease] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        self._tiebreak = itertools.count()
        # A random prefix per process keeps ids unique across restarts; a counter keeps
        # them unique within one.
        self._prefix = "r" + secrets.token_hex(6)
        self._next = itertools.count(1)
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._open)

    def open(self, key: Key, qty: int, deadline: float) -> Lease:
        """Register a lease and return it (with a fresh id)."""
        lease = Lease(f"{self._prefix}-{next(self._next)}", key, qty, deadline)
        self._open[lease.id] = lease
        heapq.heappush(self._deadlines, (deadline, next(self._tiebreak), lease.id))
        return lease

    def close(self, lease_id: str) -> Lease:
        """Remove and return an open lease; :class:`NotFound` if unknown or already closed."""
        lease = self._open.pop(lease_id, None)
        if lease is None:
            raise NotFound(f"reservation {lease_id!r} is unknown, finished or expired")
        return lease

    def get(self, lease_id: str) -> Lease | None:
        """The open lease ``lease_id``, if any."""
        return self._open.get(lease_id)

    def open_again(self, lease: Lease) -> None:
        """Put back a lease that was closed by mistake (its deadline is unchanged)."""
        self._open[lease.id] = lease
        heapq.heappush(self._deadlines, (lease.deadline, next(self._tiebreak), lease.id))

    def expire(self, now: float) -> list[Lease]:
        """Remove and return every open lease whose deadline is at or before ``now``."""
        out: list[Lease] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, lease_id = heapq.heappop(heap)
            lease = self._open.pop(lease_id, None)
            if lease is not None:  # closed leases leave stale heap entries behind
                out.append(lease)
        self.expired_total += len(out)
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline still in the heap (may belong to a closed lease)."""
        return self._deadlines[0][0] if self._deadlines else None

    def held(self) -> list[Lease]:
        """Every open lease."""
        return list(self._open.values())
