"""A tenant's credits ledger, as a pure model: no I/O, every decision (docs/ledger.md).

State: one *balance record* per tenant - the last entry's sequence, the running balance and
the open grants (what is left of each, its priority and its expiry) - plus an append-only list
of *entries*. Every change is one or more entries written together with the next balance
record (:mod:`meter.ledger.store` does the writing, by compare-and-swap on the record's
version). Kinds of entry:

* ``grant`` (and any caller-chosen credit kind): ``+amount``, opens a grant;
* ``debit`` (and any caller-chosen debit kind): ``-amount``, taken from the open grants in
  spending order (:func:`spending_order`: higher ``priority`` first, then the earliest
  ``expires_at``, a grant that never expires last, then the oldest);
* ``expire``: ``-remaining`` of one grant whose ``expires_at`` has passed, written lazily
  before anything else the first time the ledger is read or written after it; other grants
  are untouched;
* ``metered`` (:data:`POOLED`): a debit into the tenant's credit pool; what it takes from
  each grant is noted on the grant as ``pooled`` (the grant stays open while it has credits
  in the pool, with its priority and expiry);
* ``unpooled`` (:data:`UNPOOLED`): credits the pool gives back, onto the grants they came
  from in the reverse of spending order (the pool spends what it holds in spending order,
  so the unspent ones are the last); any the grants cannot take (their origin forgotten)
  open a grant of their own; restored credits of an expired grant expire in the same write.

Both carry what the pool holds unspent besides them (``Op.pool_unspent``): the grants'
``pooled`` past that, taken from the first in spending order, is spent, and let go, so a
grant whose credits are all spent closes.

Invariants (checked by :func:`check`): the balance is the sum of every entry's amount and the
sum of the open grants' remainders; it is never negative (a debit that does not fit raises
:class:`InsufficientBalance` and changes nothing); every open grant has something left.

Idempotency: every change carries a ``ref``. The first answer is stored under it, with a
fingerprint of the request (:func:`fingerprint`); the same ref and request answer that first
answer again, the same ref with another request is a :class:`~meter.errors.Conflict`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from meter.errors import Conflict, InsufficientBalance, InvalidArgument, MeterError

__all__ = ["InsufficientBalance"]

#: Largest amount of one entry, and largest balance (what MessagePack carries as an int).
MAX_AMOUNT = 2**63 - 1
#: Longest ref, in characters.
MAX_REF_CHARS = 128
#: Most grants open at once per tenant (the balance record must fit in one DynamoDB item).
MAX_OPEN_GRANTS = 1000
#: Most expiry entries written in one write; more are written by several writes first.
MAX_EXPIRE_PER_WRITE = 20
#: Priorities and expiries must fit a signed 64-bit int.
MAX_INT = 2**63 - 1
MIN_INT = -(2**63)

GRANT = "grant"
DEBIT = "debit"
EXPIRE = "expire"
#: A debit into the tenant's credit pool, and credits the pool gives back (docs/ledger.md).
POOLED = "metered"
UNPOOLED = "unpooled"
#: A caller-chosen kind: lower-case letters, digits and ``_``, starting with a letter.
KIND_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")


@dataclass(frozen=True, slots=True)
class Grant:
    """An open grant: the sequence of the entry that opened it (its id), what is left of it
    in the ledger, its priority and its expiry (epoch seconds, ``None``: never), and how many
    of its credits are in the credit pool (moved by a funding, not given back: spent there
    or not)."""

    seq: int
    remaining: int
    priority: int = 0
    expires_at: int | None = None
    pooled: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "remaining": self.remaining,
            "priority": self.priority,
            "expires_at": self.expires_at,
            "pooled": self.pooled,
        }

    def but(self, remaining: int, pooled: int) -> Grant:
        return Grant(self.seq, remaining, self.priority, self.expires_at, pooled)


@dataclass(frozen=True, slots=True)
class State:
    """The balance record: the last entry's sequence, the balance and the open grants."""

    seq: int = 0
    balance: int = 0
    grants: tuple[Grant, ...] = ()


EMPTY = State()


@dataclass(frozen=True, slots=True)
class Entry:
    """One ledger entry. ``amount`` is signed; ``alloc`` is, for a debit or an expiry, what
    it took from each grant (``(grant seq, amount)``), for credits the pool gave back what
    each grant took back, and empty for other credits (the entry's seq is the grant's)."""

    seq: int
    time: float
    kind: str
    amount: int
    balance_after: int
    ref: str | None = None
    alloc: tuple[tuple[int, int], ...] = ()
    priority: int | None = None
    expires_at: int | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seq": self.seq,
            "time": self.time,
            "kind": self.kind,
            "amount": self.amount,
            "ref": self.ref,
            "balance_after": self.balance_after,
        }
        if self.amount > 0:
            out["priority"] = self.priority
            out["expires_at"] = self.expires_at
        if self.amount < 0 or self.alloc:  # (credits given back: the grants they went to)
            out["grants"] = [list(a) for a in self.alloc]
        return out


@dataclass(frozen=True, slots=True)
class Op:
    """A change asked for: a credit (``credit=True``: opens a grant) or a debit, of ``amount``
    (> 0) under ``ref``, with a kind (``grant``/``debit`` or a caller's own)."""

    credit: bool
    amount: int
    ref: str
    kind: str
    priority: int = 0
    expires_at: int | None = None
    #: For a pool's ``metered`` debit or ``unpooled`` credit: how many of the pool's credits
    #: the node saw unspent besides this op's (before a funding, after a return); the grants'
    #: ``pooled`` beyond that is spent, and is let go (:func:`_retire`). Advisory, not part
    #: of the fingerprint: a lower figure only forgets where some credits came from.
    pool_unspent: int | None = None

    def fingerprint(self) -> str:
        return fingerprint(self)


@dataclass(frozen=True, slots=True)
class Write:
    """What one write stores: the next state, its new entries and, when the write carries
    the op, the op's ref record (``ref``, ``ref_body``) and its answer."""

    state: State
    entries: tuple[Entry, ...]
    ref: str | None = None
    ref_body: str | None = None
    answer: dict[str, Any] | None = None
    #: False when only expiries were planned and the op still has to be written after them.
    done: bool = True


# -- validation ------------------------------------------------------------------------------


def check_amount(amount: object, what: str = "amount") -> int:
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise InvalidArgument(f"{what} must be an integer, got {type(amount).__name__}")
    if not 1 <= amount <= MAX_AMOUNT:
        raise InvalidArgument(f"{what} must be in 1..{MAX_AMOUNT}, got {amount}")
    return amount


def check_ref(ref: object) -> str:
    if not isinstance(ref, str):
        raise InvalidArgument(f"ref must be a string, got {type(ref).__name__}")
    if not 1 <= len(ref) <= MAX_REF_CHARS:
        raise InvalidArgument(f"ref must be 1..{MAX_REF_CHARS} characters, got {len(ref)}")
    if not ref.isprintable():
        raise InvalidArgument("ref must not contain control characters")
    try:
        ref.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument("ref is not valid UTF-8") from None
    return ref


def check_int(value: object, what: str, *, least: int = MIN_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what} must be an integer, got {type(value).__name__}")
    if not least <= value <= MAX_INT:
        raise InvalidArgument(f"{what} must be in {least}..{MAX_INT}, got {value}")
    return value


#: Kinds only the ledger itself and credit pools write (:func:`pool_funding`,
#: :func:`pool_return`).
RESERVED_KINDS = (EXPIRE, POOLED, UNPOOLED)


def check_kind(kind: object) -> str:
    if not isinstance(kind, str) or not KIND_RE.fullmatch(kind) or kind in RESERVED_KINDS:
        raise InvalidArgument(
            f"kind must match {KIND_RE.pattern} and not be one of {', '.join(RESERVED_KINDS)},"
            f" got {kind!r}"
        )
    return kind


def pool_funding(amount: int, ref: str, unspent: int) -> Op:
    """A credit pool's funding: ``amount`` moved into the pool under ``ref``, the pool
    holding ``unspent`` credits before it."""
    return Op(False, check_amount(amount), check_ref(ref), POOLED, pool_unspent=unspent)


def pool_return(amount: int, ref: str, unspent: int) -> Op:
    """``amount`` credits an idle pool gives back under ``ref``, ``unspent`` left in it."""
    return Op(True, check_amount(amount), check_ref(ref), UNPOOLED, pool_unspent=unspent)


def credit(
    amount: object,
    ref: object,
    *,
    kind: object = GRANT,
    priority: object = 0,
    expires_at: object = None,
) -> Op:
    """A checked credit op (``InvalidArgument`` naming the bad field)."""
    return Op(
        True,
        check_amount(amount),
        check_ref(ref),
        check_kind(kind),
        check_int(priority, "priority"),
        None if expires_at is None else check_int(expires_at, "expires_at", least=0),
    )


def debit(amount: object, ref: object, *, kind: object = DEBIT) -> Op:
    """A checked debit op."""
    return Op(False, check_amount(amount), check_ref(ref), check_kind(kind))


def fingerprint(op: Op) -> str:
    """What must match for a repeated ref to be the same request."""
    return json.dumps(
        ["c" if op.credit else "d", op.kind, op.amount, op.priority, op.expires_at],
        separators=(",", ":"),
    )


# -- decisions -------------------------------------------------------------------------------


def spending_order(grants: Iterable[Grant]) -> list[Grant]:
    """The order a debit takes from grants: higher priority first, then the earliest expiry
    (a grant that never expires after every one that does), then the oldest (lowest seq)."""
    return sorted(
        grants,
        key=lambda g: (-g.priority, g.expires_at is None, g.expires_at or 0, g.seq),
    )


def expired(state: State, now: float) -> list[Grant]:
    """The open grants with credits left in the ledger past their expiry at ``now`` (``now
    >= expires_at``), oldest first."""
    return [
        g
        for g in state.grants
        if g.remaining > 0 and g.expires_at is not None and now >= g.expires_at
    ]


def expiry_write(state: State, now: float, limit: int = MAX_EXPIRE_PER_WRITE) -> Write | None:
    """Expiry entries for (up to ``limit`` of) the grants past their expiry; ``None`` if none
    is."""
    gone = expired(state, now)[:limit]
    if not gone:
        return None
    t = _ms(now)
    seq, balance = state.seq, state.balance
    entries = []
    for g in gone:
        seq += 1
        balance -= g.remaining
        entries.append(Entry(seq, t, EXPIRE, -g.remaining, balance, None, ((g.seq, g.remaining),)))
    return Write(State(seq, balance, _without(state.grants, gone)), tuple(entries), done=False)


def _without(grants: tuple[Grant, ...], gone: list[Grant]) -> tuple[Grant, ...]:
    """``grants`` with ``gone``'s remainders expired: closed, unless credits of theirs are
    in the pool (they expire when they come back)."""
    ids = {g.seq for g in gone}
    return tuple(
        g if g.seq not in ids else g.but(0, g.pooled)
        for g in grants
        if g.seq not in ids or g.pooled > 0
    )


def next_write(
    state: State,
    op: Op,
    now: float,
    most: int = MAX_EXPIRE_PER_WRITE,
    alone: int = MAX_EXPIRE_PER_WRITE,
) -> Write:
    """The write that applies ``op`` to ``state`` at ``now``.

    If grants have expired, the write holds first their expiry entries - with the op's own entry
    after them when they are at most ``most``, else ``alone`` of them alone (``done=False``:
    decide again on the state after it); a write holds at most ``2 * most + 1`` entries.
    Raises :class:`InsufficientBalance` when a debit does not fit in what is left after the
    expiries, and ``InvalidArgument`` when a credit would take the balance past
    :data:`MAX_AMOUNT` or open too many grants."""
    pre = expiry_write(state, now, most + 1)
    if pre is not None and len(pre.entries) > most:
        return expiry_write(state, now, alone) or pre  # (the first is never None here)
    base = state if pre is None else pre.state
    before = () if pre is None else pre.entries
    t = _ms(now)
    seq = base.seq + 1
    after_op: tuple[Entry, ...] = ()
    if op.credit:
        if base.balance + op.amount > MAX_AMOUNT:
            raise InvalidArgument(
                f"amount: the balance would exceed {MAX_AMOUNT} ({base.balance} + {op.amount})"
            )
        balance = base.balance + op.amount
        if op.kind == UNPOOLED:
            grants, back = _unpool(base.grants, op.amount, op.pool_unspent or 0, now)
            left = op.amount - sum(n for _, n in back)
            grants = _retire(grants, op.pool_unspent)
        else:
            grants, back, left = base.grants, [], op.amount
        if left:  # (a new grant; for credits given back, those no grant kept count of)
            if len(grants) >= MAX_OPEN_GRANTS:
                raise InvalidArgument(f"the tenant already has {MAX_OPEN_GRANTS} open grants")
            grants = (*grants, Grant(seq, left, op.priority, op.expires_at))
        entry = Entry(
            seq, t, op.kind, op.amount, balance, op.ref, tuple(back), op.priority, op.expires_at
        )
        if back:  # restored credits of a grant past its expiry expire at once
            due = expiry_write(State(seq, balance, grants), now, most)
            if due is not None:
                seq, balance, grants = due.state.seq, due.state.balance, due.state.grants
                after_op = due.entries
    else:
        if op.amount > base.balance:
            raise InsufficientBalance(
                f"debit of {op.amount} exceeds the available balance of {base.balance}"
            )
        left = op.amount
        taken: list[tuple[int, int]] = []
        after: dict[int, int] = {}
        to_pool = op.kind == POOLED
        held = _retire(base.grants, op.pool_unspent) if to_pool else base.grants
        for g in spending_order(held):
            if left == 0:
                break
            if g.remaining == 0:
                continue  # (only credits in the pool are left of it)
            take = min(left, g.remaining)
            taken.append((g.seq, take))
            after[g.seq] = take
            left -= take
        assert left == 0, "grants must cover the balance"
        balance = base.balance - op.amount
        entry = Entry(seq, t, op.kind, -op.amount, balance, op.ref, tuple(taken))
        grants = tuple(
            g
            if g.seq not in after
            else g.but(g.remaining - after[g.seq], g.pooled + (after[g.seq] if to_pool else 0))
            for g in held
            if g.seq not in after or g.remaining > after[g.seq] or (to_pool or g.pooled > 0)
        )
    answer = entry.to_wire()
    ref_body = json.dumps({"f": op.fingerprint(), "a": answer}, separators=(",", ":"))
    return Write(
        State(seq, balance, grants),
        (*before, entry, *after_op),
        op.ref,
        ref_body,
        answer,
        done=True,
    )


def _unpool(
    grants: tuple[Grant, ...], amount: int, unspent: int, now: float
) -> tuple[tuple[Grant, ...], list[tuple[int, int]]]:
    """``amount`` credits given back by the pool (``unspent`` left in it) onto the grants
    they came from: first the part in the pool of grants past their expiry (they expire in
    the same write: a pool keeps its grants' expiry), then the last in spending order first
    (the pool spent the first); what each took back."""
    held = in_pool(grants, amount + unspent)
    back: dict[int, int] = {}
    left = amount
    for g in spending_order(grants):
        if left and g.expires_at is not None and now >= g.expires_at and held.get(g.seq):
            back[g.seq] = min(left, held[g.seq])
            left -= back[g.seq]
    rest = (g.but(g.remaining, g.pooled - back.get(g.seq, 0)) for g in grants)
    for seq, n in in_pool(rest, left).items():  # (the same walk: the unspent come back)
        back[seq] = back.get(seq, 0) + n
    out = tuple(
        g if g.seq not in back else g.but(g.remaining + back[g.seq], g.pooled - back[g.seq])
        for g in grants
    )
    return out, [(g.seq, back[g.seq]) for g in grants if g.seq in back]


def _retire(grants: tuple[Grant, ...], unspent: int | None) -> tuple[Grant, ...]:
    """``grants`` with their ``pooled`` credits past the pool's ``unspent`` let go (spent):
    the last in spending order keep theirs (:func:`in_pool`); a grant left with nothing in
    the ledger or the pool closes. ``None``: nothing is known, all kept."""
    if unspent is None:
        return grants
    kept = in_pool(grants, unspent)
    return tuple(
        g if g.pooled == kept.get(g.seq, 0) else g.but(g.remaining, kept.get(g.seq, 0))
        for g in grants
        if g.remaining > 0 or kept.get(g.seq, 0) > 0
    )


def in_pool(grants: Iterable[Grant], unspent: int) -> dict[int, int]:
    """Of ``unspent`` credits in the pool, how many are each grant's (by grant seq): the pool
    spends in spending order, so the unspent are the last grants' (what none kept count of,
    moved in before grants did, is nobody's here)."""
    left = unspent
    out: dict[int, int] = {}
    for g in reversed(spending_order(g for g in grants if g.pooled > 0)):
        n = min(left, g.pooled)
        if n:
            out[g.seq] = n
            left -= n
    return out


def expired_in_pool(grants: Iterable[Grant], unspent: int, now: float) -> tuple[int, int | None]:
    """Of ``unspent`` credits in the pool, how many are of grants past their expiry at
    ``now`` (:func:`in_pool`), and the earliest expiry still to come of a grant with credits
    in the pool (``None``: none)."""
    held = list(grants)
    mine = in_pool(held, unspent)
    gone = sum(mine.get(g.seq, 0) for g in held if g.expires_at is not None and now >= g.expires_at)
    due = [
        g.expires_at
        for g in held
        if g.pooled > 0 and g.expires_at is not None and now < g.expires_at
    ]
    return gone, min(due, default=None)


def pooled_expiry(grants: Iterable[Grant]) -> int | None:
    """The earliest expiry of a grant with credits in the pool (``None``: none expires)."""
    return min(
        (g.expires_at for g in grants if g.pooled > 0 and g.expires_at is not None),
        default=None,
    )


def repeated(op: Op, ref_body: str) -> dict[str, Any]:
    """The first answer stored under ``op``'s ref, or :class:`Conflict` if that ref was used
    for another request."""
    try:
        record = json.loads(ref_body)
        first_print, answer = record["f"], record["a"]
    except (ValueError, KeyError, TypeError) as exc:
        raise MeterError(f"undecodable ref record for {op.ref!r}: {exc}") from None
    if first_print != op.fingerprint():
        raise Conflict(f"ref {op.ref!r} was already used for another request ({first_print})")
    return dict(answer)


def check(state: State, entries: Sequence[Entry]) -> None:
    """Assert the invariants over a state and every entry written so far."""
    assert state.balance >= 0, state
    assert state.balance == sum(e.amount for e in entries), (state, entries)
    assert state.balance == sum(g.remaining for g in state.grants), state
    assert all(g.remaining >= 0 and g.pooled >= 0 for g in state.grants), state
    assert all(g.remaining > 0 or g.pooled > 0 for g in state.grants), state
    assert state.seq == (entries[-1].seq if entries else 0)


# -- encoding (the opaque bodies storage keeps) ------------------------------------------------


def encode_state(state: State) -> str:
    grants = [
        [g.seq, g.remaining, g.priority, g.expires_at, *([g.pooled] if g.pooled else [])]
        for g in state.grants
    ]
    return json.dumps({"s": state.seq, "b": state.balance, "g": grants}, separators=(",", ":"))


def decode_state(body: str | None) -> State:
    if body is None:
        return EMPTY
    try:
        raw = json.loads(body)
        grants = tuple(
            Grant(int(g[0]), int(g[1]), int(g[2]), g[3], int(g[4]) if len(g) == 5 else 0)
            for g in raw["g"]
        )
        return State(int(raw["s"]), int(raw["b"]), grants)
    except (ValueError, KeyError, TypeError) as exc:
        raise MeterError(f"undecodable ledger balance record: {exc}") from None


def encode_entry(entry: Entry) -> str:
    raw: dict[str, Any] = {
        "s": entry.seq,
        "t": entry.time,
        "k": entry.kind,
        "a": entry.amount,
        "b": entry.balance_after,
    }
    if entry.ref is not None:
        raw["r"] = entry.ref
    if entry.alloc:
        raw["g"] = [list(a) for a in entry.alloc]
    if entry.priority is not None:
        raw["p"] = entry.priority
    if entry.expires_at is not None:
        raw["e"] = entry.expires_at
    return json.dumps(raw, separators=(",", ":"))


def decode_entry(body: str) -> Entry:
    try:
        raw = json.loads(body)
        return Entry(
            int(raw["s"]),
            float(raw["t"]),
            str(raw["k"]),
            int(raw["a"]),
            int(raw["b"]),
            raw.get("r"),
            tuple((int(s), int(a)) for s, a in raw.get("g", ())),
            raw.get("p"),
            raw.get("e"),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise MeterError(f"undecodable ledger entry: {exc}") from None


def _ms(now: float) -> float:
    return round(now, 3)
