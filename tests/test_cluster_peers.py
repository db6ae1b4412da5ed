"""Peer tracking: gaps, replays, restarts, lag and liveness."""

from __future__ import annotations

from cluster.peers import Peers, Seen


def test_sequence_gap_replay_and_restart() -> None:
    p = Peers(dead_after=5)
    assert p.observe("b", 10, 1, 100.0, 100.0, 0.0) == (Seen.FIRST, 0)
    assert p.observe("b", 10, 2, 100.0, 100.0, 0.1) == (Seen.NEXT, 0)
    assert p.observe("b", 10, 6, 100.0, 100.0, 0.2) == (Seen.GAP, 3)
    assert p.observe("b", 10, 6, 100.0, 100.0, 0.3) == (Seen.STALE, 0)  # replay
    assert p.observe("b", 10, 4, 100.0, 100.0, 0.3) == (Seen.STALE, 0)  # older
    assert p.observe("b", 9, 99, 100.0, 100.0, 0.3) == (Seen.STALE, 0)  # older incarnation
    assert p.observe("b", 11, 1, 100.0, 100.0, 0.4) == (Seen.RESTART, 0)
    assert p.observe("b", 11, 2, 100.0, 100.0, 0.5) == (Seen.NEXT, 0)
    s = p.status(1.0)["b"]
    assert s["gaps"] == 1 and s["missed"] == 3 and s["restarts"] == 1 and s["messages"] == 5


def test_lag_is_receive_time_minus_sent_at() -> None:
    p = Peers(dead_after=5)
    for i, lag in enumerate([0.002, 0.004, 0.001, 0.100], start=1):
        p.observe("b", 1, i, 1000.0, 1000.0 + lag, float(i))
    s = p.status(4.5)["b"]
    assert s["lag_ms"] == 100.0
    assert s["lag_p50_ms"] == 4.0
    assert s["lag_p99_ms"] == 100.0
    assert s["last_seen_age_s"] == 0.5


def test_silent_peer_dies_and_comes_back() -> None:
    p = Peers(dead_after=2)
    p.observe("b", 1, 1, 0.0, 0.0, 0.0)
    p.observe("c", 1, 1, 0.0, 0.0, 1.5)
    assert p.expire(2.5) == ["b"]
    assert p.expire(2.6) == []  # reported once
    assert p.live() == ["c"]
    p.touch_all(10.0)  # our own outage: c's silence was ours
    assert p.expire(11.0) == []
    p.observe("b", 1, 2, 0.0, 0.0, 12.0)
    assert p.live() == ["b", "c"]


def test_a_dead_peer_heard_again_with_the_same_incarnation_is_revived() -> None:
    p = Peers(dead_after=2)
    p.observe("b", 1, 1, 0.0, 0.0, 0.0)
    assert p.expire(2.5) == ["b"]
    assert p.observe("b", 1, 2, 0.0, 0.0, 3.0) == (Seen.REVIVED, 0)
    assert p.live() == ["b"]
    assert p.observe("b", 1, 3, 0.0, 0.0, 3.1) == (Seen.NEXT, 0)
    assert p.expire(6.0) == ["b"]
    # Back after a gap: still a revival (it resyncs either way), and the gap is counted.
    assert p.observe("b", 1, 9, 0.0, 0.0, 7.0) == (Seen.REVIVED, 5)
    assert p.observe("b", 2, 1, 0.0, 0.0, 7.1) == (Seen.RESTART, 0)
    s = p.status(8.0)["b"]
    assert s["revivals"] == 2 and s["gaps"] == 1 and s["missed"] == 5
