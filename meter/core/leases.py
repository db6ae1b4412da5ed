"""Reservations as leases: an id, the key and quantity held, and a deadline. Pure, no I/O.

The registry only remembers leases; the units themselves are held in the counter table's
``reserved`` column. Expiry is driven from outside (``expire(now)``), so tests control time.

Deadlines are kept in a heap. A finished lease leaves its entry behind (removing it from the
middle of a heap costs O(n)); when such entries are more than half the heap (and the heap holds
at least :attr:`Reservations.COMPACT_AT`), the heap is rebuilt from the open leases. At least
half the heap's entries were finished since the last rebuild, so the O(open) rebuild costs O(1)
per finished lease, and the heap never holds more than twice the open leases (or
``COMPACT_AT``): memory follows the open leases, not the rate at which leases finish.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
from dataclasses import dataclass

from meter.core.keys import Key
from meter.errors import NotFound


@dataclass(frozen=True, slots=True)
class Lease:
    """One reservation: ``qty`` units of ``key`` held until ``deadline`` (monotonic seconds);
    ``dims``: the names of the dimension counters its commit counts on too (a reservation
    with dimensions, docs/dimensions.md)."""

    id: str
    key: Key
    qty: int
    deadline: float
    dims: tuple[str, ...] = ()


class Reservations:
    """Open leases by id, plus a heap of deadlines for expiry."""

    #: The heap is never compacted below this many entries.
    COMPACT_AT = 1024

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

    @property
    def deadlines_kept(self) -> int:
        """Entries in the deadline heap (open leases, plus finished ones not dropped yet)."""
        return len(self._deadlines)

    def open(self, key: Key, qty: int, deadline: float, dims: tuple[str, ...] = ()) -> Lease:
        """Register a lease and return it (with a fresh id)."""
        lease = Lease(f"{self._prefix}-{next(self._next)}", key, qty, deadline, dims)
        self._open[lease.id] = lease
        heapq.heappush(self._deadlines, (deadline, next(self._tiebreak), lease.id))
        self._maybe_compact()
        return lease

    def close(self, lease_id: str) -> Lease:
        """Remove and return an open lease; :class:`NotFound` if unknown or already closed."""
        lease = self._open.pop(lease_id, None)
        if lease is None:
            raise NotFound(f"reservation {lease_id!r} is unknown, finished or expired")
        self._maybe_compact()
        return lease

    def _maybe_compact(self) -> None:
        """Rebuild the heap from the open leases if finished ones fill more than half of it
        (and it holds more than :attr:`COMPACT_AT`): after every change the heap holds at
        most ``max(COMPACT_AT, 2 * open leases)`` entries."""
        n = len(self._deadlines)
        if n <= self.COMPACT_AT or n <= 2 * len(self._open):
            return
        tiebreak = self._tiebreak
        heap = [(lease.deadline, next(tiebreak), lease.id) for lease in self._open.values()]
        heapq.heapify(heap)
        self._deadlines = heap

    def get(self, lease_id: str) -> Lease | None:
        """The open lease ``lease_id``, if any."""
        return self._open.get(lease_id)

    def open_again(self, lease: Lease) -> None:
        """Put back a lease that was closed by mistake (its deadline is unchanged)."""
        self._open[lease.id] = lease
        heapq.heappush(self._deadlines, (lease.deadline, next(self._tiebreak), lease.id))
        self._maybe_compact()

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
        self._maybe_compact()
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline still in the heap (may belong to a closed lease)."""
        return self._deadlines[0][0] if self._deadlines else None

    def held(self) -> list[Lease]:
        """Every open lease."""
        return list(self._open.values())
