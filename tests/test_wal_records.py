"""The write-ahead log's framing: whole records come back, a torn tail is told apart from
corruption before it, whatever the cut."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meter.wal import records as R
from meter.wal.log import LogIdMismatch, read_log, segment_path
from meter.wal.replay import Replay

RECS: list[list[Any]] = [
    [R.SEGMENT, "n1", R.FORMAT, 1, 1.5],
    [R.TRACK, "acme", "api", "2026-11", 5],
    [R.TRACK_ID, "acme", "api", "2026-11", 2, "req-1", 123, 7, 9e9],
    [R.FLUSH, [["acme", "api", "2026-11", 1, 7]]],
]

record = st.lists(
    st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=40), st.none()),
    max_size=6,
).map(lambda xs: [R.TRACK, *xs])


def joined(recs: list[list[Any]]) -> bytes:
    """Records one frame each (as separate commits write them)."""
    return b"".join(R.frame(r) for r in recs)


def test_records_round_trip() -> None:
    data = joined(RECS) + R.frames(RECS)
    found = R.scan(data)
    assert found.records == RECS + RECS
    assert found.end == len(data)
    assert found.damage is None


def test_a_commit_is_one_frame() -> None:
    data = R.frames(RECS)
    found = R.scan(data)
    assert found.records == RECS
    assert found.end == len(data)
    assert found.damage is None


@settings(max_examples=300, deadline=None)
@given(st.lists(record, min_size=1, max_size=8), st.data())
def test_a_cut_anywhere_keeps_every_whole_record_and_is_torn(
    recs: list[list[Any]], data: st.DataObject
) -> None:
    blob = joined(recs)
    cut = data.draw(st.integers(0, len(blob) - 1))
    found = R.scan(blob[:cut])
    ends = [len(joined(recs[: i + 1])) for i in range(len(recs))]
    whole = sum(1 for e in ends if e <= cut)
    assert found.records == recs[:whole]
    if cut in ends or cut == 0:
        assert found.damage is None
    else:
        assert found.damage is not None and found.damage.torn
        assert found.end == (ends[whole - 1] if whole else 0)


def test_zeros_after_the_last_record_are_the_preallocated_rest() -> None:
    blob = joined(RECS) + bytes(100)
    found = R.scan(blob)
    assert found.records == RECS
    assert found.damage is None and found.end == len(joined(RECS))
    # A half-written record inside that zeroed rest is a torn tail.
    half = R.frame(RECS[1])[:10]
    found = R.scan(joined(RECS) + half + bytes(100))
    assert found.records == RECS
    assert found.damage is not None and found.damage.torn


def test_a_garbled_last_record_is_torn() -> None:
    blob = bytearray(joined(RECS))
    blob[-2] ^= 0xFF
    found = R.scan(bytes(blob))
    assert found.records == RECS[:-1]
    assert found.damage is not None and found.damage.torn


@pytest.mark.parametrize("where", ["payload", "header"])
def test_damage_before_the_tail_is_corruption_with_its_offset(where: str) -> None:
    blob = bytearray(joined(RECS))
    second = len(R.frame(RECS[0]))
    blob[second + (R.HEADER.size + 1 if where == "payload" else 1)] ^= 0x55
    found = R.scan(bytes(blob))
    assert found.records == RECS[:1]
    assert found.damage is not None
    assert not found.damage.torn
    assert found.damage.offset == second
    assert "a whole record follows" in found.damage.reason


def test_a_page_missing_in_the_middle_of_the_last_commit_is_a_torn_tail() -> None:
    # A crash can leave a multi-page write with a page never written (zeros), even before
    # pages that were: that commit was never answered.
    big = [[R.TRACK, "acme", f"f{i}", "2026-11", i] for i in range(2000)]
    head = joined(RECS)
    blob = bytearray(head + R.frames(big))
    hole = len(head) + 5000
    blob[hole : hole + 4096] = bytes(4096)
    found = R.scan(bytes(blob))
    assert found.records == RECS
    assert found.damage is not None and found.damage.torn and found.damage.offset == len(head)


def test_replay_of_tracks_flushes_and_states() -> None:
    key = ("acme", "api", "2026-11")
    r = Replay()
    r.apply_all(
        [
            [R.TRACK, *key, 5],
            [R.FLUSH, [[*key, 1, 5]]],
            [R.TRACK, *key, 3],
            [R.FLUSH, [[*key, 1, 5]]],  # a retry of the same take changes nothing
            [R.FLUSH, [[*key, 2, 3]]],  # 1 was stored: 2 takes the 3 pending
            [R.TRACK, *key, 4],
        ]
    )
    row = r.unstored()[key]
    assert (row.seq, row.inflight, row.pending) == (2, 3, 4)
    r.apply([R.STATE, [[*key, 0, 0, 0]]])
    assert r.unstored() == {}


def test_the_credits_a_call_spent_are_read_from_every_record_that_carries_them() -> None:
    """Written now: per tenant, or ``false`` (none); an older build's ``true`` or no field:
    not known how many (None: a void refuses the call)."""
    key = ("acme", "api", "2026-11")
    paid = [["acme", 6], ["acme/bob", 2]]
    r = Replay()
    r.apply_all(
        [
            [R.TRACK_ID, *key, 3, "new", 1, 3, 9e9, paid],
            [R.TRACK_ID, *key, 3, "old", 2, 6, 9e9, True],
            [R.TRACK_ID, *key, 3, "free", 3, 9, 9e9, False],
            [R.TRACK_ID, *key, 3, "unsaid", 3, 9, 9e9],  # (an older build's: how many unknown)
            [R.TRACK_MANY, [[*key, 1, "item", 4, 10, 9e9, [], paid]]],
            [R.COMMIT, "l1", *key, 2, 9e9, 3, 13, 9e9, "c", 5, 9e9, [], paid],
            [R.IDS, [["ck", 6, 1, 9e9, [1, [list(key)], True, paid]]]],
        ]
    )
    spent = {rid: counted[3] for rid, counted in r.effects.items()}
    expected = (("acme", 6), ("acme/bob", 2))
    assert spent == {
        "new": expected, "old": None, "free": (), "unsaid": None, "item": expected,
        "c": expected, "ck": expected,
    }  # fmt: skip
    assert r.effects["ck"][2] is True  # (voided, as the checkpoint said)


def test_an_unknown_record_type_is_refused() -> None:
    with pytest.raises(ValueError):
        Replay().apply([99])


def _segments(tmp: Path, segs: list[list[list[Any]]]) -> Path:
    d = tmp / "wal"
    d.mkdir(parents=True)
    for n, recs in enumerate(segs, start=1):
        head = [R.SEGMENT, "n1", R.FORMAT, n, 0.0]
        segment_path(d, n).write_bytes(b"".join(R.frame(r) for r in [head, *recs]))
    return d


def test_replay_starts_at_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    # Left by a crash between two deletions of old segments: segment 1 (which held the
    # track) is gone, segment 2 (its flush) survived; segment 3's checkpoint restates
    # everything (the key was stored: nothing to restate). Replaying 2 would subtract 5.
    k = ["acme", "api", "2026-11"]
    d = _segments(
        tmp_path, [[[R.TRACK, *k, 1]], [[R.FLUSH, [[*k, 1, 5]]]], [[R.CHECKPOINT_END, 3]]]
    )
    segment_path(d, 1).unlink()
    assert read_log(d).unstored() == {}
    # An incomplete checkpoint (no end marker) does not count: replay starts further back.
    d2 = _segments(tmp_path / "b", [[[R.TRACK, *k, 5]], [[R.STATE, [[*k, 0, 0, 5]]]]])
    row = read_log(d2).unstored()[("acme", "api", "2026-11")]
    assert (row.seq, row.inflight, row.pending) == (0, 0, 5)


def test_a_log_of_another_node_is_refused(tmp_path: Path) -> None:
    d = _segments(tmp_path, [[[R.TRACK, "acme", "api", "2026-11", 5]]])
    with pytest.raises(LogIdMismatch) as info:
        read_log(d, node_id="n2")
    assert "belongs to node id 'n1'" in str(info.value) and "METER_NODE_ID=n1" in str(info.value)
    assert read_log(d, node_id="n1").unstored()


def test_replay_names_the_recently_active_keys_most_recent_first(tmp_path: Path) -> None:
    a, b, c, d, e, f, g = ([t, "x", "2026-11"] for t in "abcdefg")
    d_ = _segments(
        tmp_path,
        [
            [
                [R.WARM, [a, b]],  # a checkpoint's list of warm keys, most recently used first
                [R.STATE, [[*c, 0, 0, 0]]],  # restated as stored: still a key in use
                [R.TRACK, *d, 1],
                [R.TRACK_MANY, [[*e, 1], [*d, 1]]],  # d named again: now the most recent
                [R.RESERVE, "l1", *f, 1, 9e9, None, None, None],
                [R.CHECKPOINT_END, 1],
            ],
            [[R.WARM, [g, a]]],  # a newer checkpoint's list, cut short by a crash
        ],
    )
    got = read_log(d_).warm_keys()
    assert got == [tuple(k) for k in (f, d, e, c, g, a, b)]


def test_a_log_without_warm_records_names_the_keys_of_its_records(tmp_path: Path) -> None:
    # As written before WARM records existed: replay is unchanged, and the keys come from
    # the records.
    k = ["acme", "api", "2026-11"]
    d = _segments(tmp_path, [[[R.TRACK, *k, 5], [R.FLUSH, [[*k, 1, 5]]], [R.CHECKPOINT_END, 1]]])
    replay = read_log(d)
    row = replay.unstored()[tuple(k)]
    assert (row.seq, row.inflight, row.pending) == (1, 5, 0)
    assert replay.warm_keys() == [tuple(k)]


# -- format 2: salted frames and SYNCED marks --------------------------------------------------


def _segment(salt: int, mode: str, recs: list[list[Any]]) -> bytes:
    """A format 2 segment: its SEGMENT record unsalted, then one frame per commit, salted."""
    head = R.frame([R.SEGMENT, "n1", R.FORMAT, 1, 1.5, salt, mode])
    return head + b"".join(R.frame(r, salt) for r in recs)


def test_a_salted_segment_round_trips_and_says_its_mode() -> None:
    data = _segment(0xDEADBEEF, "fsync", RECS[1:])
    found = R.scan(data)
    assert found.damage is None and found.records[1:] == RECS[1:] and found.mode == "fsync"
    # Read without its salt (a frame of another segment spliced in) nothing after the head is
    # whole.
    other = R.scan(_segment(1, "fsync", []) + data[len(_segment(0xDEADBEEF, "fsync", [])) :])
    assert other.damage is not None and other.records == [other.records[0]]


def test_a_forged_frame_inside_a_salted_commit_leaves_it_torn() -> None:
    """An unsalted frame (what a client can forge) inside the last commit, whose head is gone:
    a torn tail, not damage in the middle."""
    forged = R.frame([R.TRACK, "x", "y", "z", 1])  # salt 0: format 1 framing
    plain = R.scan(R.frame(RECS[1]) + bytes(12) + forged)
    assert plain.damage is not None and not plain.damage.torn  # (format 1 was fooled)
    salt = 0x1234567
    good = _segment(salt, "fsync", RECS[1:2])
    torn = bytearray(R.frame([R.TRACK_ID, "acme", "api", "2026-11", 1, forged, 1, 1, 1.0], salt))
    assert forged in bytes(torn)  # (as bytes: verbatim in the payload)
    torn[: R.HEADER.size] = bytes(R.HEADER.size)  # its first bytes never written
    found = R.scan(good + bytes(torn))
    assert found.damage is not None and found.damage.torn, found.damage
    assert found.end == len(good)


def test_synced_marks_past_the_damage_count() -> None:
    """In an interval segment the furthest SYNCED offset counts, also one in a whole frame past
    the damage; a fsync segment's marks are not looked for past it."""
    salt = 77
    body = [RECS[1], RECS[1], [R.BATCH, [RECS[1], [R.SYNCED, 60]]], RECS[1]]
    data = bytearray(_segment(salt, "interval", body))
    assert R.scan(bytes(data)).synced == 60
    second = len(_segment(salt, "interval", body[:1]))
    data[second + R.HEADER.size + 1] ^= 0xFF
    found = R.scan(bytes(data))
    assert found.damage is not None and found.damage.offset == second
    assert found.synced == 60 and found.mode == "interval"


def test_damage_in_a_segments_first_record_with_records_after_it_is_corruption() -> None:
    """The SEGMENT record is written and synced alone first: damaged with bytes after it, it
    is not a torn tail (cutting there would drop the whole segment); with zeros after it
    (what a crash while making the segment leaves), it is."""
    data = bytearray(_segment(99, "fsync", [RECS[1]] * 200))
    data[5] ^= 0xFF
    found = R.scan(bytes(data))
    assert found.damage is not None and not found.damage.torn
    assert "bytes follow the segment's head" in found.damage.reason
    head = bytearray(_segment(99, "fsync", []))
    head[5] ^= 0xFF
    alone = R.scan(bytes(head) + bytes(8192))
    assert alone.damage is not None and alone.damage.torn


def test_shares_counts_are_taken_from_fsync_segments_only() -> None:
    """An interval segment may have lost answered calls with their counts (a power loss):
    its SHARES records are not trusted to close a share below its cap."""
    shares = [R.SHARES, [["acme", "#credits", "", "r0", 7]]]
    for mode, want in (("fsync", {(("acme", "#credits", ""), "r0"): 7}), ("interval", {})):
        replay = Replay()
        replay.apply_all([[R.SEGMENT, "n1", R.FORMAT, 1, 1.5, 3, mode], shares])
        assert replay.shares == want, mode
    old = Replay()  # format 1: no mode, not trusted either
    old.apply_all([RECS[0], shares])
    assert old.shares == {}
