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
#: ``[BATCH, [record, ...]]``: the records of one commit, in one frame, so a commit cut short
#: by a crash is one damaged frame at the end, never a hole between whole records.
BATCH: Final = 14
#: ``[WARM, [[t, f, p], ...]]``: keys the node had in memory when a checkpoint was written,
#: most recently used first: what a restart reads ahead. A hint, not state.
WARM: Final = 15
#: ``[EXPIRE, lease, t, f, p, qty, deadline]``: the node released a reservation at its
#: deadline (by its monotonic clock): it never comes back, whatever the wall clock says.
EXPIRE: Final = 16

FORMAT: Final = 1

_crc = zlib.crc32
_packb = msgpack.Packer(use_bin_type=True).pack


def frame(record: list[Any]) -> bytes:
    """One record as framed bytes."""
    payload: bytes = _packb(record)
    head = _LEN_CRC.pack(len(payload), _crc(payload))
    return head + struct.pack("<I", _crc(head)) + payload


def frames(records: list[list[Any]]) -> bytes:
    """The records of one commit as one :data:`BATCH` frame (one write)."""
    return frame([BATCH, records]) if len(records) > 1 else frame(records[0])


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


def _valid_frame_at(view: memoryview, pos: int, size: int) -> bool:
    if size - pos < HEADER.size:
        return False
    length, pcrc, hcrc = HEADER.unpack_from(view, pos)
    if _crc(view[pos : pos + 8]) != hcrc or length > MAX_RECORD:
        return False
    end = pos + HEADER.size + length
    return end <= size and bool(_crc(view[pos + HEADER.size : end]) == pcrc)


#: How far past a damaged frame :func:`scan` looks for a whole one (to tell a torn tail from
#: damage in the middle). A crash tears at most the last commit; a commit is far smaller.
SEARCH_LIMIT: Final = 4 << 20


def _whole_frame_after(view: memoryview, start: int, size: int) -> int | None:
    """The offset of the first whole, valid frame after ``start`` (within SEARCH_LIMIT)."""
    stop = min(size, start + SEARCH_LIMIT)
    for pos in range(start + 1, stop):
        if _valid_frame_at(view, pos, size):
            return pos
    return None


def _zero_tail(data: bytes, start: int) -> bool:
    """Whether every byte from ``start`` on is zero (a preallocated, unwritten tail)."""
    return data.count(0, start) == len(data) - start


def scan(data: bytes) -> Scan:
    """Decode every whole record of a segment's bytes (:data:`BATCH` frames unpacked).

    Zero bytes after the last frame are the unwritten rest of a preallocated segment. A damaged
    frame after which no whole frame follows is a *torn tail*: what a crash leaves of the last
    commit (cut short, or with a page never written, even in its middle). The scan ends before
    it. A damaged frame followed by a whole one is corruption.
    """
    records: list[list[Any]] = []
    view = memoryview(data)
    size = len(data)
    pos = 0
    while pos < size:
        if data[pos] == 0 and _zero_tail(data, pos):
            return Scan(records, pos, None)  # the rest of a preallocated segment
        if size - pos < HEADER.size:
            return Scan(records, pos, Damage(pos, True, "header cut short"))
        length, pcrc, hcrc = HEADER.unpack_from(view, pos)
        reason = ""
        if _crc(view[pos : pos + 8]) != hcrc or length > MAX_RECORD:
            reason = "bad record header"
        else:
            start = pos + HEADER.size
            end = start + length
            if end > size:
                reason = "record cut short"
            elif _crc(view[start:end]) != pcrc:
                reason = "record checksum mismatch"
        if reason:
            after = _whole_frame_after(view, pos, size)
            if after is not None:
                reason += f"; a whole record follows at byte {after}"
            return Scan(records, pos, Damage(pos, after is None, reason))
        try:
            record = msgpack.unpackb(view[start:end], raw=False, strict_map_key=False)
        except Exception as exc:  # the CRC matched: this is a bug or deliberate damage
            return Scan(records, pos, Damage(pos, False, f"undecodable record: {exc}"))
        if not isinstance(record, list) or not record or not isinstance(record[0], int):
            return Scan(records, pos, Damage(pos, False, "record is not a typed array"))
        if record[0] == BATCH:
            if len(record) != 2 or not isinstance(record[1], list):
                return Scan(records, pos, Damage(pos, False, "malformed batch"))
            records.extend(record[1])
        else:
            records.append(record)
        pos = end
    return Scan(records, pos, None)
