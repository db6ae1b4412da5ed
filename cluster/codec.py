"""The gossip message codec. Pure: bytes in, values out; no I/O, no clock, no exceptions escape.

A frame is::

    b"mg" | version (1 byte) | flags (1 byte) | payload (MessagePack) | [HMAC-SHA256, 32 bytes]

``flags`` bit 0 says a MAC is appended; the MAC covers every byte before it. The payload is the
array ``[cluster, sender, incarnation, seq, sent_at, kind, body]``:

``cluster``      the cluster name (two clusters may share one Redis);
``sender``       the sending node's id;
``incarnation``  a number the sender picks at start, larger than any earlier one of its own
                 (its start time in ns, or the last one + 1 if that is larger: the node keeps
                 it in its data dir), so a peer can tell a restart from a replay;
``seq``          the sender's message sequence within the incarnation, 1, 2, 3, ... (gaps are
                 lost messages);
``sent_at``      the sender's wall clock in seconds (for the gossip lag);
``kind``         0 heartbeat (body ``nil``), 1 deltas, 2 flush announcements, 3 limits changed,
                 4 holds, 5 alert, 6 readings, 7 values;
``body``         heartbeat of a sharded cluster: ``[seq, ...]``, the sender's last message
                 sequence on each shard (so a lost tail of a shard is seen);
                 deltas: ``[[tenant, feature, period, flush_seq, delta], ...]``;
                 announcements: ``[[tenant, feature, period, total, {node: seq}], ...]``;
                 limits changed: ``[version]``, the stored limits' new version;
                 holds: ``[[tenant, feature, period, held], ...]``, every counter the sender
                 holds reserved units on, as it is now (a whole snapshot: a counter left out
                 holds nothing);
                 alert: ``[id, tenant, feature, period, threshold, threshold_units, limit,
                 value, node, at]``, a threshold alert whose claim the sender won
                 (docs/quotas.md);
                 readings: ``[[tenant, feature, period, kind, value, at_ms, node], ...]``,
                 gauges' readings (``kind`` 0 ``max``, 1 ``latest``), observed by the sender
                 or stored (docs/dimensions.md);
                 values: ``[[tenant, feature, period, value], ...]``, unique features' values
                 storage holds claimed, as the sender learned them (docs/dimensions.md).

A sharded cluster (``gossip_shards`` K > 1, ADR 0024) appends an eighth element, ``shard``, to
the frames of its data channels (0..K-1): each shard numbers its frames on its own, and so does
the control channel (frames of seven elements). A frame of the other shape than the codec's K
is refused (``shards``).

Deltas and totals that do not fit a signed 64-bit integer travel as decimal strings.
:func:`decode` returns a :class:`Message` or a :class:`Rejected` with a reason; it never raises.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast

import msgpack

MAGIC: Final = b"mg"
VERSION: Final = 1
FLAG_MAC: Final = 0x01
HEADER_LEN: Final = 4
MAC_LEN: Final = 32
#: The largest frame accepted or produced (Redis allows far more; peers must parse it).
MAX_FRAME_BYTES: Final = 1 << 20
#: Longest string field (node ids, names); generous against the node's own limits.
MAX_STR: Final = 1024
MAX_ITEMS: Final = 100_000
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
#: Longest decimal string accepted for a big integer.
MAX_BIGINT_DIGITS: Final = 80

Kind = Literal["heartbeat", "deltas", "announce", "limits", "holds", "alert", "readings", "values"]
_KIND_CODE: Final[dict[str, int]] = {
    "heartbeat": 0,
    "deltas": 1,
    "announce": 2,
    "limits": 3,
    "holds": 4,
    "alert": 5,
    "readings": 6,
    "values": 7,
}
#: Kinds a sharded cluster sends on its control channel (the others go on data shards).
CONTROL_KINDS: Final = frozenset({"heartbeat", "limits", "holds", "alert"})
_GAUGE_KINDS: Final[tuple[str, str]] = ("max", "latest")
_CODE_KIND: Final[dict[int, Kind]] = {v: cast(Kind, k) for k, v in _KIND_CODE.items()}

Reason = Literal["oversize", "malformed", "version", "unsigned", "bad_mac", "cluster", "shards"]
#: Every rejection reason, for status maps that list zeros too.
REASONS: Final[tuple[Reason, ...]] = (
    "oversize",
    "malformed",
    "version",
    "unsigned",
    "bad_mac",
    "cluster",
    "shards",
)

DeltaItem = tuple[str, str, str, int, int]
"""``(tenant, feature, period, flush_seq, delta)``."""
AnnounceItem = tuple[str, str, str, int, Mapping[str, int]]
"""``(tenant, feature, period, total, {node: last applied seq})``."""
HoldItem = tuple[str, str, str, int]
"""``(tenant, feature, period, units held by the sender's open reservations)``."""
AlertItem = tuple[str, str, str, str, int, int, int, int, str, float]
"""``(id, tenant, feature, period, threshold %, threshold units, limit, value, node, at)``."""
ReadingItem = tuple[str, str, str, str, int, int, str]
"""``(tenant, feature, period, kind, value, at_ms, node)``: a gauge's reading (``kind`` ``max``
or ``latest``)."""
ValueItem = tuple[str, str, str, str]
"""``(tenant, feature, period, value)``: a unique feature's value storage holds claimed."""


@dataclass(frozen=True, slots=True)
class Header:
    """Who sent a message and when."""

    cluster: str
    sender: str
    incarnation: int
    seq: int
    sent_at: float
    #: The data shard the frame travels on; ``None``: the control channel (the only channel
    #: of an unsharded cluster).
    shard: int | None = None


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded, validated message."""

    header: Header
    kind: Kind
    deltas: tuple[DeltaItem, ...] = ()
    announcements: tuple[AnnounceItem, ...] = ()
    #: ``limits``: the stored limits' version after the change the sender made.
    limits_version: int = 0
    #: ``holds``: the sender's reserved units per counter (all of them).
    holds: tuple[HoldItem, ...] = ()
    #: ``alert``: the alert the sender fired.
    alert: AlertItem | None = None
    #: ``readings``: gauges' readings.
    readings: tuple[ReadingItem, ...] = ()
    #: ``values``: unique features' values known claimed.
    values: tuple[ValueItem, ...] = ()
    #: ``heartbeat`` of a sharded cluster: the sender's last sequence on each shard.
    shard_seqs: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Rejected:
    """Why a frame was refused; ``detail`` is for logs only."""

    reason: Reason
    detail: str = field(default="", compare=False)


class _Bad(Exception):
    """Internal: a payload field is wrong (never leaves this module)."""


class Codec:
    """Encodes this node's messages and decodes peers'. ``secret`` turns on HMAC-SHA256;
    ``shards`` is the cluster's K.

    With a secret, every frame sent carries a MAC and every frame received must carry a valid
    one. Without a secret, MACs on received frames are not checked (there is no key).
    """

    def __init__(self, cluster: str, secret: str | bytes | None = None, shards: int = 1) -> None:
        self.cluster = cluster
        self.shards = shards
        key = secret.encode() if isinstance(secret, str) else secret
        self._key = key or None

    @property
    def authenticated(self) -> bool:
        """Whether frames are signed and checked (a secret is set)."""
        return self._key is not None

    # -- encoding ----------------------------------------------------------------------------

    def encode(
        self,
        header: Header,
        kind: Kind,
        items: Sequence[DeltaItem]
        | Sequence[AnnounceItem]
        | Sequence[HoldItem]
        | Sequence[AlertItem]
        | Sequence[ReadingItem]
        | Sequence[ValueItem] = (),
        limits_version: int = 0,
        shard_seqs: Sequence[int] = (),
    ) -> bytes:
        """One frame. ``items`` are deltas or announcements according to ``kind``;
        ``limits_version`` is the body of a ``limits`` frame, ``shard_seqs`` of a sharded
        cluster's heartbeat."""
        body: Any
        if kind == "heartbeat":
            body = list(shard_seqs) if self.shards > 1 else None
        elif kind == "limits":
            body = [limits_version]
        elif kind == "holds":
            body = [list(cast(HoldItem, i)) for i in items]
        elif kind == "alert":
            a = cast(AlertItem, items[0])
            body = [*a[:6], _wire_int(a[6]), _wire_int(a[7]), a[8], a[9]]
        elif kind == "readings":
            body = [[t, f, p, _GAUGE_KINDS.index(g), _wire_int(v), a, n]
                    for t, f, p, g, v, a, n in cast(Sequence[ReadingItem], items)]  # fmt: skip
        elif kind == "values":
            body = [list(cast(ValueItem, i)) for i in items]
        elif kind == "deltas":
            deltas = cast(Sequence[DeltaItem], items)
            body = [[t, f, p, s, _wire_int(d)] for t, f, p, s, d in deltas]
        else:
            anns = cast(Sequence[AnnounceItem], items)
            body = [[t, f, p, _wire_int(n), dict(q)] for t, f, p, n, q in anns]
        fields = [
            header.cluster,
            header.sender,
            header.incarnation,
            header.seq,
            header.sent_at,
            _KIND_CODE[kind],
            body,
        ]
        if header.shard is not None:
            fields.append(header.shard)
        payload: bytes = msgpack.packb(fields, use_bin_type=True)
        flags = FLAG_MAC if self._key else 0
        head = MAGIC + struct.pack("BB", VERSION, flags)
        frame = head + payload
        if self._key:
            frame += hmac.new(self._key, frame, hashlib.sha256).digest()
        return frame

    # -- decoding ----------------------------------------------------------------------------

    def decode(self, frame: object) -> Message | Rejected:
        """Validate and decode one frame; never raises."""
        try:
            return self._decode(frame)
        except Exception as exc:  # a codec bug must not take the receive loop down
            return Rejected("malformed", f"{type(exc).__name__}: {exc}")

    def _decode(self, data: object) -> Message | Rejected:
        if not isinstance(data, bytes | bytearray | memoryview):
            return Rejected("malformed", "not bytes")
        frame = bytes(data)
        if len(frame) > MAX_FRAME_BYTES:
            return Rejected("oversize", f"{len(frame)} bytes")
        if len(frame) < HEADER_LEN or frame[:2] != MAGIC:
            return Rejected("malformed", "no header")
        version, flags = frame[2], frame[3]
        if version != VERSION:
            return Rejected("version", f"version {version}")
        if flags & ~FLAG_MAC:
            return Rejected("malformed", f"unknown flags {flags:#x}")
        end = len(frame)
        if flags & FLAG_MAC:
            end -= MAC_LEN
            if end <= HEADER_LEN:
                return Rejected("malformed", "truncated MAC")
            if self._key is not None:
                want = hmac.new(self._key, frame[:end], hashlib.sha256).digest()
                if not hmac.compare_digest(want, frame[end:]):
                    return Rejected("bad_mac")
        elif self._key is not None:
            return Rejected("unsigned")
        try:
            raw = msgpack.unpackb(
                frame[HEADER_LEN:end],
                raw=False,
                strict_map_key=True,
            )
        except Exception as exc:
            return Rejected("malformed", f"msgpack: {type(exc).__name__}")
        try:
            return self._message(raw)
        except _Bad as exc:
            return Rejected("malformed", str(exc))

    def _message(self, raw: Any) -> Message | Rejected:
        if not isinstance(raw, list) or len(raw) not in (7, 8):
            raise _Bad("payload is not a 7- or 8-element array")
        cluster, sender, incarnation, seq, sent_at, code, body = raw[:7]
        cluster = _str(cluster, "cluster")
        if cluster != self.cluster:
            return Rejected("cluster", f"cluster {cluster[:64]!r}")
        shard: int | None = None
        if len(raw) == 8:
            shard = raw[7]
            if self.shards == 1 or type(shard) is not int or not 0 <= shard < self.shards:
                return Rejected("shards", f"shard {shard!r} in a cluster of {self.shards}")
        header = Header(
            cluster,
            _str(sender, "sender"),
            _uint(incarnation, "incarnation"),
            _uint(seq, "seq", lo=1),
            _time(sent_at),
            shard,
        )
        kind = _CODE_KIND.get(code) if type(code) is int else None
        if kind is None:
            raise _Bad(f"unknown kind {code!r}")
        if (shard is None) != (kind in CONTROL_KINDS or self.shards == 1):
            raise _Bad(f"{kind} frame on the {'control' if shard is None else 'data'} channel")
        if kind == "heartbeat":
            if self.shards == 1:
                if body is not None:
                    raise _Bad("heartbeat with a body")
                return Message(header, kind)
            if not isinstance(body, list) or len(body) != self.shards:
                return Rejected("shards", f"heartbeat of {_count(body)} shards, not {self.shards}")
            seqs = tuple(_uint(s, "shard seq") for s in body)
            return Message(header, kind, shard_seqs=seqs)
        if kind == "limits":
            if not isinstance(body, list) or len(body) != 1:
                raise _Bad("limits body is not [version]")
            return Message(header, kind, limits_version=_uint(body[0], "limits version"))
        if kind == "alert":
            return Message(header, kind, alert=_alert(body))
        if not isinstance(body, list) or len(body) > MAX_ITEMS:
            raise _Bad("body is not an array (or too long)")
        if kind == "deltas":
            return Message(header, kind, deltas=_deltas(body))
        if kind == "holds":
            return Message(header, kind, holds=tuple(_hold(i) for i in body))
        if kind == "readings":
            return Message(header, kind, readings=tuple(_reading(i) for i in body))
        if kind == "values":
            return Message(header, kind, values=tuple(_value(i) for i in body))
        return Message(header, kind, announcements=tuple(_announce(i) for i in body))


def _count(body: Any) -> object:
    return len(body) if isinstance(body, list) else "no"


def _wire_int(n: int) -> int | str:
    return n if INT64_MIN <= n <= INT64_MAX else str(n)


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_STR:
        raise _Bad(f"{what} is not a non-empty string")
    return v


def _uint(v: Any, what: str, lo: int = 0) -> int:
    if type(v) is not int or not lo <= v <= INT64_MAX:
        raise _Bad(f"{what} is not an integer in [{lo}, 2^63)")
    return v


def _bigint(v: Any, what: str) -> int:
    if type(v) is int:
        return v
    if isinstance(v, str) and 0 < len(v) <= MAX_BIGINT_DIGITS:
        digits = v[1:] if v[0] == "-" else v
        if digits.isascii() and digits.isdigit():
            return int(v)
    raise _Bad(f"{what} is not an integer")


def _time(v: Any) -> float:
    if type(v) not in (int, float) or not 0 <= v < 1e11:  # also refuses NaN
        raise _Bad("sent_at is not a time")
    return float(v)


def _key(item: Any, what: str) -> tuple[str, str, str]:
    if not isinstance(item, list) or len(item) != 5:
        raise _Bad(f"{what} item is not a 5-element array")
    return _str(item[0], "tenant"), _str(item[1], "feature"), _str(item[2], "period")


def _delta(item: Any) -> DeltaItem:
    t, f, p = _key(item, "delta")
    return (t, f, p, _uint(item[3], "flush_seq", lo=1), _bigint(item[4], "delta"))


def _deltas(body: list[Any]) -> tuple[DeltaItem, ...]:
    """Every item of a deltas body, checked as :func:`_delta` does; the common shape (three
    short strings, two 64-bit ints) is checked inline: this runs for every delta a node hears
    (profiled: the per-field calls were most of a loaded node's decoding)."""
    out: list[DeltaItem] = []
    append = out.append
    for item in body:
        if type(item) is list and len(item) == 5:
            t, f, p, seq, delta = item
            if (
                type(t) is str and 0 < len(t) <= MAX_STR
                and type(f) is str and 0 < len(f) <= MAX_STR
                and type(p) is str and 0 < len(p) <= MAX_STR
                and type(seq) is int and 1 <= seq <= INT64_MAX
                and type(delta) is int
            ):  # fmt: skip
                append((t, f, p, seq, delta))
                continue
        append(_delta(item))  # the uncommon shapes (big integers), or raises _Bad
    return tuple(out)


def _hold(item: Any) -> HoldItem:
    if not isinstance(item, list) or len(item) != 4:
        raise _Bad("hold is not [tenant, feature, period, held]")
    return (_str(item[0], "tenant"), _str(item[1], "feature"), _str(item[2], "period"),
            _uint(item[3], "held"))  # fmt: skip


def _reading(item: Any) -> ReadingItem:
    if not isinstance(item, list) or len(item) != 7:
        raise _Bad("reading is not [tenant, feature, period, kind, value, at_ms, node]")
    t, f, p, g, v, a, n = item
    if type(g) is not int or not 0 <= g < len(_GAUGE_KINDS):
        raise _Bad(f"reading kind {g!r} is not 0 or 1")
    if type(n) is not str or len(n) > MAX_STR:  # (empty: a counter's item read as a gauge)
        raise _Bad("reading node is not a string")
    return (_str(t, "tenant"), _str(f, "feature"), _str(p, "period"), _GAUGE_KINDS[g],
            _bigint(v, "value"), _uint(a, "at_ms"), n)  # fmt: skip


def _value(item: Any) -> ValueItem:
    if not isinstance(item, list) or len(item) != 4:
        raise _Bad("value is not [tenant, feature, period, value]")
    return (_str(item[0], "tenant"), _str(item[1], "feature"), _str(item[2], "period"),
            _str(item[3], "value"))  # fmt: skip


def _alert(body: Any) -> AlertItem:
    if not isinstance(body, list) or len(body) != 10:
        raise _Bad("alert body is not a 10-element array")
    aid, t, f, p, pct, units, limit, value, node, at = body
    return (_str(aid, "alert id"), _str(t, "tenant"), _str(f, "feature"), _str(p, "period"),
            _uint(pct, "threshold"), _bigint(units, "threshold units"), _bigint(limit, "limit"),
            _bigint(value, "value"), _str(node, "node"), _time(at))  # fmt: skip


def _announce(item: Any) -> AnnounceItem:
    t, f, p = _key(item, "announcement")
    seqs = item[4]
    if not isinstance(seqs, dict) or len(seqs) > MAX_ITEMS:
        raise _Bad("announcement seqs is not a map")
    clean = {_str(n, "node"): _uint(s, "node seq") for n, s in seqs.items()}
    return (t, f, p, _bigint(item[3], "total"), clean)


def chunks(items: Sequence[Any], budget: int = MAX_FRAME_BYTES // 2) -> Iterator[Sequence[Any]]:
    """Split ``items`` (delta, announcement, reading or value tuples) into runs that each
    encode under ``budget`` bytes, estimated from their string lengths (ints cost at most 9
    bytes each)."""
    start = 0
    size = 0
    for i, item in enumerate(items):
        cost = 16 + len(item[0]) + len(item[1]) + len(item[2]) + 18
        for extra in item[3:]:
            if isinstance(extra, str):  # (a value, a gauge's kind or node)
                cost += len(extra)
            elif isinstance(extra, Mapping):
                cost += sum(len(n) + 11 for n in extra)
        if i > start and size + cost > budget:
            yield items[start:i]
            start, size = i, 0
        size += cost
    if start < len(items):
        yield items[start:]
