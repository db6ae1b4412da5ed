"""The gossip codec: round trips, every rejection reason, HMAC, and garbage that never raises."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cluster.codec as codec_mod
from cluster.codec import (
    MAC_LEN,
    MAX_FRAME_BYTES,
    REASONS,
    Codec,
    Header,
    Message,
    Rejected,
    chunks,
)

H = Header("prod", "node-a", 1_700_000_000_000_000_000, 7, 1_760_000_000.25)


def test_round_trip_every_kind() -> None:
    c = Codec("prod")
    deltas = [("t1", "api", "2026-11", 3, 5), ("t/u", "seats", "2026-11-30", 1, -2)]
    m = c.decode(c.encode(H, "deltas", deltas))
    assert isinstance(m, Message)
    assert m.header == H and m.kind == "deltas" and list(m.deltas) == deltas

    ann = [("t1", "api", "2026-11", 42, {"node-a": 3, "node-b": 9})]
    m = c.decode(c.encode(H, "announce", ann))
    assert isinstance(m, Message) and m.kind == "announce"
    assert [(t, f, p, n, dict(s)) for t, f, p, n, s in m.announcements] == ann

    m = c.decode(c.encode(H, "heartbeat"))
    assert isinstance(m, Message) and m.kind == "heartbeat" and m.deltas == ()

    m = c.decode(c.encode(H, "limits", limits_version=12))
    assert isinstance(m, Message) and m.kind == "limits" and m.limits_version == 12

    holds = [("t1", "gpu", "2026-11", 60), ("t/u", "api", "2026-11-30", 0)]
    m = c.decode(c.encode(H, "holds", holds))
    assert isinstance(m, Message) and m.kind == "holds" and list(m.holds) == holds
    m = c.decode(c.encode(H, "holds", []))
    assert isinstance(m, Message) and m.kind == "holds" and m.holds == ()

    readings = [("t1", "peak", "2026-11", "max", 2**70, 1_764_460_800_123, "n1"),
                ("t/u", "seats", "2026-11", "latest", -3, 0, "")]  # fmt: skip
    m = c.decode(c.encode(H, "readings", readings))
    assert isinstance(m, Message) and m.kind == "readings" and list(m.readings) == readings

    values = [("t1", "seats", "2026-11", "user-17"), ("t/u", "seats", "2026-11-30", "ü,x")]
    m = c.decode(c.encode(H, "values", values))
    assert isinstance(m, Message) and m.kind == "values" and list(m.values) == values
    parts = list(chunks([("t", "seats", "2026-11", "v" * 60)] * 1000, 4096))
    assert len(parts) > 1 and all(len(c.encode(H, "values", p)) <= 4096 + 64 for p in parts)


def test_an_alert_frame_round_trips_signed_and_a_bad_one_is_malformed() -> None:
    c = Codec("prod", "s3cret")
    alert = ("a" * 32, "t1", "api", "2026-11", 80, 800, 1000, 801, "n1", 1764460800.5)
    m = c.decode(c.encode(H, "alert", [alert]))
    assert isinstance(m, Message) and m.kind == "alert" and m.alert == alert
    import msgpack

    for body in ([], [*alert[:9]], [*alert[:4], -1, *alert[5:]], [*alert[:8], "", alert[9]]):
        payload = msgpack.packb(["prod", "n1", 1, 1, 1.0, 5, body])
        frame = b"mg\x01\x00" + payload
        got = Codec("prod").decode(frame)
        assert isinstance(got, Rejected) and got.reason == "malformed", body


def test_integers_beyond_64_bits_travel_as_decimal_strings() -> None:
    c = Codec("prod")
    big = 2**70
    m = c.decode(c.encode(H, "deltas", [("t", "f", "2026-11", 1, -big)]))
    assert isinstance(m, Message) and m.deltas[0][4] == -big
    m = c.decode(c.encode(H, "announce", [("t", "f", "2026-11", big, {"a": 1})]))
    assert isinstance(m, Message) and m.announcements[0][3] == big


def test_hmac_round_trip_and_rejections() -> None:
    signed = Codec("prod", "s3cret")
    frame = signed.encode(H, "deltas", [("t", "f", "2026-11", 1, 1)])
    assert isinstance(signed.decode(frame), Message)
    assert signed.authenticated
    # A receiver without the secret cannot check, and accepts (it has no key).
    assert isinstance(Codec("prod").decode(frame), Message)
    # Wrong key, flipped payload bit, flipped MAC bit: bad_mac.
    assert Codec("prod", "other").decode(frame) == Rejected("bad_mac")
    tampered = bytearray(frame)
    tampered[10] ^= 1
    assert signed.decode(bytes(tampered)) == Rejected("bad_mac")
    tampered = bytearray(frame)
    tampered[-1] ^= 1
    assert signed.decode(bytes(tampered)) == Rejected("bad_mac")
    # Unsigned frame to a receiver that requires a MAC.
    assert signed.decode(Codec("prod").encode(H, "heartbeat")) == Rejected("unsigned")
    # The MAC is HMAC-SHA256 of everything before it.
    want = hmac.new(b"s3cret", frame[:-MAC_LEN], hashlib.sha256).digest()
    assert frame[-MAC_LEN:] == want


def _frame(payload: object, version: int = 1, flags: int = 0) -> bytes:
    body: bytes = msgpack.packb(payload, use_bin_type=True)
    return b"mg" + bytes([version, flags]) + body


GOOD = ["prod", "n", 1, 1, 1.0, 0, None]


def test_every_rejection_reason() -> None:
    c = Codec("prod")
    assert isinstance(c.decode(_frame(GOOD)), Message)
    seen = {
        c.decode(b"x" * (MAX_FRAME_BYTES + 1)).reason,  # type: ignore[union-attr]
        c.decode(b"garbage").reason,  # type: ignore[union-attr]
        c.decode(_frame(GOOD, version=2)).reason,  # type: ignore[union-attr]
        Codec("prod", "k").decode(_frame(GOOD)).reason,  # type: ignore[union-attr]
        Codec("prod", "k").decode(_frame(GOOD, flags=1) + b"\0" * 32).reason,  # type: ignore[union-attr]
        c.decode(_frame(["other", *GOOD[1:]])).reason,  # type: ignore[union-attr]
        c.decode(_frame([*GOOD, 0])).reason,  # type: ignore[union-attr]
    }
    assert seen == set(REASONS)


def test_sharded_frames_carry_their_shard_and_heartbeats_every_shards_number() -> None:
    c = Codec("prod", shards=4)
    on_shard = Header("prod", "node-a", 1, 7, 1.0, shard=3)
    deltas = [("t1", "api", "2026-11", 3, 5)]
    m = c.decode(c.encode(on_shard, "deltas", deltas))
    assert isinstance(m, Message) and m.header == on_shard and list(m.deltas) == deltas
    m = c.decode(c.encode(H, "heartbeat", shard_seqs=[0, 5, 2, 9]))
    assert isinstance(m, Message) and m.header.shard is None and m.shard_seqs == (0, 5, 2, 9)
    m = c.decode(c.encode(H, "limits", limits_version=3))
    assert isinstance(m, Message) and m.limits_version == 3


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (["prod", "n", 1, 1, 1.0, 1, [], 4], "shards"),  # shard past K
        (["prod", "n", 1, 1, 1.0, 1, [], -1], "shards"),
        (["prod", "n", 1, 1, 1.0, 1, [], True], "shards"),
        (["prod", "n", 1, 1, 1.0, 0, [1, 2]], "shards"),  # a heartbeat of another K
        (["prod", "n", 1, 1, 1.0, 0, None], "shards"),  # an unsharded heartbeat
        (["prod", "n", 1, 1, 1.0, 0, [1, 2, 3, -1]], "malformed"),
        (["prod", "n", 1, 1, 1.0, 1, []], "malformed"),  # deltas on the control channel
        (["prod", "n", 1, 1, 1.0, 3, [1], 0], "malformed"),  # limits on a data shard
        (["prod", "n", 1, 1, 1.0, 0, [0, 0, 0, 0], 1], "malformed"),  # heartbeat on a shard
        (["prod", "n", 1, 1, 1.0, 1, [], 0, 0], "malformed"),  # nine elements
    ],
)
def test_a_sharded_codec_refuses_frames_of_another_shape(raw: list[Any], reason: str) -> None:
    got = Codec("prod", shards=4).decode(_frame(raw))
    assert isinstance(got, Rejected) and got.reason == reason, got


def test_malformed_payloads() -> None:
    c = Codec("prod")
    bad = [
        b"",
        b"mg",
        b"mg\x01\x00",  # no payload
        b"mg\x01\x00\xc1",  # invalid msgpack
        b"mg\x01\x04" + msgpack.packb(GOOD),  # unknown flag
        b"mg\x01\x01" + b"\0" * 10,  # MAC flag but too short
        _frame({"a": 1}),
        _frame(GOOD[:6]),
        _frame(["prod", "", 1, 1, 1.0, 0, None]),  # empty sender
        _frame(["prod", "n", -1, 1, 1.0, 0, None]),  # negative incarnation
        _frame(["prod", "n", 1, 0, 1.0, 0, None]),  # seq 0
        _frame(["prod", "n", 1, 1, float("nan"), 0, None]),
        _frame(["prod", "n", 1, 1, 1.0, 9, None]),  # unknown kind
        _frame(["prod", "n", 1, 1, 1.0, True, None]),  # bool is not a kind
        _frame(["prod", "n", 1, 1, 1.0, 0, []]),  # heartbeat with body
        _frame(["prod", "n", 1, 1, 1.0, 1, {}]),  # deltas not a list
        _frame(["prod", "n", 1, 1, 1.0, 1, [["t", "f", "p", 1]]]),  # short item
        _frame(["prod", "n", 1, 1, 1.0, 1, [["t", "f", "p", 0, 1]]]),  # flush seq 0
        _frame(["prod", "n", 1, 1, 1.0, 1, [["t", "f", "p", 1, "12x"]]]),
        _frame(["prod", "n", 1, 1, 1.0, 1, [["t", "f", "p", 1, 1.5]]]),
        _frame(["prod", "n", 1, 1, 1.0, 2, [["t", "f", "p", 5, []]]]),
        _frame(["prod", "n", 1, 1, 1.0, 2, [["t", "f", "p", 5, {"a": -1}]]]),
        _frame(["prod", "n", 1, 1, 1.0, 2, [["t", "f", "p", 5, {1: 1}]]]),
        _frame(["prod", b"bin", 1, 1, 1.0, 0, None]),
        _frame(["prod", "n", 1, 1, 1.0, 3, None]),  # limits without a body
        _frame(["prod", "n", 1, 1, 1.0, 3, []]),  # limits without a version
        _frame(["prod", "n", 1, 1, 1.0, 3, [1, 2]]),
        _frame(["prod", "n", 1, 1, 1.0, 3, [-1]]),
        _frame(["prod", "n", 1, 1, 1.0, 3, ["7"]]),
        _frame(["prod", "n", 1, 1, 1.0, 4, None]),  # holds without a body
        _frame(["prod", "n", 1, 1, 1.0, 4, [["t", "f", "p"]]]),  # short hold
        _frame(["prod", "n", 1, 1, 1.0, 4, [["t", "f", "p", -1]]]),  # negative hold
        _frame(["prod", "n", 1, 1, 1.0, 4, [["t", "f", "p", 2**63]]]),  # past 64 bits
        _frame(["prod", "n", 1, 1, 1.0, 4, [["t", "", "p", 1]]]),  # empty feature
        _frame(["prod", "n", 1, 1, 1.0, 6, None]),  # readings without a body
        _frame(["prod", "n", 1, 1, 1.0, 6, [["t", "f", "p", 0, 5, 1]]]),  # short reading
        _frame(["prod", "n", 1, 1, 1.0, 6, [["t", "f", "p", 2, 5, 1, "n"]]]),  # kind 2
        _frame(["prod", "n", 1, 1, 1.0, 6, [["t", "f", "p", True, 5, 1, "n"]]]),  # bool kind
        _frame(["prod", "n", 1, 1, 1.0, 6, [["t", "f", "p", 0, 5, -1, "n"]]]),  # at < 0
        _frame(["prod", "n", 1, 1, 1.0, 6, [["t", "f", "p", 0, 5, 1, 7]]]),  # node not text
        _frame(["prod", "n", 1, 1, 1.0, 6, [["t", "f", "p", 0, 1.5, 1, "n"]]]),  # float value
        _frame(["prod", "n", 1, 1, 1.0, 6, [["", "f", "p", 0, 5, 1, "n"]]]),  # empty tenant
        _frame(["prod", "n", 1, 1, 1.0, 7, None]),  # values without a body
        _frame(["prod", "n", 1, 1, 1.0, 7, [["t", "f", "p"]]]),  # short value item
        _frame(["prod", "n", 1, 1, 1.0, 7, [["t", "f", "p", ""]]]),  # empty value
        _frame(["prod", "n", 1, 1, 1.0, 7, [["t", "f", "p", 5]]]),  # value not text
    ]
    for frame in bad:
        r = c.decode(frame)
        assert isinstance(r, Rejected) and r.reason == "malformed", (frame, r)
    assert c.decode("not bytes") == Rejected("malformed")


def _sound(c: Codec, data: bytes) -> Message | Rejected:
    """Decode ``data`` (which must not raise) and check the answer is sound: a rejection with
    a reason of the table, or a valid message that encodes back to itself."""
    r = c.decode(data)
    if isinstance(r, Rejected):
        assert r.reason in REASONS, r
        return r
    assert isinstance(r, Message), r
    h = r.header
    assert h.cluster == c.cluster and h.sender and h.seq >= 1 and h.incarnation >= 0, h
    assert h.sent_at == h.sent_at and abs(h.sent_at) != float("inf"), h
    assert all(d[3] >= 1 and d[0] and d[1] and d[2] for d in r.deltas), r.deltas
    assert all(min(a[4].values(), default=0) >= 0 for a in r.announcements), r.announcements
    items: list[Any] = list(r.deltas) if r.kind == "deltas" else list(r.announcements)
    if r.kind == "holds":
        items = list(r.holds)
    if r.kind == "readings":
        items = list(r.readings)
    if r.kind == "values":
        items = list(r.values)
    assert c.decode(c.encode(h, r.kind, items, r.limits_version)) == r
    return r


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_are_rejected_or_sound(data: bytes) -> None:
    signed = Codec("prod", "k")
    # Without the key nothing can be made that a signed codec accepts.
    assert isinstance(_sound(signed, data), Rejected)
    assert isinstance(_sound(signed, b"mg\x01\x01" + data), Rejected)
    assert _sound(signed, b"mg\x01\x00" + data) in (Rejected("unsigned"), Rejected("malformed"))
    plain = Codec("prod")
    if not data.startswith(b"mg"):
        assert _sound(plain, data) == Rejected("malformed")
    _sound(plain, b"mg\x01\x00" + data)


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=20,
)


_name = st.text(min_size=1, max_size=8)
# What MessagePack can carry, often near the edges of the valid ranges (0, 1, -1, 2^63).
_int = st.integers(-2, 3) | st.integers(-(2**63), 2**64 - 1)
_delta = st.tuples(_name, _name, _name, _int, _int | _int.map(str))
_announce = st.tuples(_name, _name, _name, _int | _int.map(str), st.dictionaries(_name, _int))


def _mostly(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A plausible value three times in four, else anything at all."""
    return st.one_of(plausible, plausible, plausible, _values)


# Each field is mostly plausible, so messages are accepted often enough for their checks to
# bite, and each field is sometimes anything.
_payloads = st.tuples(
    st.just("prod"),
    _mostly(_name),
    _mostly(_int),
    _mostly(_int),
    _mostly(st.floats(-1, 2e11)),
    _mostly(st.sampled_from([0, 1, 2, 3, 4, 6])),
    _mostly(
        st.none()
        | st.lists(_delta, max_size=3)
        | st.lists(_announce, max_size=3)
        | st.lists(_int, max_size=2)
        | st.lists(st.tuples(_name, _name, _name, _int).map(list), max_size=3)
        | st.lists(
            st.tuples(_name, _name, _name, st.integers(-1, 2), _int, _int, st.text(max_size=3)).map(
                list
            ),
            max_size=3,
        )
    ),
).map(list)


@settings(max_examples=500, deadline=None)
@given(_payloads)
def test_random_payloads_are_malformed_or_exactly_what_was_sent(payload: list[Any]) -> None:
    r = _sound(Codec("prod"), _frame(payload))
    if isinstance(r, Rejected):
        assert r.reason == "malformed", r  # right header, version, cluster: only the payload
    else:
        h = r.header
        assert [h.sender, h.incarnation, h.seq, h.sent_at] == payload[1:5]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200), st.integers(0, 255))
def test_flipped_byte_in_signed_frame_is_rejected(pos: int, bit: int) -> None:
    c = Codec("prod", "k")
    frame = bytearray(c.encode(H, "deltas", [("t", "f", "2026-11", 1, 1)]))
    pos %= len(frame)
    if bit == 0:
        return
    frame[pos] ^= bit
    assert isinstance(c.decode(bytes(frame)), Rejected)


def test_chunks_split_big_batches_under_the_budget() -> None:
    c = Codec("prod")
    items = [(f"tenant-{i}", "feature", "2026-11", 1, i) for i in range(5000)]
    parts = list(chunks(items, 16 * 1024))
    assert len(parts) > 1
    assert [x for p in parts for x in p] == items
    for part in parts:
        assert len(c.encode(H, "deltas", part)) <= 16 * 1024
    assert list(chunks([], 100)) == []


_field = st.one_of(
    st.text(max_size=3),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
)
# Mostly well-formed fields (so whole items often are), with the edge cases among them.
_ok_name = st.text(min_size=1, max_size=3)
_name = st.one_of(_ok_name, _ok_name, _ok_name, st.sampled_from(["", "x" * 1024, "x" * 1025, 1]))
_ok_int = st.integers(min_value=-(2**70), max_value=2**70).map(codec_mod._wire_int)
_int = st.one_of(
    _ok_int,
    _ok_int,
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, True, 1.0, "7", "-x"]),
)
_item = st.one_of(
    st.tuples(_name, _name, _name, _int, _int).map(list),  # the delta shape, near its edges
    st.lists(_field, min_size=0, max_size=6),
    _field,
)


@settings(max_examples=500, deadline=None)
@given(st.lists(_item, max_size=8))
@example([["a", "b", "c", 0, 1]])
@example([["a", "b", "c", 2**63, 1]])
@example([["a", "b", "c", True, 1]])
@example([["a", "b", "c", 1, True]])
@example([["a", "b", "c", 1, "12"]])
@example([["a", "b", "c", 1, 1.0]])
@example([["a", "x" * 1024, "c", 1, 1]])
@example([["a", "x" * 1025, "c", 1, 1]])
@example([["", "b", "c", 1, 1]])
@example([["a", "b", "c", 1]])
@example([("a", "b", "c", 1, 1)])
@example([["a", "b", "c", 1, 1, 0]])
def test_the_inline_delta_check_equals_the_per_field_one(body: list[Any]) -> None:
    """``_deltas`` (inline checks for the common shape) accepts and returns exactly what
    ``_delta`` item by item does, and refuses what it refuses."""
    try:
        want = tuple(codec_mod._delta(i) for i in body)
    except codec_mod._Bad:
        with pytest.raises(codec_mod._Bad):
            codec_mod._deltas(body)
        return
    assert codec_mod._deltas(body) == want
