"""Record framing and record types of the write-ahead log. Pure: bytes in, records out.

A frame is a 12-byte header and a MessagePack payload::

    u32 length | u32 crc32(payload) | u32 crc32(first 8 header bytes)

The header has its own CRC so a corrupted length is told apart from a record cut short. A
payload is an array whose first element is the record type (below).

Format 2 salts every CRC but the first frame's with the segment's own random ``salt`` (kept in
its ``SEGMENT`` record, which is framed unsalted): bytes a client chose (a request id, a
tenant name) can never look like a whole frame, so a torn tail is told from damage in the
middle by the log's structure alone (ADR 0013). Format 1 segments (no salt) still read.
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
#: ``[SEGMENT, node_id, format, number, created, salt, mode]``: first record of every segment
#: (format 1: no ``salt`` and ``mode``; ``mode`` is the durability mode it was written in).
SEGMENT: Final = 1
#: ``[TRACK, t, f, p, qty]``
TRACK: Final = 2
#: ``[TRACK_ID, t, f, p, qty, id, fingerprint, answer, expires, credits?]`` (``credits``: what
#: the call spent, ``[[tenant, n], ...]`` or ``false``; ``true``, or no field, from older
#: builds: not known how many)
TRACK_ID: Final = 3
#: ``[TRACK_MANY, [item, ...]]``, each item a TRACK or TRACK_ID record without its type; an
#: item with an id ends with ``[[t, f, p], ...]``, the other keys its call counted the same
#: ``qty`` on (levels, dimension counters: counted by their own items; what a void takes
#: back), then the credits it spent (as in TRACK_ID).
TRACK_MANY: Final = 4
#: ``[RESERVE, lease, t, f, p, qty, deadline, id, fingerprint, expires, dims?]`` (id may be
#: nil; ``dims``: the names of the dimension counters a commit counts on too, when given)
RESERVE: Final = 5
#: ``[COMMIT, lease, t, f, p, qty, deadline, actual, answer, done_expires, id, fp, expires,
#: dims?, credits?]`` (``actual`` counted on each of ``dims`` too; with an id, ``credits`` as
#: in TRACK_ID, and then ``dims`` is there, perhaps empty)
COMMIT: Final = 6
#: ``[RELEASE, lease, t, f, p, qty, deadline, done_expires, id, fp, expires, dims?]``
RELEASE: Final = 7
#: ``[FLUSH, [[t, f, p, seq, delta], ...]]``: deltas taken for a write, logged before sending.
FLUSH: Final = 8
#: ``[STATE, [[t, f, p, seq, inflight, pending], ...]]``: a key's unstored units, absolute.
STATE: Final = 9
#: ``[IDS, [[id, fingerprint, answer, expires, effect?], ...]]``: remembered request ids;
#: ``effect``, ``[qty, [[t, f, p], ...], voided, credits]``, what a counting call counted.
IDS: Final = 10
#: ``[LEASES, [[lease, t, f, p, qty, deadline, dims?], ...]]``: open reservations.
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
#: ``[EXPIRE, lease, t, f, p, qty, deadline, escrowed, dims?]``: the node released a
#: reservation at its deadline (by its monotonic clock): it never comes back, whatever the
#: wall clock says.
EXPIRE: Final = 16
#: ``[SYNCED, offset]``: the segment's bytes before ``offset`` were on disk (synced) when this
#: record was written (``interval`` mode): damage before it is corruption, never a torn tail.
SYNCED: Final = 17
#: ``[SHARES, [[t, f, p, run, admitted], ...]]``: what the process ``run`` had admitted under
#: its share of each counter's strict budget or credit pool (absolute): a successor closes
#: that share at this, not at its cap (nothing stranded by a crash).
SHARES: Final = 18
#: ``[GAUGE, t, f, p, kind, value, at_ms, node, before, id, fingerprint, answer, expires,
#: before_mine]``: an observation of a gauge (``kind`` ``max`` or ``latest``; ``before`` and
#: ``before_mine``: the gauge's reading and this node's unstored one before it, ``[value,
#: at_ms, node]`` or nil, for an undo; ``id`` nil without a request id).
GAUGE: Final = 19
#: ``[GAUGES, [[t, f, p, kind, value, at_ms, node], ...]]``: gauges' readings of this node that
#: storage may not hold (a checkpoint's restatement).
GAUGES: Final = 20
#: ``[CLAIM, t, f, p, value, claimant]``: a unique feature's value about to be claimed in
#: storage under ``claimant`` (on disk before the claim is sent; ADR 0018).
CLAIM: Final = 21
#: ``[CLAIMED, t, f, p, value, claimant, won, id, fingerprint, answer, expires, others?]``: the
#: claim's outcome; ``won``: the value counted 1 on the key (``id`` nil without a request id);
#: ``others``, with an id and won: ``[[t, f, p, claimant], ...]``, the call's other levels
#: whose claims it won (what a void takes back with it; no field from older builds: never
#: voided).
CLAIMED: Final = 22
#: ``[CLAIMS, [[t, f, p, value, claimant], ...]]``: claims without an outcome (a checkpoint's
#: restatement).
CLAIMS: Final = 23
#: ``[VOID, id, qty, [[t, f, p], ...], void_id, fingerprint, answer, expires, credits?,
#: unique?]``: the call counted under ``id`` taken back: ``-qty`` on each key (``void_id`` nil
#: without one), ``credits`` (as in TRACK_ID) given back to the pools that paid them, and for
#: a unique value, ``unique``: ``[value, [claimant, ...]]`` (the claimant of each key), each
#: to be marked voided in storage.
VOID: Final = 24
#: ``[VALUE_VOIDS, [[t, f, p, value, claimant], ...]]``: voided values not known marked in
#: storage (a checkpoint's restatement).
VALUE_VOIDS: Final = 25
#: ``[UNITS, [[period, feature, units], ...], [[t, f, p, seq], ...]]``: the units this node
#: took for storage, by period and feature, and the takes among them storage had not
#: acknowledged (a checkpoint's restatement; it replaces every earlier count). Between
#: checkpoints, each ``FLUSH`` item of a take not counted yet (another sequence than the
#: key's last counted one) adds its delta (dimension counters left out).
UNITS: Final = 26

FORMAT: Final = 2

#: Credits a call spent (logged with it: TRACK_ID, TRACK_MANY items, COMMIT, VOID, IDS), by
#: the tenant whose pool paid: ``((tenant, credits), ...)``; None when an older build logged
#: only that it spent some (then a void cannot give them back).
Spent = tuple[tuple[str, int], ...] | None

#: A unique value a call counted, and the claimant that won it at each key it counted on
#: (logged with it: CLAIMED, VOID, IDS).
Won = tuple[str, tuple[str, ...]]


#: What a record of a call under an id that an older build wrote (no credits field) says of the
#: credits it spent: not how many (so a void refuses it, rather than give back none).
UNSAID = True


def spent_to_log(credits: Spent) -> Any:
    """How a log record carries ``credits``: ``false`` (none), ``[[tenant, n], ...]``, or
    ``true`` (some, not known how many: as an older build wrote it)."""
    if credits is None:
        return True
    return [list(c) for c in credits] if credits else False


def spent_from_log(raw: Any) -> Spent:
    """The inverse of :func:`spent_to_log` (an absent field is read as ``false``)."""
    if raw is True:
        return None
    if not raw:
        return ()
    return tuple((str(t), int(n)) for t, n in raw)


_crc = zlib.crc32
_packb = msgpack.Packer(use_bin_type=True).pack


def frame(record: list[Any], salt: int = 0) -> bytes:
    """One record as framed bytes (its CRCs salted with the segment's ``salt``)."""
    payload: bytes = _packb(record)
    head = _LEN_CRC.pack(len(payload), _crc(payload, salt))
    return head + struct.pack("<I", _crc(head, salt)) + payload


def frames(records: list[list[Any]], salt: int = 0) -> bytes:
    """The records of one commit as one :data:`BATCH` frame (one write)."""
    return frame([BATCH, records], salt) if len(records) > 1 else frame(records[0], salt)


@dataclass(frozen=True, slots=True)
class Damage:
    """Where a scan stopped: ``torn`` (a tail cut short: cut it) or corruption (stop)."""

    offset: int
    torn: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Scan:
    """The records of one segment up to ``end``, and what stopped the scan, if anything;
    the durability ``mode`` the segment says it was written in (None: format 1, unsaid) and
    ``synced``, the furthest offset a :data:`SYNCED` record of the segment vouches for (in
    ``interval`` mode, also one in a whole frame past the damage)."""

    records: list[list[Any]]
    end: int
    damage: Damage | None
    mode: str | None = None
    synced: int = 0


def _valid_frame_at(view: memoryview, pos: int, size: int, salt: int) -> bool:
    if size - pos < HEADER.size:
        return False
    length, pcrc, hcrc = HEADER.unpack_from(view, pos)
    if _crc(view[pos : pos + 8], salt) != hcrc or length > MAX_RECORD:
        return False
    end = pos + HEADER.size + length
    return end <= size and bool(_crc(view[pos + HEADER.size : end], salt) == pcrc)


#: A segment's first record (its SEGMENT record) is shorter than this.
HEAD_MAX: Final = 4096
#: How far past a damaged frame :func:`scan` looks for a whole one (to tell a torn tail from
#: damage in the middle). A crash tears at most the last commit; a commit is far smaller.
SEARCH_LIMIT: Final = 4 << 20


def _whole_frame_after(view: memoryview, start: int, size: int, salt: int) -> int | None:
    """The offset of the first whole, valid frame after ``start`` (within SEARCH_LIMIT)."""
    stop = min(size, start + SEARCH_LIMIT)
    for pos in range(start + 1, stop):
        if _valid_frame_at(view, pos, size, salt):
            return pos
    return None


def _markers(record: Any) -> int:
    """The furthest offset the SYNCED records in ``record`` (a batch or one) vouch for."""
    if not isinstance(record, list) or not record:
        return 0
    recs = record[1] if record[0] == BATCH and len(record) == 2 else [record]
    best = 0
    for rec in recs if isinstance(recs, list) else ():
        if isinstance(rec, list) and len(rec) > 1 and rec[0] == SYNCED and isinstance(rec[1], int):
            best = max(best, rec[1])
    return best


def _synced_past(view: memoryview, start: int, size: int, salt: int) -> int:
    """The furthest offset vouched for by SYNCED records in the whole frames from ``start``
    on (past a damaged one: with salted CRCs a whole frame there is one the log wrote)."""
    best = 0
    pos: int | None = start
    while pos is not None and pos < size:
        if not _valid_frame_at(view, pos, size, salt):
            pos = _whole_frame_after(view, pos, size, salt)
            continue
        length = HEADER.unpack_from(view, pos)[0]
        end = pos + HEADER.size + length
        try:
            record = msgpack.unpackb(view[pos + HEADER.size : end], raw=False, strict_map_key=False)
        except Exception:
            record = None
        best = max(best, _markers(record))
        pos = end
    return best


def _zero_tail(data: bytes, start: int) -> bool:
    """Whether every byte from ``start`` on is zero (a preallocated, unwritten tail)."""
    return data.count(0, start) == len(data) - start


def scan(data: bytes) -> Scan:
    """Decode every whole record of a segment's bytes (:data:`BATCH` frames unpacked).

    Zero bytes after the last frame are the unwritten rest of a preallocated segment. A damaged
    frame after which no whole frame follows is a *torn tail*: what a crash leaves of the last
    commit (cut short, or with a page never written, even in its middle). The scan ends before
    it. A damaged frame followed by a whole one is corruption. (In a format 2 segment no
    client bytes can pass for a whole frame: its CRCs are salted, see the module doc.)
    """
    records: list[list[Any]] = []
    view = memoryview(data)
    size = len(data)
    pos = 0
    salt = 0
    mode: str | None = None
    synced = 0

    def stop(at: int, damage: Damage | None) -> Scan:
        return Scan(records, at, damage, mode, synced)

    while pos < size:
        if data[pos] == 0 and _zero_tail(data, pos):
            return stop(pos, None)  # the rest of a preallocated segment
        if size - pos < HEADER.size:
            return stop(pos, Damage(pos, True, "header cut short"))
        length, pcrc, hcrc = HEADER.unpack_from(view, pos)
        reason = ""
        if _crc(view[pos : pos + 8], salt) != hcrc or length > MAX_RECORD:
            reason = "bad record header"
        else:
            start = pos + HEADER.size
            end = start + length
            if end > size:
                reason = "record cut short"
            elif _crc(view[start:end], salt) != pcrc:
                reason = "record checksum mismatch"
        if reason and pos == 0 and data.count(0, HEAD_MAX) != size - min(size, HEAD_MAX):
            # The first record is written and synced alone before any other: damage in it
            # with bytes written past it is not a crash's doing (and without its salt no
            # later frame can be read to tell).
            return stop(pos, Damage(pos, False, reason + "; bytes follow the segment's head"))
        if reason:
            after = _whole_frame_after(view, pos, size, salt)
            if after is not None:
                reason += f"; a whole record follows at byte {after}"
                if mode == "interval":  # what the log says was synced, past the damage too
                    synced = max(synced, _synced_past(view, after, size, salt))
            return stop(pos, Damage(pos, after is None, reason))
        try:
            record = msgpack.unpackb(view[start:end], raw=False, strict_map_key=False)
        except Exception as exc:  # the CRC matched: this is a bug or deliberate damage
            return stop(pos, Damage(pos, False, f"undecodable record: {exc}"))
        if not isinstance(record, list) or not record or not isinstance(record[0], int):
            return stop(pos, Damage(pos, False, "record is not a typed array"))
        if record[0] == BATCH:
            if len(record) != 2 or not isinstance(record[1], list):
                return stop(pos, Damage(pos, False, "malformed batch"))
            records.extend(record[1])
        else:
            records.append(record)
        synced = max(synced, _markers(record))
        if (
            pos == 0
            and record[0] == SEGMENT
            and len(record) > 6
            and isinstance(record[5], int)
            and isinstance(record[6], str)
        ):
            salt, mode = record[5], record[6]
            synced = end  # (written and synced before any other record)
        pos = end
    return stop(pos, None)
