"""Batched flushes on DynamoDB (ADR 0015): which deltas share a transaction, the token that
makes a re-sent one idempotent, and what a cancelled one says of each item. Pure.

Every delta is one or two conditional updates (the counter, and its day bucket when it has
one), each on ``s_<node> < seq``; a key's updates always travel in the same transaction, so
they land together. A cancelled transaction wrote nothing, and names a reason per item:

- ``ConditionalCheckFailed``: the item holds this sequence already (a node's sequences of one
  key only grow), so that update landed before: done, as a duplicate;
- ``None``: the item was fine; it goes again;
- ``TransactionConflict`` (another write on the item was in progress) and throttling: it goes
  again, after a backoff;
- ``ValidationError``, ``ItemCollectionSizeLimitExceeded``: the item cannot be written; its
  key is parked alone and the others go again;
- a code not named here: it goes again after a backoff (a key is never parked on a guess).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from storage.base import Key

#: Reason codes of a cancelled transaction's item that mean: send it again.
AGAIN = frozenset({"None", "TransactionConflict"})
#: ...after a backoff: the table was busy.
BUSY = frozenset(
    {
        "TransactionConflict",
        "ThrottlingError",
        "ProvisionedThroughputExceeded",
        "RequestLimitExceeded",
    }
)
#: The item already holds this update's sequence.
LANDED = "ConditionalCheckFailed"
#: The item cannot be written as asked.
BAD = frozenset({"ValidationError", "ItemCollectionSizeLimitExceeded"})


@dataclass(frozen=True, slots=True)
class Part:
    """One conditional update of a flush: ``key``'s counter (``day`` None) or its day bucket."""

    key: Key
    seq: int
    delta: int
    day: str | None
    #: The ``Update`` of a ``TransactWriteItems`` (or an ``UpdateItem``'s parameters).
    update: dict[str, Any]


def pack(keys: Iterable[Sequence[Part]], limit: int) -> list[list[Part]]:
    """The parts of each key (one or two), packed into transactions of at most ``limit``
    items in order, a key's parts never split apart."""
    out: list[list[Part]] = []
    cur: list[Part] = []
    for parts in keys:
        if cur and len(cur) + len(parts) > limit:
            out.append(cur)
            cur = []
        cur.extend(parts)
    if cur:
        out.append(cur)
    return out


def token(run: str, node: str, send: int, parts: Sequence[Part]) -> str:
    """The ``ClientRequestToken`` of one send of a transaction (``send``: this process's
    count of them): botocore's retries of it and ours after a lost answer carry it, and
    DynamoDB answers them without writing again. A later send of the same updates (the
    next flush round's, or another process's: ``run``) has another token, and the items'
    conditions answer it instead, as duplicates; a cancelled transaction's token is never
    sent again."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{run}|{node}|{send}".encode())
    for p in parts:
        k = p.key
        h.update(f"|{k[0]}\x00{k[1]}\x00{k[2]}\x00{p.day}\x00{p.seq}\x00{p.delta}".encode())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a cancelled transaction says of its parts."""

    #: Updates the item holds already (done, duplicates).
    landed: tuple[Part, ...]
    #: Updates to send again.
    again: tuple[Part, ...]
    #: Updates that cannot be written, with their reason code.
    bad: tuple[tuple[Part, str], ...]
    #: Whether some item met a busy table or a conflicting write (back off first).
    busy: bool
    #: Keys that met a conflicting write.
    conflicted: frozenset[Key]
    #: The reason codes, in item order (for the log).
    reasons: tuple[str, ...] = ()


def judge(parts: Sequence[Part], reasons: Sequence[str] | None) -> Verdict | None:
    """Each part's fate from a cancellation's reasons (one per item, in order); ``None`` when
    the reasons do not name every item (then the caller cannot tell: it sends each alone)."""
    if reasons is None or len(reasons) != len(parts):
        return None
    landed: list[Part] = []
    again: list[Part] = []
    bad: list[tuple[Part, str]] = []
    busy = False
    conflicted: set[Key] = set()
    for part, code in zip(parts, reasons, strict=True):
        if code == LANDED:
            landed.append(part)
        elif code in BAD:
            bad.append((part, code))
        else:
            again.append(part)
            busy = busy or code != "None"
            if code == "TransactionConflict":
                conflicted.add(part.key)
    if not landed and not bad and not busy:
        # Every item "None": nothing says why it was cancelled. Not sent again as is.
        return None
    return Verdict(
        tuple(landed), tuple(again), tuple(bad), busy, frozenset(conflicted), tuple(reasons)
    )


class HotKeys:
    """``auto``'s memory of keys that met a conflicting write (several nodes flushing them
    at once), each written alone until ``hold_s`` after its last conflict: a transaction
    holding such a key would be cancelled again, with every other key in it."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._until: dict[Key, float] = {}

    def __len__(self) -> int:
        return len(self._until)

    def conflicted(self, keys: Iterable[Key], now: float) -> None:
        """``keys`` met a conflicting write at ``now``."""
        for key in keys:
            self._until[key] = now + self.hold_s

    def hot(self, now: float) -> frozenset[Key]:
        """The keys still written alone at ``now`` (the others are forgotten)."""
        until = self._until
        for key, end in list(until.items()):
            if end <= now:
                del until[key]
        return frozenset(until)
