"""Remembered request ids: a retried call with the same id counts once. Pure, no I/O.

An entry maps a request id to the fingerprint of the call that first used it, that call's
answer and when the entry expires. Entries are kept oldest first (every entry lives for the
same window, so insertion order is expiry order) and at most ``max_ids`` of them: past that the
oldest go early, and :attr:`RequestIds.dropped_early` counts those whose window had not ended.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import msgpack

from meter.core.keys import Key
from meter.errors import Conflict, InvalidArgument
from meter.wal.records import Spent, Won, spent_to_log

#: Longest request id, in UTF-8 bytes.
MAX_ID_BYTES = 128

Entry = tuple[int, Any, float]
"""``(fingerprint, answer, expires)``."""


class Effect:
    """What a call counted under a request id, for ``void`` (meter.core.voids): ``qty`` units
    on each of ``keys`` (the feature's counter first, then its other levels and dimension
    counters), whether a void took them back already, and the credits it spent at the prices
    that applied when it was counted (a void gives them back to the pools that paid). A call
    on a unique feature counted 1 on each of ``keys`` whose claim it won: ``unique`` is its
    value and the claimant that won each (storage marks the value voided)."""

    __slots__ = ("credits", "keys", "qty", "unique", "voided")

    def __init__(
        self,
        qty: int,
        keys: tuple[Key, ...],
        voided: bool = False,
        credits: Spent = (),
        unique: Won | None = None,
    ) -> None:
        self.qty = qty
        self.keys = keys
        self.voided = voided
        self.credits = credits
        self.unique = unique

    def to_log(self) -> list[Any]:
        """``[qty, [[t, f, p], ...], voided, credits]``: as a checkpoint restates it."""
        return [self.qty, [list(k) for k in self.keys], self.voided, spent_to_log(self.credits)]


def check_id(rid: object) -> str:
    """Return ``rid`` if it is a valid request id (1-128 UTF-8 bytes), else raise."""
    if isinstance(rid, bytes):
        try:
            rid = rid.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument("id is not valid UTF-8") from None
    if not isinstance(rid, str):
        raise InvalidArgument(f"id must be a string, got {type(rid).__name__}")
    try:
        n = len(rid.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument("id is not valid UTF-8") from None
    if not 1 <= n <= MAX_ID_BYTES:
        raise InvalidArgument(f"id must be 1-{MAX_ID_BYTES} bytes, got {n}")
    return rid


_pack = msgpack.Packer(use_bin_type=True).pack
_blake2b = hashlib.blake2b


def fingerprint(*parts: Any) -> int:
    """A stable 64-bit digest of a call's method and payload (the same in every process)."""
    packed: bytes = _pack(parts)
    return int.from_bytes(_blake2b(packed, digest_size=8).digest(), "little")


class RequestIds:
    """Request id -> the first call's fingerprint and answer, for ``window_s`` seconds."""

    def __init__(self, window_s: float = 86400.0, max_ids: int = 250_000) -> None:
        self.window_s = window_s
        self.max_ids = max_ids
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        # Request id -> what its call counted (only counting calls that may be voided);
        # dropped with the id's entry.
        self._effects: dict[str, Effect] = {}
        #: Calls a ``void`` took back since the start (meter.core.voids), and of those the
        #: ones taken back again because the void's log write failed.
        self.voided_total = 0
        self.voids_undone = 0
        #: Entries dropped (to stay within ``max_ids``) before their window ended.
        self.dropped_early = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, rid: str, fp: int, now: float) -> Entry | None:
        """The entry of ``rid`` if it is remembered; :class:`Conflict` if it was used by a
        call with another fingerprint."""
        entry = self._entries.get(rid)
        if entry is None:
            return None
        if entry[2] <= now:
            self.forget(rid)
            return None
        if entry[0] != fp:
            raise Conflict(f"request id {rid[:64]!r} was already used by a different call")
        return entry

    def remember(
        self, rid: str, fp: int, answer: Any, now: float, effect: Effect | None = None
    ) -> float:
        """Remember ``rid``'s first answer (and what its call counted, ``effect``); return
        when it expires."""
        expires = now + self.window_s
        self.put(rid, fp, answer, expires, now, effect)
        return expires

    def put(
        self,
        rid: str,
        fp: int,
        answer: Any,
        expires: float,
        now: float,
        effect: Effect | None = None,
    ) -> None:
        """Add an entry with a given expiry (recovery), evicting expired and excess ones."""
        entries = self._entries
        entries[rid] = (fp, answer, expires)
        entries.move_to_end(rid)
        effects = self._effects
        if effect is not None:
            effects[rid] = effect
        elif effects:
            effects.pop(rid, None)
        while entries:
            oldest = next(iter(entries.values()))
            if oldest[2] <= now:
                self._drop_oldest()
            elif len(entries) > self.max_ids:
                self._drop_oldest()
                self.dropped_early += 1
            else:
                break

    def _drop_oldest(self) -> None:
        rid, _ = self._entries.popitem(last=False)
        if self._effects:
            self._effects.pop(rid, None)

    def effect(self, rid: str) -> Effect | None:
        """What the call remembered under ``rid`` counted, if it was a counting call."""
        return self._effects.get(rid)

    def take_back(self, effect: Effect) -> None:
        """Mark ``effect`` voided: a ``void`` took its units back."""
        effect.voided = True
        self.voided_total += 1

    def count_again(self, effect: Effect) -> None:
        """Undo :meth:`take_back` (the void's log write failed)."""
        effect.voided = False
        self.voids_undone += 1

    def forget(self, rid: str) -> None:
        """Drop ``rid`` (its call was undone)."""
        self._entries.pop(rid, None)
        self._effects.pop(rid, None)

    def expire(self, now: float) -> int:
        """Drop every entry whose window has ended; return how many."""
        entries = self._entries
        n = 0
        while entries and next(iter(entries.values()))[2] <= now:
            self._drop_oldest()
            n += 1
        return n

    def ids(self) -> list[str]:
        """Every remembered id, oldest first (a snapshot)."""
        return list(self._entries)

    def get(self, rid: str) -> Entry | None:
        """The entry of ``rid``, expired or not."""
        return self._entries.get(rid)

    def items(self) -> Iterator[tuple[str, Entry]]:
        """Iterate entries, oldest first (do not mutate meanwhile)."""
        return iter(self._entries.items())
