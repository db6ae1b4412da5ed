"""Peer tracking: who is alive, which of their messages were lost, and how far behind they are.

Pure: the caller passes the clocks. A peer is identified by its node id; its *incarnation*
(chosen at its start, increasing) tells a restart from a replayed old message. Within an
incarnation, message sequences are 1, 2, 3, ...: a jump is a gap (messages lost on the way), a
repeat or step back is a replay and is refused. A peer declared dead (silent too long) that is
heard again in the same incarnation is *revived*: it was alive all along, and the receiver forgot
its un-flushed gossip at its death, so it must re-read storage.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum


class Seen(Enum):
    """What one message says about its sender."""

    NEXT = "next"  #: the expected next message
    FIRST = "first"  #: first message from a peer not known before
    RESTART = "restart"  #: a new incarnation of a known peer
    GAP = "gap"  #: messages were lost before this one
    REVIVED = "revived"  #: a peer declared dead is heard again, same incarnation
    STALE = "stale"  #: replayed or older than what was seen: refuse it


@dataclass
class Peer:
    """What is known about one peer."""

    node: str
    incarnation: int
    last_seq: int
    last_seen: float  # monotonic
    messages: int = 0
    gaps: int = 0
    missed: int = 0  # messages lost, summed over gaps
    restarts: int = 0
    revivals: int = 0  # declared dead, then heard again in the same incarnation
    alive: bool = True
    #: Recent gossip lags (receive wall time - sent_at), seconds.
    lags: deque[float] = field(default_factory=lambda: deque(maxlen=256))


class Peers:
    """Every peer seen on the bus. ``dead_after`` seconds of silence make a peer dead."""

    def __init__(self, dead_after: float) -> None:
        self.dead_after = dead_after
        self.by_node: dict[str, Peer] = {}

    def observe(
        self, node: str, incarnation: int, seq: int, sent_at: float, now: float, mono: float
    ) -> tuple[Seen, int]:
        """Record a message; return what it means and, for a gap, how many were missed."""
        peer = self.by_node.get(node)
        if peer is None:
            peer = Peer(node, incarnation, seq, mono)
            self.by_node[node] = peer
            verdict, missed = Seen.FIRST, 0
        elif incarnation < peer.incarnation or (
            incarnation == peer.incarnation and seq <= peer.last_seq
        ):
            return Seen.STALE, 0
        elif incarnation > peer.incarnation:
            peer.incarnation = incarnation
            peer.restarts += 1
            verdict, missed = Seen.RESTART, 0
        elif seq == peer.last_seq + 1:
            verdict, missed = Seen.NEXT, 0
        else:
            missed = seq - peer.last_seq - 1
            peer.gaps += 1
            peer.missed += missed
            verdict = Seen.GAP
        if not peer.alive and verdict is not Seen.RESTART:
            # Declared dead, never gone: its forgotten gossip must be re-read (gap or not).
            peer.revivals += 1
            verdict = Seen.REVIVED
        peer.last_seq = seq
        peer.last_seen = mono
        peer.messages += 1
        peer.alive = True
        peer.lags.append(now - sent_at)
        return verdict, missed

    def baseline(self, node: str, incarnation: int, seq: int, mono: float) -> None:
        """Take ``seq`` as ``node``'s last message without a verdict (what it sent before was
        read from storage by other means)."""
        self.by_node[node] = Peer(node, incarnation, seq, mono)

    def expire(self, mono: float) -> list[str]:
        """Mark peers silent for ``dead_after`` as dead; return those that just died."""
        died = []
        for peer in self.by_node.values():
            if peer.alive and mono - peer.last_seen > self.dead_after:
                peer.alive = False
                died.append(peer.node)
        return died

    def touch_all(self, mono: float) -> None:
        """Treat every live peer as just seen (after our own outage: their silence was ours)."""
        for peer in self.by_node.values():
            if peer.alive:
                peer.last_seen = mono

    def live(self) -> list[str]:
        """Ids of the peers currently alive."""
        return sorted(n for n, p in self.by_node.items() if p.alive)

    def status(self, mono: float) -> dict[str, dict[str, object]]:
        """Per peer: alive, last-seen age, gossip lag (last, p50, p99 in ms), counts."""
        out: dict[str, dict[str, object]] = {}
        for node, p in sorted(self.by_node.items()):
            lags = sorted(p.lags)
            out[node] = {
                "alive": p.alive,
                "last_seen_age_s": round(mono - p.last_seen, 3),
                "lag_ms": round(p.lags[-1] * 1000, 2) if p.lags else None,
                "lag_p50_ms": _pct(lags, 0.50),
                "lag_p99_ms": _pct(lags, 0.99),
                "messages": p.messages,
                "gaps": p.gaps,
                "missed": p.missed,
                "restarts": p.restarts,
                "revivals": p.revivals,
                "last_seq": p.last_seq,
            }
        return out


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, int(q * len(sorted_values)))
    return round(sorted_values[i] * 1000, 2)
