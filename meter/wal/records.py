"""Record framing and record types of the write-ahead log. Pure: bytes in, records out.

A frame is a 12-byte header and a MessagePack payload::

    u32 length | u32 crc32(payload) | u32 crc32(first 8 header bytes)

The header has its own CRC so a corrupted length is told apart from a record cut short. A
payload is an array whose first element is the record type (below).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any, Final

import msgpack

HEADER: Final = struct.Struct("<III")
_LEN_CRC: Final = struct.Struct("<II")
#: A record larger than this is corruption, whatever its CRC says.
MAX_RECORD: Final = 256 << 20

# Record types: the first element of every payload. Key fields are (tenant, feature, period).
#: ``[NOOP]``: written when probing a failed disk.
NOOP: Final = 0
#: ``[SEGMENT, node_id, format, number]``: first record of every segment.
SEGMENT: Final = 1
#: ``[TRACK, t, f, p, qty]``
TRACK: Final = 2
#: ``[TRACK_ID, t, f, p, qty, id, fingerprint, answer, expires]``
TRACK_ID: Final = 3
#: ``[TRACK_MANY, [item, ...]]``, each item a TRACK or TRACK_ID record without its type.
TRACK_MANY: Final = 4
#: ``[RESERVE, lease, t, f, p, qty, deadline, id, fingerprint, expires]`` (id may be nil)
RESERVE: Final = 5
#: ``[COMMIT, lease, t, f, p, qty, deadline, actual, answer, done_expires, id, fp, expires]``
COMMIT: Final = 6
#: ``[RELEASE, lease, t, f, p, qty, deadline, done_expires, id, fp, expires]``
RELEASE: Final = 7
#: ``[FLUSH, [[t, f, p, seq, delta], ...]]``: deltas taken for a write, logged before sending.
FLUSH: Final = 8
#: ``[STATE, [[t, f, p, seq, inflight, pending], ...]]``: a key's unstored units, absolute.
STATE: Final = 9
#: ``[IDS, [[id, fingerprint, answer, expires], ...]]``: remembered request ids.
IDS: Final = 10
#: ``[LEASES, [[lease, t, f, p, qty, deadline], ...]]``: open reservations.
LEASES: Final = 11
#: ``[DONE, [[lease, code, answer, expires], ...]]``: finished reservations (code 1 commit,
#: answer ``[actual, value]``; code 2 release).
DONE: Final = 12
#: ``[CHECKPOINT_END, number]``: every record of the checkpoint begun in segment ``number``
#: is before this one; older segments are no longer needed.
CHECKPOINT_END: Final = 13

FORMAT: Final = 1

_crc = zlib.crc32
_packb = msgpack.Packer(use_bin_type=True).pack


def frame(record: list[Any]) -> bytes:
    """One record as framed bytes."""
    payload: bytes = _packb(record)
    head = _LEN_CRC.pack(len(payload), _crc(payload))
    return head + struct.pack("<I", _crc(head)) + payload


def frames(records: list[list[Any]]) -> bytes:
    """Many records as one buffer (one write)."""
    return b"".join([frame(r) for r in records])


@dataclass(frozen=True, slots=True)
class Damage:
    """Where a scan stopped: ``torn`` (a tail cut short: cut it) or corruption (stop)."""

    offset: int
    torn: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Scan:
    """The records of one segment up to ``end``, and what stopped the scan, if anything."""

    records: list[list[Any]]
    end: int
    damage: Damage | None


def _zeros(data: bytes | memoryview, start: int) -> bool:
    return not any(data[start:])


def scan(data: bytes) -> Scan:
    """Decode every whole record of a segment's bytes.

    A record cut short at the end of the data (or followed only by zero bytes, as a file
    extended but not written is) is *torn*: the scan ends before it. A bad record followed by
    anything else is corruption.
    """
    records: list[list[Any]] = []
    view = memoryview(data)
    size = len(data)
    pos = 0
    while pos < size:
        if size - pos < HEADER.size:
            return Scan(records, pos, Damage(pos, True, "header cut short"))
        length, pcrc, hcrc = HEADER.unpack_from(view, pos)
        if _crc(view[pos : pos + 8]) != hcrc or length > MAX_RECORD:
            torn = _zeros(view, pos)
            return Scan(records, pos, Damage(pos, torn, "bad record header"))
        start = pos + HEADER.size
        end = start + length
        if end > size:
            return Scan(records, pos, Damage(pos, True, "record cut short"))
        payload = view[start:end]
        if _crc(payload) != pcrc:
            torn = end == size or _zeros(view, end)
            return Scan(records, pos, Damage(pos, torn, "record checksum mismatch"))
        try:
            record = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
        except Exception as exc:  # the CRC matched: this is a bug or deliberate damage
            return Scan(records, pos, Damage(pos, False, f"undecodable record: {exc}"))
        if not isinstance(record, list) or not record or not isinstance(record[0], int):
            return Scan(records, pos, Damage(pos, False, "record is not a typed array"))
        records.append(record)
        pos = end
    return Scan(records, pos, None)
