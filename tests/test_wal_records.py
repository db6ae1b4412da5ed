"""The write-ahead log's framing: whole records come back, a torn tail is told apart from
corruption before it, whatever the cut."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meter.wal import records as R
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


def test_records_round_trip() -> None:
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
    blob = R.frames(recs)
    cut = data.draw(st.integers(0, len(blob) - 1))
    found = R.scan(blob[:cut])
    ends = [len(R.frames(recs[: i + 1])) for i in range(len(recs))]
    whole = sum(1 for e in ends if e <= cut)
    assert found.records == recs[:whole]
    if cut in ends or cut == 0:
        assert found.damage is None
    else:
        assert found.damage is not None and found.damage.torn
        assert found.end == (ends[whole - 1] if whole else 0)


def test_zero_fill_after_the_last_record_is_a_torn_tail() -> None:
    blob = R.frames(RECS) + bytes(100)
    found = R.scan(blob)
    assert found.records == RECS
    assert found.damage is not None and found.damage.torn


def test_a_garbled_last_record_is_torn() -> None:
    blob = bytearray(R.frames(RECS))
    blob[-2] ^= 0xFF
    found = R.scan(bytes(blob))
    assert found.records == RECS[:-1]
    assert found.damage is not None and found.damage.torn


@pytest.mark.parametrize("where", ["payload", "header"])
def test_damage_before_the_tail_is_corruption_with_its_offset(where: str) -> None:
    blob = bytearray(R.frames(RECS))
    second = len(R.frame(RECS[0]))
    blob[second + (R.HEADER.size + 1 if where == "payload" else 1)] ^= 0x55
    found = R.scan(bytes(blob))
    assert found.records == RECS[:1]
    assert found.damage is not None
    assert not found.damage.torn
    assert found.damage.offset == second


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


def test_an_unknown_record_type_is_refused() -> None:
    with pytest.raises(ValueError):
        Replay().apply([99])
