"""Unit tests of the pure MessagePack-RPC codec (meter.core.protocol)."""

from __future__ import annotations

import re
from typing import Any

import msgpack
import pytest

from meter.core.protocol import (
    DEFAULT_MAX_FRAME,
    MAX_ARRAY_LEN,
    MAX_MAP_LEN,
    MAX_STR_LEN,
    MSGID_MAX,
    Decoder,
    Encoder,
    Invalid,
    Notification,
    ProtocolError,
    Request,
    Response,
    invalid_error,
    packb,
)


def feed_all(data: bytes, **kw: Any) -> list[Any]:
    return Decoder(**kw).feed(data)


def one(obj: Any, **kw: Any) -> Any:
    out = feed_all(packb(obj), **kw)
    assert len(out) == 1
    return out[0]


# -- message shapes ------------------------------------------------------------------------


def test_request() -> None:
    assert one([0, 7, "track", ["t", "f", 1]]) == Request(7, "track", ["t", "f", 1])


def test_request_msgid_bounds() -> None:
    assert one([0, 0, "ping", []]).msgid == 0
    assert one([0, MSGID_MAX, "ping", []]).msgid == MSGID_MAX


def test_notification() -> None:
    assert one([2, "hello", [1]]) == Notification("hello", [1])


@pytest.mark.parametrize("method", [b"ping", bytearray(b"ping")])
def test_method_as_bin(method: bytes) -> None:
    msg = one([0, 1, bytes(method), []])
    assert msg == Request(1, "ping", [])
    assert type(msg.method) is str


def test_method_as_old_style_raw() -> None:
    # Old msgpack (no bin type) packs bytes as raw, which decodes as the str family.
    data = msgpack.packb([0, 1, b"ping", []], use_bin_type=False)
    assert feed_all(data) == [Request(1, "ping", [])]


def test_notification_method_as_bin() -> None:
    assert one([2, b"hello", []]) == Notification("hello", [])


def test_invalid_utf8_str_is_not_fatal() -> None:
    data = b"\x94\x00\x01\xa2\xff\xfe\x90"  # [0, 1, <str ff fe>, []]
    (msg,) = feed_all(data)
    assert isinstance(msg, Request)
    assert msg.method == "\udcff\udcfe"


def test_several_messages_in_one_feed() -> None:
    data = packb([0, 1, "a", []]) + packb([2, "n", []]) + packb([0, 2, "b", [1]])
    assert feed_all(data) == [
        Request(1, "a", []),
        Notification("n", []),
        Request(2, "b", [1]),
    ]


def test_client_side_response() -> None:
    d = Decoder(side="client")
    assert d.feed(packb([1, 3, None, 42])) == [Response(3, None, 42)]
    err = {"code": "not_found", "message": "x"}
    assert d.feed(packb([1, 4, err, None])) == [Response(4, err, None)]


def test_client_side_notification() -> None:
    d = Decoder(side="client")
    params = ["acme", "api", 7, "2024-05"]
    assert d.feed(packb([2, "usage", params])) == [Notification("usage", params)]


@pytest.mark.parametrize(
    "obj",
    [[0, 1, "ping", []], [2, "x", 5], [2, 5, []], [1, 1, None], [1, -1, None, None],
     [1, "a", None, None], 5],
)  # fmt: skip
def test_client_side_rejects_non_responses(obj: Any) -> None:
    with pytest.raises(ProtocolError):
        Decoder(side="client").feed(packb(obj))


def test_bad_side() -> None:
    with pytest.raises(ValueError):
        Decoder(side="both")


# -- bad requests: answerable, connection stays --------------------------------------------


@pytest.mark.parametrize(
    ("obj", "msgid", "words"),
    [
        ([0, 5, "ping"], 5, "4 elements"),
        ([0, 5, "ping", [], "extra"], 5, "4 elements"),
        ([0, 5], 5, "4 elements"),
        ([0, 5, 17, []], 5, "method"),
        ([0, 5, None, []], 5, "method"),
        ([0, 5, "ping", {}], 5, "params"),
        ([0, 5, "ping", "x"], 5, "params"),
        ([0, 5, "ping", None], 5, "params"),
        ([1, 5, None, "result"], 5, "requests"),
        ([2, "x"], None, "3 elements"),
        ([2, 5, []], None, "method"),
        ([2, "x", "notalist"], None, "params"),
    ],
)
def test_invalid_messages(obj: list[Any], msgid: int | None, words: str) -> None:
    d = Decoder()
    (msg,) = d.feed(packb(obj))
    assert isinstance(msg, Invalid)
    assert msg.msgid == msgid
    assert words in msg.reason
    # The stream is still usable after an Invalid.
    assert d.feed(packb([0, 9, "ping", []])) == [Request(9, "ping", [])]


def test_invalid_error_map() -> None:
    assert invalid_error("why") == {"code": "invalid_argument", "message": "why"}


# -- protocol errors: close the connection --------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [
        5,
        "ping",
        None,
        {"a": 1},
        [],
        [0, -1, "ping", []],
        [0, MSGID_MAX + 1, "ping", []],
        [0, "1", "ping", []],
        [0, True, "ping", []],
        [0, 1.0, "ping", []],
        [0],
        [1, "x", None, None],
        [3, 1, "ping", []],
        [False, 1, "ping", []],
        ["0", 1, "ping", []],
    ],
)
def test_protocol_errors(obj: Any) -> None:
    d = Decoder()
    with pytest.raises(ProtocolError):
        d.feed(packb(obj))
    # A broken decoder stays broken.
    with pytest.raises(ProtocolError):
        d.feed(packb([0, 1, "ping", []]))


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # never-used byte
        b"\xc1" + packb([0, 1, "ping", []]),
        b"GET / HTTP/1.1\r\n\r\n",  # 'G' is a positive fixint: not an array
        b"\x94\x00\x01\xc1\x90",
        packb({1: 2}),  # int map key
        b"\x94\x00\x01\xa4ping\x91\x81\x90\x01",  # a map key that is an array
    ],
)
def test_garbage(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        Decoder().feed(data)


def test_messages_before_garbage_are_kept() -> None:
    good = packb([0, 1, "ping", []]) + packb([0, 2, "ping", []])
    with pytest.raises(ProtocolError) as info:
        Decoder().feed(good + b"\xc1")
    assert info.value.messages == [Request(1, "ping", []), Request(2, "ping", [])]


def test_deep_nesting() -> None:
    deep = b"\x94\x00\x01\xa4ping" + b"\x91" * 5000 + b"\x90"
    with pytest.raises(ProtocolError):
        Decoder().feed(deep)


def test_moderate_nesting_is_fine() -> None:
    nested: Any = []
    for _ in range(100):
        nested = [nested]
    (msg,) = feed_all(packb([0, 1, "x", [nested]]))
    assert isinstance(msg, Request)


# -- limits ---------------------------------------------------------------------------------


def test_default_limits() -> None:
    assert Decoder().max_frame == DEFAULT_MAX_FRAME == 1 << 20


def test_oversized_complete_frame() -> None:
    frame = packb([0, 1, "x", ["a" * 50] * 6])
    with pytest.raises(ProtocolError, match="exceeds the 200-byte limit"):
        Decoder(max_frame=200).feed(frame)


def test_frame_exactly_at_the_limit() -> None:
    frame = packb([0, 1, "x", ["a" * 300]])
    assert len(Decoder(max_frame=len(frame)).feed(frame)) == 1
    with pytest.raises(ProtocolError):
        Decoder(max_frame=len(frame) - 1).feed(frame)


def test_oversized_incomplete_frame_detected_before_it_ends() -> None:
    # An array header promising a huge frame, then a trickle: refused once past the limit.
    d = Decoder(max_frame=1024)
    d.feed(b"\x94\x00\x01\xa1x\xdc\xff\xff")  # params: array16 of 65535
    with pytest.raises(ProtocolError, match="more than 1024"):
        for _ in range(2000):
            d.feed(b"\x01")


def test_oversized_str() -> None:
    with pytest.raises(ProtocolError):
        Decoder(max_str_len=10).feed(packb([0, 1, "x", ["a" * 11]]))
    assert len(Decoder(max_str_len=10).feed(packb([0, 1, "x", ["a" * 10]]))) == 1


def test_oversized_bin() -> None:
    with pytest.raises(ProtocolError):
        Decoder(max_bin_len=10).feed(packb([0, 1, "x", [b"a" * 11]]))


def test_oversized_array() -> None:
    with pytest.raises(ProtocolError):
        Decoder(max_array_len=10).feed(packb([0, 1, "x", list(range(11))]))


def test_oversized_map() -> None:
    with pytest.raises(ProtocolError):
        Decoder(max_map_len=2).feed(packb([0, 1, "x", [{"a": 1, "b": 2, "c": 3}]]))


def test_default_str_array_map_limits() -> None:
    with pytest.raises(ProtocolError):
        Decoder().feed(packb([0, 1, "x", ["a" * (MAX_STR_LEN + 1)]]))
    with pytest.raises(ProtocolError):
        Decoder().feed(packb([0, 1, "x", [0] * (MAX_ARRAY_LEN + 1)]))
    with pytest.raises(ProtocolError):
        Decoder().feed(packb([0, 1, "x", [{str(i): 0 for i in range(MAX_MAP_LEN + 1)}]]))


def test_many_frames_larger_than_the_limit_in_total() -> None:
    # Pipelined frames far beyond max_frame in one feed are fine: the limit is per frame.
    frame = packb([0, 1, "x", ["a" * 100]])
    data = frame * 200
    out = Decoder(max_frame=256).feed(data)
    assert len(out) == 200


def test_big_frame_split_across_big_reads() -> None:
    # A legal frame just under the limit arriving with a read that overlaps it.
    frame = packb([0, 1, "x", ["a" * 60_000] * 16])
    assert len(frame) < DEFAULT_MAX_FRAME
    data = frame * 5
    d = Decoder()
    out: list[Any] = []
    for i in range(0, len(data), 300_000):
        out += d.feed(data[i : i + 300_000])
    assert len(out) == 5
    assert d.buffered == 0


def test_truncated_frames_at_every_boundary() -> None:
    enc = Encoder()
    data = (
        enc.request(5, "track", ["tenant", "feature", 3, {"at": 1700000000}])
        + enc.notification("n", [None, True, 1.5])
        + packb([0, 6, b"usage", ["t", "f"]])
        + packb([0, 7, "ping"])
        + enc.request(MSGID_MAX, "x", [b"\x00bin", -(2**63), 2**64 - 1])
    )
    expected = Decoder().feed(data)
    assert len(expected) == 5
    for cut in range(len(data) + 1):
        d = Decoder()
        got = d.feed(data[:cut]) + d.feed(data[cut:])
        assert got == expected, cut
    d = Decoder()
    got = []
    for i in range(len(data)):
        got += d.feed(data[i : i + 1])
    assert got == expected


def test_empty_feed() -> None:
    assert Decoder().feed(b"") == []


def test_buffered_reports_the_partial_frame() -> None:
    frame = packb([0, 1, "ping", []])
    d = Decoder()
    d.feed(frame[:3])
    assert d.buffered == 3
    d.feed(frame[3:])
    assert d.buffered == 0


def test_memoryview_input() -> None:
    assert Decoder().feed(memoryview(packb([0, 1, "p", []]))) == [Request(1, "p", [])]


# -- encoder --------------------------------------------------------------------------------


def test_encode_request_and_notification() -> None:
    enc = Encoder()
    assert msgpack.unpackb(enc.request(3, "track", ["t", "f", 1])) == [0, 3, "track", ["t", "f", 1]]
    assert msgpack.unpackb(enc.notification("n", [1])) == [2, "n", [1]]
    # Reused packer: repeated calls give independent, correct buffers.
    a = enc.request(1, "a", [])
    b = enc.request(2, "b", [])
    assert msgpack.unpackb(a) == [0, 1, "a", []]
    assert msgpack.unpackb(b) == [0, 2, "b", []]


def test_encode_requests_batch() -> None:
    data = Encoder().requests([(1, "a", []), (2, "b", [1])])
    assert Decoder().feed(data) == [Request(1, "a", []), Request(2, "b", [1])]


def test_bytes_encode_as_bin_and_str_as_str() -> None:
    data = Encoder().response(1, None, [b"\x00", "s"])
    assert data == b"\x94\x01\x01\xc0\x92\xc4\x01\x00\xa1s"


def test_encode_response() -> None:
    enc = Encoder()
    assert msgpack.unpackb(enc.response(1, None, "pong")) == [1, 1, None, "pong"]
    err = {"code": "not_found", "message": "gone"}
    assert msgpack.unpackb(enc.response(2, err, None)) == [1, 2, err, None]


def test_unencodable_result_becomes_internal_error() -> None:
    enc = Encoder()
    resp = msgpack.unpackb(enc.response(1, None, {1, 2}))
    assert resp[:2] == [1, 1]
    assert resp[2]["code"] == "internal"
    assert enc.encode_errors == 1
    assert "set" in enc.last_encode_error
    resp = msgpack.unpackb(enc.response(2, None, 2**64))
    assert resp[2]["code"] == "internal"


def test_batch_with_an_unencodable_result_keeps_the_others() -> None:
    enc = Encoder()
    data = enc.responses([(1, None, "a"), (2, None, object()), (3, None, "c")])
    out: list[Any] = Decoder(side="client").feed(data)
    assert [r.msgid for r in out] == [1, 2, 3]
    assert out[0].result == "a"
    assert out[1].error["code"] == "internal"
    assert out[2].result == "c"
    # The batch packer is clean afterwards.
    assert Decoder(side="client").feed(enc.responses([(4, None, 1)])) == [Response(4, None, 1)]


def test_responses_batch_roundtrip() -> None:
    enc = Encoder()
    answers: list[tuple[int, Any, Any]] = [(i, None, i * 2) for i in range(100)]
    assert Decoder(side="client").feed(enc.responses(answers)) == [
        Response(i, None, i * 2) for i in range(100)
    ]
    assert enc.responses([]) == b""


# -- the server's raw fast path (feed_raw) --------------------------------------------------

# Shapes near the fast path's checks: each must come out of feed_raw exactly as feed
# classifies it (a raw list only for a well-formed request with a str method).
NEAR_MISSES: list[Any] = [
    [0, 1, b"ping", []],  # bin method: a Request, decoded
    [0, -1, "ping", []],
    [0, MSGID_MAX + 1, "ping", []],
    [0, True, "ping", []],
    [0, 1.0, "ping", []],
    [0, 1, "ping", {}],
    [0, 1, "ping", None],
    [0, 1, 7, []],
    [0, 1, "ping"],
    [0, 1, "ping", [], 5],
    [1, 1, None, "pong"],
    [2, "n", [1]],
    [2, 1, [1]],
]


def test_feed_raw_passes_a_well_formed_request_through_as_its_array() -> None:
    d = Decoder()
    (msg,) = d.feed_raw(packb([0, 7, "track", ["t", "f", 1]]))
    assert type(msg) is list
    assert msg == [0, 7, "track", ["t", "f", 1]]
    (msg,) = d.feed_raw(packb([0, MSGID_MAX, "ping", []]))
    assert msg == [0, MSGID_MAX, "ping", []]


@pytest.mark.parametrize("obj", NEAR_MISSES)
def test_feed_raw_classifies_everything_else_like_feed(obj: Any) -> None:
    data = packb(obj) + packb([0, 9, "ping", []])
    try:
        expected = Decoder().feed(data)
    except ProtocolError as exc:
        with pytest.raises(ProtocolError, match=re.escape(str(exc))):
            Decoder().feed_raw(data)
        return
    raw = Decoder().feed_raw(data)
    assert type(raw[0]) is not list
    assert raw[0] == expected[0]
    assert raw[1] == [0, 9, "ping", []]


@pytest.mark.parametrize("kind", [False, 0.0, -0.0])
def test_kind_that_equals_zero_but_is_not_int_zero(kind: Any) -> None:
    with pytest.raises(ProtocolError, match="unknown message type"):
        Decoder().feed_raw(packb([kind, 1, "ping", []]))
    with pytest.raises(ProtocolError, match="unknown message type"):
        Decoder().feed(packb([kind, 1, "ping", []]))


def test_feed_raw_protocol_error_carries_raw_messages_feed_decoded_ones() -> None:
    good = packb([0, 1, "ping", []]) + packb([0, 2, b"ping", []])
    with pytest.raises(ProtocolError) as info:
        Decoder().feed_raw(good + b"\xc1")
    assert info.value.messages == [[0, 1, "ping", []], Request(2, "ping", [])]
    with pytest.raises(ProtocolError) as info:
        Decoder().feed(good + b"\xc1")
    assert info.value.messages == [Request(1, "ping", []), Request(2, "ping", [])]
    assert all(type(m) is Request for m in info.value.messages)


@pytest.mark.parametrize("excess", [0, 1])
def test_frame_limit_exact_mid_pipeline(excess: int) -> None:
    # One frame of exactly the limit (or one byte over) between small ones, several limits'
    # worth of bytes in one feed: the per-frame check applies whatever the batch size.
    small = packb([0, 1, "p", []])
    big = packb([0, 2, "x", ["a" * 300]])
    d = Decoder(max_frame=len(big) - excess)
    data = small * 100 + big + small * 100
    if excess:
        with pytest.raises(ProtocolError, match="exceeds"):
            d.feed(data)
    else:
        assert len(d.feed(data)) == 201


@pytest.mark.parametrize("excess", [0, 1])
def test_frame_limit_exact_across_feeds(excess: int) -> None:
    # The frame's bytes arrive after small frames in the same reads: its start must be exact.
    small = packb([0, 1, "p", []])
    big = packb([0, 2, "x", ["a" * 300]])
    d = Decoder(max_frame=len(big) - excess)
    data = small * 3 + big + small
    cut = 3 * len(small) + len(big) // 2
    out = d.feed(data[:cut])
    assert len(out) == 3
    assert d.buffered == len(big) // 2
    if excess:
        with pytest.raises(ProtocolError):
            d.feed(data[cut:])
    else:
        assert len(d.feed(data[cut:])) == 2


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 65535, 65536, 65537])
def test_response_arrays_every_array_header_size(n: int) -> None:
    enc = Encoder()
    data = enc.response_arrays([[1, i, None, i] for i in range(n)])
    assert data == enc.responses([(i, None, i) for i in range(n)])
    out = Decoder(side="client", max_frame=1 << 20).feed(data)
    assert len(out) == n
    assert all(r == Response(i, None, i) for i, r in enumerate(out))


def test_response_arrays_with_an_unencodable_result_keeps_the_others() -> None:
    enc = Encoder()
    data = enc.response_arrays([[1, 1, None, "a"], [1, 2, None, {1}], [1, 3, None, "c"]])
    out: list[Any] = Decoder(side="client").feed(data)
    assert [r.msgid for r in out] == [1, 2, 3]
    assert out[1].error["code"] == "internal"
    assert enc.encode_errors == 1
    assert enc.response_arrays([[1, 4, None, 1]]) == enc.response(4, None, 1)
