"""The storage interface every backend implements, and the values that cross it.

A stored counter is identified by ``(tenant, feature, period)`` and holds a total plus, per node
that ever wrote to it, the last flush sequence of that node's that was applied. A delta travels
with ``(node, seq)``; a backend applies it only if ``seq`` is greater than the stored sequence
for that node, atomically with the add. A retry of a delta that already landed is therefore
refused ("duplicate") and answered with the item as it is: never counted twice.

That holds only while one process writes under a node id. Each id therefore has an *owner* in
storage: a token (one per data dir) with a lease. A node claims its id at start, renews the
lease while it runs and writes only while it holds it (``docs/adr/0004-one-owner-per-node-id.md``).

One Protocol per concern (:class:`Counters`, :class:`Owners`, :class:`LimitRecords`,
:class:`BudgetRecords`, :class:`AlertClaims`, :class:`LedgerRecords`, :class:`GaugeRecords`,
:class:`DayBuckets`, :class:`UniqueValues`, :class:`PeriodMarks`, :class:`ClusterSettings`), so
each part of the node
depends on the store it uses; :class:`Storage`, the base every backend derives from, is all of
them at once.
"""

from __future__ import annotations

import abc
import base64
import json
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from storage import periods

Key = tuple[str, ...]
"""``(tenant, feature, period)``; ``period`` is ``YYYY-MM`` or ``YYYY-MM-DD``."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A stored counter as read: its total and the last applied flush sequence per node."""

    total: int
    seqs: Mapping[str, int] = field(default_factory=dict)

    def seq_of(self, node: str) -> int:
        """The last applied sequence of ``node`` in this snapshot (0 if it never wrote)."""
        return self.seqs.get(node, 0)


EMPTY = Snapshot(0, {})
"""The snapshot of a counter that does not exist yet."""

GaugeReading = tuple[int, int, str]
"""A gauge's stored reading ``(value, at_ms, node)`` (docs/dimensions.md, "Gauges")."""

#: Ends a gauge's stored name: a gauge is an item of its own beside its feature's counter (a
#: node that does not know yet that a feature is a gauge counts its calls on the counter, never
#: into the gauge). No feature name holds it, and it sorts after a feature's dimension names.
GAUGE_MARK = "\x7f"


def gauge_key(key: Key) -> Key:
    """The stored key of the gauge ``key``."""
    return (key[0], key[1] + GAUGE_MARK, key[2])


def gauge_feature(stored: str) -> str | None:
    """The gauge a stored name is of (``None``: a counter's name)."""
    return stored[:-1] if stored.endswith(GAUGE_MARK) else None


def reading_wins(kind: str, a: GaugeReading, b: GaugeReading | None) -> bool:
    """Whether ``a`` replaces the stored ``b`` (``None``: none) for a gauge of ``kind``: for
    ``max`` a larger value (then a later ``(at_ms, node)``), for ``latest`` a later
    ``(at_ms, node)`` (then a larger value)."""
    if b is None:
        return True
    if kind == "max":
        return a > b
    return (a[1], a[2], a[0]) > (b[1], b[2], b[0])


@dataclass(frozen=True, slots=True)
class Delta:
    """One node's flush of one key: add ``delta`` unless ``(node, key, seq)`` already applied.

    ``day`` (``YYYY-MM-DD``, inside a month key's period): also add ``delta`` to that day's
    bucket of the counter (docs/history.md), under the same ``(node, seq)`` with its own
    exactly-once condition on the bucket. The key's outcome is an :class:`Applied` only once
    both landed (each may be a duplicate); a retry of the same ``(key, seq, delta, day)``
    applies whichever did not.
    """

    key: Key
    seq: int
    delta: int
    day: str | None = None
    #: The stored state the caller's view of the key rests on, holding every earlier delta
    #: of this node (its sequence ``seq - 1``), if the caller may be answered with it plus
    #: this delta instead of a read of the item (ADR 0015): a backend that writes without
    #: reading back may answer so; any backend may ignore it.
    known: Snapshot | None = None


@dataclass(frozen=True, slots=True)
class Applied:
    """The outcome of one :class:`Delta`.

    ``duplicate`` is true when the backend refused the delta because its sequence had already
    been applied; ``snapshot`` is then the item as it is now, which contains the delta. For a
    delta given ``known``, ``snapshot`` may be ``known`` plus the delta: no state the item was
    in if other nodes wrote meanwhile, but one it covers node by node (every node's deltas up
    to its sequence in it, and nothing else), as the item's state after the write does.
    """

    snapshot: Snapshot
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class WriteStats:
    """What a store's flush writes cost so far (``status``, the metrics, the bench)."""

    #: How it writes deltas: ``auto``, ``batched`` or ``single`` (DynamoDB), else its kind.
    mode: str
    #: Write requests sent (one ``UpdateItem`` or one transaction each; 0 where not counted).
    writes: int = 0
    #: Counter and day-bucket items written.
    items: int = 0
    #: Write units as DynamoDB bills them for items up to 1 KB (0 elsewhere).
    write_units: int = 0
    #: Transactions sent, and of those cancelled.
    transactions: int = 0
    cancelled: int = 0
    #: Keys written alone for now, after they met a conflicting write (``auto``).
    hot_keys: int = 0
    #: Keys answered with what the flusher knew plus their delta, not read back (ADR 0015).
    derived: int = 0


@dataclass(frozen=True, slots=True)
class Owner:
    """Who owns a node id: the holder's token and the end of its lease (epoch seconds, kept to
    the millisecond), and the note its last renewal left (opaque here: what the node says of
    its state for others to read; "" if none)."""

    token: str
    expires: float
    note: str = ""


#: Longest note a renewal leaves on a node id's owner record, in UTF-8 bytes.
MAX_OWNER_NOTE_BYTES = 4096


def check_owner_note(note: str | None) -> None:
    """:class:`StoragePermanentError` unless ``note`` is None or at most
    :data:`MAX_OWNER_NOTE_BYTES` of UTF-8."""
    if note is not None and len(note.encode("utf-8")) > MAX_OWNER_NOTE_BYTES:
        raise StoragePermanentError(f"owner note over {MAX_OWNER_NOTE_BYTES} bytes")


def lease_end_ms(now: float, lease_s: float) -> int:
    """``now + lease_s`` in whole milliseconds, as backends store a lease's end."""
    return round((now + lease_s) * 1000)


@dataclass(frozen=True, slots=True)
class BudgetItem:
    """A strict budget record as stored (ADR 0009, 0014).

    ``version`` moves on with every write; ``body`` is the record as last written whole
    (None: there is none); ``admitted`` holds the units nodes admitted straight onto that body
    since (:meth:`BudgetRecords.budget_admit`), as ``(name, units, op of its last such
    write)``. ``admits``: whether the record takes such writes (False: one written before they
    existed, until it is written whole again)."""

    version: int
    body: str | None
    admitted: tuple[tuple[str, int, str], ...] = ()
    admits: bool = True

    @property
    def admitted_total(self) -> int:
        return sum(units for _, units, _ in self.admitted)


class StorageError(Exception):
    """Base of the storage errors. ``retryable`` says whether trying again can succeed."""

    retryable = True


class StorageUnavailable(StorageError):
    """The backend could not be reached or refused for now (network, throttling, 5xx)."""


class StoragePermanentError(StorageError):
    """The request can never succeed as it is (validation error, bad key); do not retry it."""

    retryable = False


class BadItems(StoragePermanentError):
    """:meth:`Storage.load` read some items it cannot decode (damaged or foreign data).

    ``good`` holds the snapshots of the other keys, ``bad`` each undecodable key and why: one
    bad item must not keep every other key of the batch from being seeded.
    """

    def __init__(self, good: dict[Key, Snapshot], bad: dict[Key, str]) -> None:
        first = next(iter(bad.items()))
        super().__init__(f"{len(bad)} undecodable stored items, e.g. {first[0]}: {first[1]}")
        self.good = good
        self.bad = bad


@dataclass(frozen=True, slots=True)
class ExportRow:
    """One stored counter as an export reads it: whose, what, when, and its stored total.

    As storage reads it, ``feature`` is the counter's name (a dimension counter's too); the
    node's ``export`` answers a dimension counter as its feature and ``dims``, its dimension
    values (docs/dimensions.md)."""

    tenant: str
    feature: str
    period: str
    total: int
    dims: Mapping[str, str] = field(default_factory=dict)
    #: A gauge's row (its value); storage reads it under the gauge's stored name instead.
    gauge: bool = False


@dataclass(frozen=True, slots=True)
class ExportPage:
    """One page of a period's export.

    ``cursor`` is the opaque string to ask for the next page with, ``None`` after the last
    one. A page may hold fewer rows than asked for, even none, and still have a next cursor
    (a DynamoDB scan reads items of every period and keeps those of this one). ``parts`` and
    ``parts_done`` say how far the export is: scan segments on DynamoDB, 1 elsewhere.
    """

    rows: list[ExportRow]
    cursor: str | None
    parts: int = 1
    parts_done: int = 0


class VersionMoved(StorageError):
    """A limits write made on a version that another write has moved on since."""


class BadCursor(StoragePermanentError):
    """An export cursor that is not one this backend handed out for this period."""


def encode_cursor(state: object) -> str:
    """An opaque, URL-safe cursor for ``state`` (JSON-able)."""
    raw = json.dumps(state, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(cursor: object, max_len: int = 65_536) -> Any:
    """The state :func:`encode_cursor` wrapped; :class:`BadCursor` for anything else."""
    if not isinstance(cursor, str) or not cursor or len(cursor) > max_len:
        raise BadCursor("cursor must be a non-empty string handed out by a previous page")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        return json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):  # (deep nesting: RecursionError)
        raise BadCursor(f"cursor {cursor[:32]!r} is not one a previous page handed out") from None


def check_period(period: object) -> str:
    """``period`` if it names a period counters are stored under (:mod:`storage.periods`: a
    UTC month ``YYYY-MM`` or day ``YYYY-MM-DD``, a billing cycle's month ``YYYY-MM@D:Zone``
    or ``YYYY-MM@DTHH:MM:Zone``, or a zone's day ``YYYY-MM-DD@Zone``), else
    :class:`StoragePermanentError`."""
    try:
        periods.parse(period)
    except (ValueError, TypeError) as exc:
        raise StoragePermanentError(str(exc)) from None
    assert isinstance(period, str)
    return period


def check_export_limit(limit: object) -> int:
    """``limit`` if it is an int in ``1..MAX_EXPORT_PAGE``, else :class:`StoragePermanentError`."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_EXPORT_PAGE:
        raise StoragePermanentError(
            f"export limit must be an integer in 1..{MAX_EXPORT_PAGE}, got {limit!r}"
        )
    return limit


#: Ends a read of day buckets ``first``..``last``: a billing cycle's bucket of ``last``
#: (``last@D:Zone``, ``last@<period>``) sorts after ``last`` and before this.
DAYS_END = "\x7f"


#: Most children one :meth:`Storage.children_page` answers.
MAX_CHILDREN_PAGE = 1_000


def check_children(
    parent: object, feature: object, period: object, after: object, limit: object
) -> None:
    """Refuse (:class:`StoragePermanentError`) arguments of :meth:`Storage.children_page` no
    backend takes: an empty parent or feature, a bad period, an ``after`` that is not a
    direct child of ``parent``, a limit outside 1..:data:`MAX_CHILDREN_PAGE`."""
    if not isinstance(parent, str) or not parent or not isinstance(feature, str) or not feature:
        raise StoragePermanentError("children: parent and feature must be non-empty strings")
    check_period(period)
    if after is not None and not (
        isinstance(after, str)
        and after.startswith(parent + "/")
        and len(after) > len(parent) + 1
        and "/" not in after[len(parent) + 1 :]
    ):
        raise StoragePermanentError(
            f"children: the cursor (after) must be a direct child of {parent[:80]!r} from a "
            f"page, got {str(after)[:80]!r}"
        )
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_CHILDREN_PAGE:
        raise StoragePermanentError(
            f"children: limit must be an integer in 1..{MAX_CHILDREN_PAGE}, got {limit!r}"
        )


def parent_of(tenant: str) -> str | None:
    """The tenant one level up (``acme`` of ``acme/alice``), ``None`` at the top."""
    cut = tenant.rfind("/")
    return tenant[:cut] if cut > 0 else None


def check_range(first: object, last: object) -> tuple[str, str]:
    """``(first, last)`` if both are periods of the same shape with ``first <= last``, else
    :class:`StoragePermanentError`."""
    a, b = check_period(first), check_period(last)
    if len(a) != len(b) or a > b:
        raise StoragePermanentError(f"bad period range {a!r}..{b!r}")
    return a, b


def check_day_of(day: str, period: str) -> None:
    """:class:`StoragePermanentError` unless ``day`` is a day bucket of the month ``period``
    (a delta's): a ``YYYY-MM-DD`` inside it, named ``YYYY-MM-DD@D:Zone`` for a billing
    cycle's month (``YYYY-MM-DD@<period>`` for one anchored at a time of day,
    ``storage.periods.day_of``)."""
    if len(period) == 7 and len(day) == 10 and day.startswith(period + "-"):
        check_period(day)
        return
    try:
        # (a billing cycle's month: its own buckets, named by its calendar)
        inside = len(check_period(day[:10])) == 10 and periods.bucket_of(day, period)
    except (ValueError, TypeError, AttributeError, StoragePermanentError):
        inside = False
    if not inside:
        raise StoragePermanentError(f"day {str(day)[:32]!r} is not a day of period {period!r}")


#: Most rows one export page may be asked for (what one page holds in memory).
MAX_EXPORT_PAGE = 10_000

#: A unique feature's value, its claimant and a page of values (docs/storage.md, "Unique
#: values"): the longest value and claimant kept, in UTF-8 bytes, and the most values a page
#: may be asked for. 256 bytes keep a value item's DynamoDB sort key far inside 1,024 bytes.
MAX_VALUE_BYTES = 256
MAX_CLAIMANT_BYTES = 256
MAX_VALUES_PAGE = 1000

#: Ends the feature in a value item's stored key, the value following it: a key's values are
#: then one range in value order. No feature name holds it (a dimension counter's name does:
#: refused, as its values would fall inside its feature's range).
VALUE_MARK = "\x1f"


def check_values_key(key: object) -> Key:
    """``key`` if unique values may be kept under it: ``(tenant, feature, period)`` strings, a
    period (:func:`check_period`), a non-empty tenant and feature, the feature without
    :data:`VALUE_MARK`; else :class:`StoragePermanentError`."""
    if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(p, str) for p in key)):
        raise StoragePermanentError(f"key must be (tenant, feature, period) strings, got {key!r}")
    tenant, feature, period = key
    check_period(period)
    if not tenant or not feature or VALUE_MARK in feature:
        raise StoragePermanentError(
            f"no unique values are kept for ({tenant[:80]!r}, {feature[:80]!r})"
        )
    return key


def _check_text(what: str, text: object, most: int) -> None:
    """:class:`StoragePermanentError` unless ``text`` is a string of 1..``most`` UTF-8 bytes."""
    try:
        size = len(text.encode("utf-8")) if isinstance(text, str) else 0
    except UnicodeEncodeError:  # (a lone surrogate: no UTF-8 for it)
        size = 0
    if not 1 <= size <= most:
        shown = text[:32] if isinstance(text, str) else type(text).__name__
        raise StoragePermanentError(f"{what} {shown!r} is not 1..{most} UTF-8 bytes")


def check_value_of(key: object, value: object) -> None:
    """:class:`StoragePermanentError` unless ``value`` of ``key`` may be kept:
    :func:`check_values_key`, and a value of 1..:data:`MAX_VALUE_BYTES` UTF-8 bytes."""
    check_values_key(key)
    _check_text("value", value, MAX_VALUE_BYTES)


def check_unique(key: object, value: object, claimant: object) -> None:
    """:class:`StoragePermanentError` unless ``value`` of ``key`` may be stored under
    ``claimant``: :func:`check_value_of`, and a claimant of 1..256 UTF-8 bytes."""
    check_value_of(key, value)
    _check_text("claimant", claimant, MAX_CLAIMANT_BYTES)


def check_values_limit(limit: object) -> int:
    """``limit`` if it is an int in ``1..MAX_VALUES_PAGE``, else :class:`StoragePermanentError`."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_VALUES_PAGE:
        raise StoragePermanentError(
            f"values limit must be an integer in 1..{MAX_VALUES_PAGE}, got {limit!r}"
        )
    return limit


def values_cursor(cursor: object) -> str:
    """The value a :meth:`Storage.values_page` cursor continues after (``""``: ``None``, from
    the start; values are never empty); :class:`BadCursor` for a string no page handed out."""
    if cursor is None:
        return ""
    state = decode_cursor(cursor)
    if not (isinstance(state, list) and len(state) == 2 and state[0] == "u"):
        raise BadCursor("cursor is not one a page of values handed out")
    after = state[1]
    try:
        ok = isinstance(after, str) and 1 <= len(after.encode("utf-8")) <= MAX_VALUE_BYTES
    except UnicodeEncodeError:
        ok = False
    if not ok:
        raise BadCursor("cursor is not one a page of values handed out")
    assert isinstance(after, str)
    return after


def next_values_cursor(values: list[str], more: bool) -> str | None:
    """The cursor after a page holding ``values`` (``None``: no more, ``more`` false)."""
    return encode_cursor(["u", values[-1]]) if more and values else None


#: Node ids as storage keeps them (an attribute name on DynamoDB, ``s_<node>``): a plain,
#: printable charset without ``#``, so a period mark's sort key (the node id) never looks like
#: a counter's ``<period>#<feature>``.
NODE_RE = re.compile(r"[A-Za-z0-9_\-.:@/]{1,128}")

#: The states of a :class:`PeriodMark`.
MARK_OPEN = "open"
MARK_CLOSED = "closed"
#: A node that drained cleanly (stored everything) and had the period open: counts as closed
#: for an export, but the node may open the period again (a restart while it may still count).
MARK_DRAINED = "drained"
#: Every state a stored mark may hold.
MARK_STATES = (MARK_OPEN, MARK_CLOSED, MARK_DRAINED)
#: Longest ``by`` of a mark (UTF-8 bytes) and the latest ``at`` (epoch seconds; kept to the
#: microsecond, a number every backend stores exactly).
MAX_MARK_BY_BYTES = 128
MAX_MARK_AT = float(2**53)


@dataclass(frozen=True, slots=True)
class PeriodMark:
    """A node's mark of a counting period (docs/storage.md, "Period marks"): ``open`` while
    it holds units of the period it has not stored, ``closed`` once it has closed it,
    ``drained`` once it drained cleanly with the period open (closed for an export, but the
    node may open it again)."""

    node: str
    state: str
    #: Epoch seconds the mark was written (the open's while open, the close's once closed,
    #: the drain's once drained), kept to the microsecond.
    at: float
    #: Who wrote it: the node id itself, or ``operator`` for a close by hand.
    by: str
    #: A node's close or drain: the units it counted in the period, by feature (``None``:
    #: not said: an open mark, a close by hand, a node without a log or of an older build).
    units: dict[str, int] | None = None


def check_node(node: object) -> str:
    """``node`` if it is a node id storage keeps (:data:`NODE_RE`), else
    :class:`StoragePermanentError`."""
    if not isinstance(node, str) or NODE_RE.fullmatch(node) is None:
        shown = node[:32] if isinstance(node, str) else type(node).__name__
        raise StoragePermanentError(f"node id {shown!r} is not 1..128 of [A-Za-z0-9_-.:@/]")
    return node


def check_period_mark(
    period: object, node: object, at: object, by: object, state: str, units: object = None
) -> PeriodMark:
    """The mark of ``node`` in ``period`` to write (``at`` a float to the microsecond), if
    every input may be kept: a period (:func:`check_period`), a node id (:func:`check_node`),
    ``at`` a number in ``0..2**53``, ``by`` 1..128 printable UTF-8 bytes, ``units`` ``None``
    or at most :data:`MAX_MARK_UNITS` features (names of 1..256 UTF-8 bytes) to int64s;
    else :class:`StoragePermanentError`."""
    check_period(period)
    check_node(node)
    assert isinstance(node, str)
    try:
        when = float(at) if isinstance(at, int | float) and not isinstance(at, bool) else -1.0
    except OverflowError:  # (an int past any float)
        when = -1.0
    if not 0 <= when <= MAX_MARK_AT:
        shown = repr(at)[:40]
        raise StoragePermanentError(f"mark time must be epoch seconds in 0..2**53, got {shown}")
    _check_text("mark's writer", by, MAX_MARK_BY_BYTES)
    assert isinstance(by, str)
    if not by.isprintable():
        raise StoragePermanentError(f"mark's writer {by[:32]!r} is not printable")
    if state not in MARK_STATES:
        raise StoragePermanentError(f"mark state must be open, closed or drained, got {state!r}")
    return PeriodMark(node, state, round(when, 6), by, _mark_units(units))


#: Most features a mark's units may name, and the longest name (a feature's: 256 bytes).
MAX_MARK_UNITS = 1000
MAX_MARK_FEATURE_BYTES = 256


def _mark_units(units: object) -> dict[str, int] | None:
    if units is None:
        return None
    if not isinstance(units, dict) or len(units) > MAX_MARK_UNITS:
        raise StoragePermanentError(f"mark units must be a map of at most {MAX_MARK_UNITS}")
    for feature, n in units.items():
        _check_text("mark units' feature", feature, MAX_MARK_FEATURE_BYTES)
        if type(n) is not int or not -(2**63) <= n < 2**63:
            raise StoragePermanentError(f"mark units of {str(feature)[:32]!r}: not an int64")
    return dict(units)


def mark_units_to_text(units: dict[str, int] | None) -> str | None:
    """A mark's units as backends store them: a JSON object (``None``: not said)."""
    return None if units is None else json.dumps(units, sort_keys=True, separators=(",", ":"))


def mark_units_from_text(text: object) -> dict[str, int] | None:
    """The inverse of :func:`mark_units_to_text`; :class:`StoragePermanentError` for
    anything else."""
    if text is None:
        return None
    try:
        units = json.loads(text) if isinstance(text, str) else None
        return _mark_units(units)
    except (ValueError, StoragePermanentError):
        raise StoragePermanentError("a stored mark's units are not readable") from None


# -- the concerns, one Protocol each (a backend implements them all: Storage) -----------------


class Counters(Protocol):
    """Counters: flushed to, seeded from, listed and exported."""

    @property
    def kind(self) -> str: ...
    @property
    def load_chunk(self) -> int: ...
    @property
    def load_concurrency(self) -> int: ...

    async def apply(
        self, node: str, deltas: Sequence[Delta]
    ) -> dict[Key, Applied | StorageError]: ...
    async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]: ...
    async def list_period(self, tenant: str, period: str) -> dict[str, Snapshot]: ...
    async def list_between(
        self, tenant: str, period: str, first: str, last: str
    ) -> dict[str, Snapshot]: ...
    async def export_page(self, period: str, cursor: str | None, limit: int) -> ExportPage: ...
    def export(self, period: str, page_size: int = ...) -> AsyncIterator[ExportPage]: ...
    async def children_page(
        self, parent: str, feature: str, period: str, after: str | None, limit: int
    ) -> tuple[list[tuple[str, int]], bool]: ...
    async def purge_expired(self, now: float | None = None) -> int: ...
    def write_stats(self) -> WriteStats: ...


LedgerRow = tuple[int, str, int]
"""A ledger entry as written: ``(seq, body, at_ms)``."""

_POSITION_RE = re.compile(r"[0-9]{15}#[^#]{1,512}#[0-9]{20}")


def timeline_position(at_ms: int, tenant: str, seq: int) -> str:
    """Where an entry sits in the timeline of every tenant's ledger: ordered as strings,
    positions order entries by time, then tenant, then sequence (tenants hold no ``#``)."""
    return f"{at_ms:015d}#{tenant}#{seq:020d}"


def check_timeline_position(after: object) -> str | None:
    """``after`` if it is a timeline position (or None), else :class:`BadCursor`."""
    if after is None:
        return None
    if isinstance(after, str) and _POSITION_RE.fullmatch(after):
        return after
    raise BadCursor("not a ledger timeline cursor")


def timeline_range(start_ms: int, end_ms: int, after: object) -> tuple[str, str]:
    """Where a page of the timeline reads: from the least position at ``start_ms`` or past
    the cursor ``after`` (checked: :class:`BadCursor`), whichever is later, up to the first
    position at ``end_ms`` (not included: every position at ``end_ms`` sorts after it)."""
    lo = timeline_position(start_ms, "", 0)
    cursor = check_timeline_position(after)
    if cursor is not None:  # (its sequence plus one: nothing lies between)
        lo = max(lo, f"{cursor[:-20]}{int(cursor[-20:]) + 1:020d}")
    return lo, f"{end_ms:015d}"


class Owners(Protocol):
    """Who owns each node id (ADR 0004)."""

    async def claim_owner(
        self, node: str, token: str, *, lease_s: float, now: float, accept: Sequence[str] = ()
    ) -> Owner: ...
    async def renew_owner(
        self, node: str, token: str, *, lease_s: float, now: float, note: str | None = None
    ) -> Owner | None: ...
    async def owner(self, node: str) -> Owner | None: ...


class LimitRecords(Protocol):
    """Plans, assignments and overrides, with one version (docs/quotas.md)."""

    async def limits_version(self) -> int: ...
    async def read_limits(self) -> tuple[int, list[tuple[str, str, str, str]]]: ...
    async def write_limit(
        self, scope: str, name: str, feature: str, body: str | None, expect: int | None = None
    ) -> int: ...


class BudgetRecords(Protocol):
    """Strict budgets, one record per counter (ADR 0009)."""

    async def budget_read(self, key: Key) -> BudgetItem: ...
    async def budget_swap(self, key: Key, version: int, body: str) -> bool: ...
    async def budget_admit(
        self, key: Key, body: str, name: str, units: int, most: int, op: str
    ) -> BudgetItem | None: ...


class AlertClaims(Protocol):
    """Threshold alerts, claimed once each (docs/quotas.md)."""

    async def claim_alert(self, alert_id: str, body: str) -> bool: ...


class ClusterSettings(Protocol):
    """Settings fixed when a cluster is created (ADR 0024)."""

    async def cluster_setting(self, name: str, value: str) -> str: ...


class LedgerRecords(Protocol):
    """Credits ledgers (docs/ledger.md)."""

    @property
    def ledger_max_entries(self) -> int: ...
    async def ledger_read(self, tenant: str) -> tuple[int, str | None]: ...
    async def ledger_write(
        self,
        tenant: str,
        version: int,
        body: str,
        entries: Sequence[LedgerRow],
        refs: Sequence[tuple[str, str]] = (),
    ) -> bool: ...
    async def ledger_ref(self, tenant: str, ref: str) -> str | None: ...
    async def ledger_entries(
        self, tenant: str, after: int, limit: int
    ) -> list[tuple[int, str]]: ...
    async def ledger_timeline(
        self, start_ms: int, end_ms: int, after: str | None, limit: int
    ) -> tuple[list[tuple[str, int, str]], str | None]: ...


class GaugeRecords(Protocol):
    """Gauges (``max`` and ``latest`` features): readings kept only if they win."""

    async def put_gauges(
        self, items: Sequence[tuple[Key, str, GaugeReading]]
    ) -> dict[Key, GaugeReading | StorageError]: ...
    async def load_gauges(self, keys: Sequence[Key]) -> dict[Key, GaugeReading | None]: ...


class DayBuckets(Protocol):
    """Day buckets of month counters, and range reads of counters (docs/history.md)."""

    async def apply_days(self, node: str, deltas: Sequence[Delta]) -> list[StorageError | None]: ...
    async def day_buckets(
        self, tenant: str, feature: str, first: str, last: str
    ) -> dict[str, int]: ...
    async def counters_between(
        self, tenant: str, feature: str, first: str, last: str
    ) -> dict[str, int]: ...


class UniqueValues(Protocol):
    """Values of unique features, each claimed once per key (docs/storage.md)."""

    async def claim_value(self, key: Key, value: str, claimant: str) -> str: ...
    async def claimant_of(self, key: Key, value: str) -> str | None: ...
    async def void_value(self, key: Key, value: str, claimant: str) -> str | None: ...
    async def values_page(
        self, key: Key, cursor: str | None, limit: int
    ) -> tuple[list[str], str | None]: ...


class PeriodMarks(Protocol):
    """Each node's open, closed or drained mark of a counting period (docs/storage.md)."""

    async def mark_period_open(
        self, period: str, node: str, at: float, by: str | None = None
    ) -> PeriodMark: ...
    async def mark_period_closed(
        self, period: str, node: str, at: float, by: str, units: dict[str, int] | None = None
    ) -> PeriodMark: ...
    async def mark_period_drained(
        self, period: str, node: str, at: float, units: dict[str, int] | None = None
    ) -> PeriodMark | None: ...
    async def period_marks(self, period: str) -> list[PeriodMark]: ...


class Storage(abc.ABC):
    """A place counters are flushed to and seeded from. Implementations are async-safe.

    Every backend derives from this: it is each of the concern Protocols above at once."""

    #: Short name shown in ``status`` (``sqlite``, ``memory``, ``dynamodb``).
    kind: str = "abstract"
    #: Keys per :meth:`load` call when seeding cold keys (one request or query each).
    load_chunk: int = 100
    #: Most entries one :meth:`ledger_write` may hold (DynamoDB: what a transaction takes).
    ledger_max_entries: int = 1_000
    #: Seeding reads kept in flight at once.
    load_concurrency: int = 4

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Open connections; called once before any other method."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; called once at shutdown."""

    async def init_schema(self) -> str:
        """Create tables/indexes if missing (idempotent); return a one-line report."""
        return f"{self.kind}: nothing to create"

    def write_stats(self) -> WriteStats:
        """What this store's flush writes cost so far."""
        return WriteStats(self.kind)

    @abc.abstractmethod
    async def apply(self, node: str, deltas: Sequence[Delta]) -> dict[Key, Applied | StorageError]:
        """Apply a batch of one node's deltas; return each key's outcome.

        A key appears at most once per batch. Per key the result is an :class:`Applied` (the
        new or, for a duplicate, current snapshot) or the :class:`StorageError` that key hit.
        An exception raised instead means the whole batch's fate is unknown: each delta may or
        may not have been applied, and the caller retries the same ``(key, seq, delta)``.
        """

    @abc.abstractmethod
    async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]:
        """Read the current snapshot of each key (``EMPTY`` for keys never written).

        Raises :class:`BadItems` (with the good snapshots) if some stored items cannot be
        decoded, and only :class:`StorageError` subclasses otherwise."""

    async def purge_expired(self, now: float | None = None) -> int:
        """Delete counters past their expiry (period end, or last write if later, plus the
        retention), and their day buckets and unique values with them; return how many. A
        no-op where the store expires items itself."""
        return 0

    @abc.abstractmethod
    async def list_period(self, tenant: str, period: str) -> dict[str, Snapshot]:
        """Every stored counter of ``tenant`` in ``period``, by feature."""

    async def list_between(
        self, tenant: str, period: str, first: str, last: str
    ) -> dict[str, Snapshot]:
        """Every stored counter of ``tenant`` in ``period`` whose feature lies in ``first`` ..
        ``last`` (inclusive, by code point), by feature: one range read where the backend has
        one (a feature and its dimension counters, docs/dimensions.md)."""
        listed = await self.list_period(tenant, period)
        return {f: snap for f, snap in listed.items() if first <= f <= last}

    @abc.abstractmethod
    async def export_page(self, period: str, cursor: str | None, limit: int) -> ExportPage:
        """Up to ``limit`` (1..:data:`MAX_EXPORT_PAGE`) stored counters of ``period`` (every
        tenant), from where ``cursor`` (``None``: the start) left off.

        Memory is bounded by ``limit``: pages are read as asked for, never the whole period.
        Each counter comes in exactly one page of an export (one taken to its end while
        nothing is written to the period). Raises :class:`BadCursor` for a cursor this backend
        did not hand out for ``period``, :class:`StoragePermanentError` for a bad period or
        limit, and only :class:`StorageError` subclasses otherwise."""

    @abc.abstractmethod
    async def children_page(
        self, parent: str, feature: str, period: str, after: str | None, limit: int
    ) -> tuple[list[tuple[str, int]], bool]:
        """Up to ``limit`` (1..:data:`MAX_CHILDREN_PAGE`) stored counters of ``feature`` in
        ``period`` whose tenant is a direct child of ``parent`` (``parent/x``, no further
        ``/``), as ``(tenant, total)`` in tenant order after ``after`` (``None``: from the
        first); and whether more may follow. One range read (DynamoDB: one ``Query`` of the
        ``children`` index, eventually consistent). Bad arguments raise
        :class:`StoragePermanentError` (:func:`check_children`)."""

    async def export(
        self, period: str, page_size: int = MAX_EXPORT_PAGE
    ) -> AsyncIterator[ExportPage]:
        """Every page of ``period``'s export, one at a time (see :meth:`export_page`)."""
        cursor: str | None = None
        while True:
            page = await self.export_page(period, cursor, page_size)
            yield page
            cursor = page.cursor
            if cursor is None:
                return

    # -- node id owners (ADR 0004) -----------------------------------------------------------

    @abc.abstractmethod
    async def claim_owner(
        self, node: str, token: str, *, lease_s: float, now: float, accept: Sequence[str] = ()
    ) -> Owner:
        """Make ``token`` the owner of ``node`` until ``now + lease_s``, atomically, if the id
        has no owner, its owner is ``token`` or one of ``accept`` (earlier tokens of the same
        data dir), or its owner's lease has ended (``expires <= now``).

        Returns the owner after the call: ``token``'s on success, else the holder (unchanged).
        """

    @abc.abstractmethod
    async def renew_owner(
        self, node: str, token: str, *, lease_s: float, now: float, note: str | None = None
    ) -> Owner | None:
        """Move the end of ``token``'s lease on ``node`` to ``now + lease_s`` if ``token`` still
        owns it (whatever its lease says); ``lease_s = 0`` releases it. ``note`` (at most
        :data:`MAX_OWNER_NOTE_BYTES`) replaces the record's note in the same write (None: kept).
        Returns the owner after the call: another token (or ``None``, no owner) means ``token``
        lost the id.
        """

    @abc.abstractmethod
    async def owner(self, node: str) -> Owner | None:
        """The owner of ``node`` now (a consistent read), ``None`` if it has none."""

    # -- limits (docs/quotas.md) -------------------------------------------------------------
    #
    # Plans, assignments and overrides are opaque records ``(scope, name, feature, body)``
    # (``meter.quotas.limits`` encodes them) plus one version number that every change bumps in the
    # same atomic write, so a node can tell with one small read whether what it holds is
    # current.

    async def limits_version(self) -> int:
        """The version of the stored limits (0: never changed). A consistent read."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep limits")

    async def read_limits(self) -> tuple[int, list[tuple[str, str, str, str]]]:
        """Every limits record and the version they are as of."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep limits")

    async def write_limit(
        self, scope: str, name: str, feature: str, body: str | None, expect: int | None = None
    ) -> int:
        """Put (``body``) or delete (``None``) one record and bump the version, atomically;
        return the new version. ``expect``: only if the version is still that one, else
        :class:`VersionMoved` and nothing written."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep limits")

    # -- strict budgets (escrow, ADR 0009) ---------------------------------------------------
    # One record per counter under a strict limit (``meter.quotas.escrow`` encodes it), replaced
    # whole by compare-and-swap on its version, so every decision stays in one pure module.

    async def budget_read(self, key: Key) -> BudgetItem:
        """The budget record of ``key`` (``BudgetItem(0, None)`` if there is none). A
        consistent read."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep budgets")

    async def budget_swap(self, key: Key, version: int, body: str) -> bool:
        """Store ``body`` as version ``version + 1`` if the stored version is ``version`` (0:
        none stored), with no units admitted onto it (the caller folded those it read into
        ``body``); ``False`` if it is not. A write whose answer was lost may have landed:
        after ``False`` or :class:`StorageUnavailable` the caller reads the record again to
        tell (its body names the write)."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep budgets")

    async def budget_admit(
        self, key: Key, body: str, name: str, units: int, most: int, op: str
    ) -> BudgetItem | None:
        """Add ``units`` (more than 0) to those admitted straight onto the record under
        ``name``, in one conditional write: only if the record's body is ``body`` (or
        there is no record: then it is made with that body), the units admitted onto it stay
        within ``most`` with these, and ``op`` is not ``name``'s last such write already.
        The record after it, or None if a condition failed. Moves the version on (a swap
        decided before it loses). A lost answer: :class:`StorageUnavailable`; the caller
        reads the record to tell (``op`` names the write)."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep budgets")

    # -- threshold alerts (docs/quotas.md) ---------------------------------------------------

    async def claim_alert(self, alert_id: str, body: str) -> bool:
        """Store ``body`` under ``alert_id`` if nothing is stored under it yet ("put if
        absent"); True only if the body stored under it now is ``body`` (this call, or an
        earlier try of it whose answer was lost, stored it), False if another body was there.
        Bodies name their claimant, so two claimants never store equal bodies. Raises
        :class:`StorageError` if storage cannot tell (the caller tries again later)."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep alerts")

    # -- cluster settings (ADR 0024) ---------------------------------------------------------

    async def cluster_setting(self, name: str, value: str) -> str:
        """Store ``value`` under ``name`` unless a value is stored there ("put if absent",
        kept for good); answer the value stored now. Raises :class:`StorageError` if storage
        cannot tell."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep cluster settings")

    # -- credits ledgers (docs/ledger.md) ----------------------------------------------------
    # Per tenant: a balance record replaced by compare-and-swap on its version, an append-only
    # run of entries ordered by sequence, and one ref record per change (never replaced). All
    # bodies are opaque strings (``meter.ledger.model`` encodes them, so every decision stays in
    # that one pure module).

    async def ledger_read(self, tenant: str) -> tuple[int, str | None]:
        """The balance record of ``tenant``'s ledger and its version; ``(0, None)`` if it has
        none. A consistent read."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep ledgers")

    async def ledger_write(
        self,
        tenant: str,
        version: int,
        body: str,
        entries: Sequence[LedgerRow],
        refs: Sequence[tuple[str, str]] = (),
    ) -> bool:
        """In one atomic write: store ``body`` as version ``version + 1``, add each entry
        ``(seq, body, at_ms)`` (to the tenant's entries, and to the timeline of every tenant's
        at ``at_ms``) and each ref record ``(ref, body)``, if the stored version is
        ``version`` (0: none stored) and none of the refs or entry sequences exists yet.
        ``False`` (nothing written) otherwise. A write whose answer was lost may have landed:
        after ``False`` or :class:`StorageUnavailable` the caller reads again to tell (its ref
        record names the write)."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep ledgers")

    async def ledger_ref(self, tenant: str, ref: str) -> str | None:
        """The ref record ``ref`` of ``tenant``'s ledger, ``None`` if there is none. A
        consistent read."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep ledgers")

    async def ledger_entries(self, tenant: str, after: int, limit: int) -> list[tuple[int, str]]:
        """Up to ``limit`` entries ``(seq, body)`` of ``tenant``'s ledger with a sequence above
        ``after``, in sequence order. A consistent read."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep ledgers")

    async def ledger_timeline(
        self, start_ms: int, end_ms: int, after: str | None, limit: int
    ) -> tuple[list[tuple[str, int, str]], str | None]:
        """Every tenant's ledger entries written at ``start_ms <= at_ms < end_ms``, in the
        order of :func:`timeline_position` (time, then tenant, then sequence): up to ``limit``
        ``(tenant, seq, body)`` past the position ``after`` (None: from the start), and the
        position to go on from (None: no more). A consistent read."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep ledgers")

    # -- gauges (docs/dimensions.md) -----------------------------------------------------------
    # A gauge is stored as a counter of its own, named :func:`gauge_key` (its value is the
    # counter's total, so listings and exports read it as any counter) that also holds the
    # reading's time and node; a write keeps a reading only if it wins (:func:`reading_wins`)
    # over the stored one: any number of writes of a reading, in any order, leave the same
    # item.

    async def put_gauges(
        self, items: Sequence[tuple[Key, str, GaugeReading]]
    ) -> dict[Key, GaugeReading | StorageError]:
        """Write each ``(key, kind, reading)`` (``kind``: ``max`` or ``latest``) if it wins
        over the stored reading; each key's reading after the write (its own, or the stored
        one that wins over it) or the error it hit. An exception: every outcome unknown (a
        write again is harmless)."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep gauges")

    async def load_gauges(self, keys: Sequence[Key]) -> dict[Key, GaugeReading | None]:
        """The stored reading of each key (``None``: none). A consistent read."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep gauges")

    # -- history (docs/history.md) -------------------------------------------------------------

    async def apply_days(self, node: str, deltas: Sequence[Delta]) -> list[StorageError | None]:
        """Add each delta (its ``day`` set) to its day bucket only, unless the bucket holds
        its ``(node, seq)`` already: the bucket write of a delta whose counter write is known
        to have landed (docs/history.md, "Repairs"). One outcome per delta, in order: ``None``
        (applied or a duplicate) or the error it hit. An exception means every outcome is
        unknown (retry them)."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep day buckets")

    async def day_buckets(self, tenant: str, feature: str, first: str, last: str) -> dict[str, int]:
        """The stored day buckets of the month counters of ``(tenant, feature)``, days
        ``first``..``last`` (``YYYY-MM-DD``, inclusive), by day; days with no bucket are left
        out. One range read (one DynamoDB Query, one SQLite index range)."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep day buckets")

    async def counters_between(
        self, tenant: str, feature: str, first: str, last: str
    ) -> dict[str, int]:
        """The stored totals of the counters of ``(tenant, feature)`` whose periods are of the
        shape of ``first`` and ``last`` (both ``YYYY-MM``: month counters; both
        ``YYYY-MM-DD``: day counters) and lie in ``first``..``last``, by period; periods with
        no counter are left out. One range read of the tenant's counters."""
        raise StoragePermanentError(f"{self.kind}: this storage does not read ranges")

    # -- unique values (docs/storage.md, "Unique values") --------------------------------------
    # A unique feature's value is an item of its own per (key, value), holding the claimant
    # that stored it first: which call of the fleet counts a value is decided by one
    # conditional write. Values expire with their period's counters.

    async def claim_value(self, key: Key, value: str, claimant: str) -> str:
        """Store ``value`` of ``key`` under ``claimant`` if no claimant holds it yet; the
        claimant that holds it after the call (``claimant``: this call, or an earlier try of it
        whose answer was lost, stored it). Claiming again under the same claimant answers the
        same. :class:`StoragePermanentError` (nothing written) for a key, value or claimant
        :func:`check_unique` refuses; :class:`StorageUnavailable` if storage cannot tell (the
        caller claims again under the same claimant)."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep unique values")

    async def claimant_of(self, key: Key, value: str) -> str | None:
        """The claimant holding ``value`` of ``key`` (``None``: nobody claimed it). A consistent
        read: a claim answered before the call is seen. :class:`StoragePermanentError` for a
        key or value :func:`check_value_of` refuses."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep unique values")

    async def void_value(self, key: Key, value: str, claimant: str) -> str | None:
        """Mark ``value`` of ``key`` voided if ``claimant`` holds it (a ``void`` took back the
        call that counted it): it stays claimed (a later claim of it is lost) and
        :meth:`values_page` leaves it out. Marking again changes nothing. The claimant holding
        it (``None``: nobody; another claimant: nothing marked). :class:`StoragePermanentError`
        for what :func:`check_unique` refuses; :class:`StorageUnavailable` if storage cannot
        tell (the caller marks again)."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep unique values")

    async def values_page(
        self, key: Key, cursor: str | None, limit: int
    ) -> tuple[list[str], str | None]:
        """Up to ``limit`` (1..:data:`MAX_VALUES_PAGE`) values claimed in ``key`` and not
        voided, in code point order, after where ``cursor`` (``None``: the start) left off; and
        the cursor of the next page (``None``: no more). One range read (one DynamoDB Query,
        one SQLite index range), consistent; a page may hold fewer than ``limit`` values with
        a cursor after it (voided ones read and left out). :class:`BadCursor` for a cursor no
        page handed out."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep unique values")

    # -- period marks (docs/storage.md, "Period marks") ----------------------------------------
    # One record per (period, node): ``open`` while the node holds units of the period it has
    # not stored, ``closed`` once it closed the period, ``drained`` once it drained cleanly
    # with the period open (closed for an export; the node may open it again). Written by
    # conditional writes only: a close is never reopened, a close never replaced. Kept as long
    # as the period's counters.

    async def mark_period_open(
        self, period: str, node: str, at: float, by: str | None = None
    ) -> PeriodMark:
        """Record that ``node`` counts in ``period``: written where no mark is or over a
        drained one (the node opening again after a drain); an open or closed mark already
        there is kept and returned (conditional write: never reopens a closed period).
        :class:`StoragePermanentError` (nothing written) for inputs
        :func:`check_period_mark` refuses."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep period marks")

    async def mark_period_closed(
        self, period: str, node: str, at: float, by: str, units: dict[str, int] | None = None
    ) -> PeriodMark:
        """Record ``node``'s close of ``period``, with the ``units`` it counted there by
        feature if it says (overwrites an open or drained mark, or writes one where none was;
        a close already there is kept and returned unchanged)."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep period marks")

    async def mark_period_drained(
        self, period: str, node: str, at: float, units: dict[str, int] | None = None
    ) -> PeriodMark | None:
        """Record that ``node`` drained cleanly with ``period`` open (``by`` the node), with
        its ``units`` so far: replaces an ``open`` mark only (conditional write). A closed or
        drained mark is kept and returned unchanged; where no mark is, nothing is written and
        ``None`` answered."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep period marks")

    async def period_marks(self, period: str) -> list[PeriodMark]:
        """Every node's mark of ``period``, sorted by node id (consistent read)."""
        raise StoragePermanentError(f"{self.kind}: this storage does not keep period marks")
