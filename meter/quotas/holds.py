"""Units held by open reservations across the fleet, for limit checks. Pure: no I/O.

Each node gossips, as one ``holds`` frame, every counter it holds reserved units on
(docs/quotas.md, "Holds across the fleet"); a peer's frame replaces what was known of it, and a
peer declared dead or restarted holds nothing any more. A holder resends its frame every
heartbeat while it holds anything, so a peer's holds not refreshed within ``max_age`` (this
node's bus down, or the holder's) are dropped rather than counted for the whole outage.
Peers' holds count against hard limits (never in ``usage``, which is each node's own view).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from meter.core.keys import Key
from meter.core.leases import Lease

HoldItem = tuple[str, str, str, int]
"""``(tenant, feature, period, units held)``."""

#: Most counters one ``holds`` frame carries (the most held first); past it, the rest are
#: not announced (logged by the node).
MAX_HOLD_KEYS = 10_000
#: Most bytes of counters one ``holds`` frame carries (estimated as the codec's ``chunks``
#: does: names are ASCII), half the 1 MiB gossip frame: 10,000 long names would not fit it,
#: and every peer would reject the frame.
MAX_HOLD_BYTES = 512 * 1024
#: A peer's holds are dropped when not refreshed within this many heartbeats.
STALE_AFTER_HEARTBEATS = 3


class PeerHolds:
    """What each peer holds, and the sum per counter."""

    def __init__(self, max_age: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        #: Seconds a peer's holds count without a fresh frame (the node sets it to
        #: ``STALE_AFTER_HEARTBEATS`` heartbeats).
        self.max_age = max_age
        self._clock = clock
        self._by_peer: dict[str, dict[Key, int]] = {}
        self._received: dict[str, float] = {}
        #: Counter -> units held on it by every peer together (absent: none).
        self.total: dict[Key, int] = {}

    def replace(self, peer: str, items: Sequence[HoldItem]) -> None:
        """``peer`` holds exactly ``items`` now (``()``: nothing)."""
        self._received.pop(peer, None)
        total = self.total
        for key, held in self._by_peer.pop(peer, {}).items():
            left = total[key] - held
            if left:
                total[key] = left
            else:
                del total[key]
        new: dict[Key, int] = {(t, f, p): held for t, f, p, held in items if held > 0}
        for key, held in new.items():
            total[key] = total.get(key, 0) + held
        if new:
            self._by_peer[peer] = new
            self._received[peer] = self._clock()

    def expire(self) -> list[str]:
        """Drop the holds of every peer whose last frame is older than ``max_age``; return
        those peers."""
        cutoff = self._clock() - self.max_age
        stale = [peer for peer, at in self._received.items() if at < cutoff]
        for peer in stale:
            self.replace(peer, ())
        return stale

    def peers(self) -> int:
        return len(self._by_peer)


def local_holds(
    leases: Iterable[Lease], max_bytes: int = MAX_HOLD_BYTES
) -> tuple[list[HoldItem], int]:
    """The units ``leases`` hold per counter, most held first, at most ``MAX_HOLD_KEYS``
    counters and ``max_bytes`` bytes; and how many counters were left out."""
    held: dict[Key, int] = {}
    for lease in leases:
        if lease.qty:
            held[lease.key] = held.get(lease.key, 0) + lease.qty
    ranked = sorted(held.items(), key=lambda kv: -kv[1])
    out: list[HoldItem] = []
    size = 0
    for (t, f, p), n in ranked[:MAX_HOLD_KEYS]:
        size += 16 + len(t) + len(f) + len(p) + 9  # framing, three strings, an int
        if size > max_bytes:
            break
        out.append((t, f, p, n))
    return out, len(ranked) - len(out)
