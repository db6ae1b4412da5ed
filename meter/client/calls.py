"""The typed methods of both clients, defined once: a table of calls.

Each row (a :class:`Method`) says, for one typed method of :class:`~meter.client.Client` and
:class:`~meter.client.AsyncClient`: its name on the wire, how its params are built from the
Python arguments, whether they carry request ids, when it may be sent again (its
:class:`Kind`), and how its answer is converted. The clients keep only their transport
(a blocking socket, an asyncio protocol) and one thin wrapper per method::

    def usage(self, tenant: str, feature: str, **opts: Any) -> int:
        return self._run(calls.USAGE, tenant, feature, opts)

Why wrappers written out, and not methods made from the table at import: people read the
signatures and mypy --strict checks callers against them, so each class states every method
with its types, defaults and docstring. The wrapper only forwards: ``_run`` takes a
``Method[P, T]`` and ``*args: P.args``, so mypy checks the forwarded arguments against the
row's params builder and the wrapper's return type against the row's answer converter;
``tests/test_client_api.py`` checks that both classes state the same signatures and send the
same calls. A method with its own state (subscriptions, iterators) still builds its call here.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Concatenate, Generic, NamedTuple, ParamSpec, TypeVar, cast

from meter.core.idempotency import MAX_ID_BYTES
from meter.errors import InvalidArgument, MeterError, from_wire
from storage.base import ExportRow

P = ParamSpec("P")
T = TypeVar("T")

#: A request id is a string of 1 .. this many UTF-8 bytes (the node's limit).
MAX_REQUEST_ID_BYTES = MAX_ID_BYTES

#: A raw call of ``pipeline()``: ``(method, params)``.
Call = tuple[str, Sequence[Any]]
#: A ``track_many`` item: ``(tenant, feature, qty)`` or ``(tenant, feature, qty, id)``, or
#: with its options ``(tenant, feature, qty, {"id": ..., "dims": {...}})``.
TrackItem = (
    tuple[str, str, int]
    | tuple[str, str, int, str | None]
    | tuple[str, str, int, Mapping[str, Any]]
)


def new_request_id() -> str:
    """A fresh random request id (22 URL-safe characters, 128 random bits)."""
    return secrets.token_urlsafe(16)


def check_request_id(rid: object) -> str:
    """Return ``rid`` if it is a valid request id (a str of 1..128 UTF-8 bytes), else raise
    InvalidArgument."""
    if not isinstance(rid, str):
        raise InvalidArgument(f"request id must be a string, got {type(rid).__name__}")
    try:
        n = len(rid.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument("request id must be valid UTF-8") from None
    if not 1 <= n <= MAX_REQUEST_ID_BYTES:
        raise InvalidArgument(
            f"request id must be 1 to {MAX_REQUEST_ID_BYTES} UTF-8 bytes, got {n} bytes"
        )
    return rid


class Ids:
    """The request ids of one call: the caller's (checked), else fresh ones unless the
    client's ``auto_ids`` is off; ``complete`` stays True while every one asked got an id."""

    __slots__ = ("auto", "complete")

    def __init__(self, auto: bool) -> None:
        self.auto = auto
        self.complete = True

    def __call__(self, rid: str | None) -> str | None:
        if rid is not None:
            return check_request_id(rid)
        if self.auto:
            return new_request_id()
        self.complete = False
        return None


class Kind(enum.Enum):
    """When a call that got no answer may be sent again (docs/protocol.md, "Request ids and
    retries"); one answered ``unavailable`` always may (the node did nothing)."""

    #: Changes nothing: always.
    READ = "read"
    #: A change the node makes once however often it is sent (by reservation id, ledger ref,
    #: or because it sets a value): always.
    CHANGE = "change"
    #: Counts units: only if every count in it carries a request id.
    COUNT = "count"


class Prepared(NamedTuple, Generic[T]):
    """One call of a typed method, ready to send: ``resend`` says whether it may be sent
    again after it got no answer."""

    method: str
    params: list[Any]
    resend: bool
    answer: Callable[[Any], T]


class Method(Generic[P, T]):
    """A row of the table: the typed method ``name``, sent as ``wire``."""

    __slots__ = ("_build", "answer", "ids", "kind", "name", "wire")

    def __init__(
        self,
        name: str,
        build: Callable[Concatenate[Ids, P], list[Any]],
        answer: Callable[[Any], T],
        kind: Kind,
        *,
        ids: bool,
        wire: str | None = None,
    ) -> None:
        self.name = name
        self.wire = name if wire is None else wire
        self.kind = kind
        #: Whether its params carry request ids (the mutating calls of :mod:`meter.client`).
        self.ids = ids
        self.answer = answer
        self._build = build

    def prepare(self, auto_ids: bool, /, *args: P.args, **kwargs: P.kwargs) -> Prepared[T]:
        """The call for these Python arguments (InvalidArgument if one is bad)."""
        ids = Ids(auto_ids)
        params = self._build(ids, *args, **kwargs)
        resend = self.kind is not Kind.COUNT or ids.complete
        return Prepared(self.wire, params, resend, self.answer)

    def __repr__(self) -> str:
        return f"Method({self.name!r}, wire={self.wire!r}, {self.kind.name}, ids={self.ids})"


def _with_ids(
    name: str,
    build: Callable[Concatenate[Ids, P], list[Any]],
    answer: Callable[[Any], T],
    kind: Kind,
    wire: str | None = None,
) -> Method[P, T]:
    """A row whose params builder gets the call's :class:`Ids`."""
    return Method(name, build, answer, kind, ids=True, wire=wire)


def _plain(
    name: str,
    build: Callable[P, list[Any]],
    answer: Callable[[Any], T],
    kind: Kind = Kind.READ,
    wire: str | None = None,
) -> Method[P, T]:
    """A row whose params carry no request id."""

    def without_ids(_ids: Ids, /, *args: P.args, **kwargs: P.kwargs) -> list[Any]:
        return build(*args, **kwargs)

    return Method(name, without_ids, answer, kind, ids=False, wire=wire)


# -- params builders -------------------------------------------------------------------------


def _opts(opts: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if v is not None}


def _with_opts(params: list[Any], opts: dict[str, Any]) -> list[Any]:
    opts = _opts(opts)
    if opts:
        params.append(opts)
    return params


def _track(
    ids: Ids, tenant: str, feature: str, qty: int, rid: str | None, opts: dict[str, Any]
) -> list[Any]:
    rid = ids(rid)
    opts = _opts(opts)
    if rid is not None:
        opts["id"] = rid
    return [tenant, feature, qty, opts] if opts else [tenant, feature, qty]


def _track_detail(
    ids: Ids, tenant: str, feature: str, qty: int, rid: str | None, opts: dict[str, Any]
) -> list[Any]:
    return _track(ids, tenant, feature, qty, rid, {**opts, "detail": True})


def _track_many(ids: Ids, items: Iterable[TrackItem]) -> list[Any]:
    out: list[list[Any]] = []
    for item in items:
        seq = cast(Sequence[Any], item)
        if len(seq) not in (3, 4):
            raise InvalidArgument(
                "track_many: an item is (tenant, feature, qty) or (tenant, feature, qty, "
                f"id), got {len(seq)} elements"
            )
        opts: dict[str, Any] = {}
        given = seq[3] if len(seq) == 4 else None
        if isinstance(given, Mapping):
            opts = {k: v for k, v in given.items() if v is not None}
            given = opts.pop("id", None)
        rid = ids(given)
        if rid is not None:
            opts["id"] = rid
        out.append([seq[0], seq[1], seq[2], opts] if opts else [seq[0], seq[1], seq[2]])
    return [out]


def _reserve(
    ids: Ids,
    tenant: str,
    feature: str,
    qty: int,
    limit: int | None,
    ttl_ms: int | None,
    at: float | None,
    rid: str | None,
    dims: dict[str, str] | None = None,
) -> list[Any]:
    opts = {"limit": limit, "ttl_ms": ttl_ms, "at": at, "id": ids(rid), "dims": dims}
    return _with_opts([tenant, feature, qty], opts)


def _commit(ids: Ids, reservation_id: str, actual_qty: int | None, rid: str | None) -> list[Any]:
    rid = ids(rid)
    if rid is not None:
        return [reservation_id, actual_qty, {"id": rid}]
    return [reservation_id] if actual_qty is None else [reservation_id, actual_qty]


def _release(ids: Ids, reservation_id: str, rid: str | None) -> list[Any]:
    rid = ids(rid)
    return [reservation_id] if rid is None else [reservation_id, {"id": rid}]


def _close_period(period: str, node: str) -> list[Any]:
    return [period, node]


def _void(ids: Ids, call_id: str, rid: str | None) -> list[Any]:
    rid = ids(rid)
    return [call_id] if rid is None else [call_id, {"id": rid}]


def _nothing() -> list[Any]:
    return []


def _tenant(tenant: str) -> list[Any]:
    return [tenant]


def _key(tenant: str, feature: str) -> list[Any]:
    return [tenant, feature]


def _assign_plan(tenant: str, plan: str | None, opts: Mapping[str, Any] | None = None) -> list[Any]:
    return [tenant, plan] if not opts else [tenant, plan, dict(opts)]


def _counter(tenant: str, feature: str, opts: dict[str, Any]) -> list[Any]:
    return _with_opts([tenant, feature], opts)


def _counters(tenant: str, opts: dict[str, Any]) -> list[Any]:
    return _with_opts([tenant], opts)


def _children(
    account: str, feature: str, at: float | None, cursor: str | None, limit: int | None
) -> list[Any]:
    given = (("at", at), ("cursor", cursor), ("limit", limit))
    return _with_opts([account, feature], {k: v for k, v in given if v is not None})


def _check(tenant: str, feature: str, qty: int, opts: dict[str, Any]) -> list[Any]:
    return _with_opts([tenant, feature, qty], opts)


def _history(
    tenant: str,
    feature: str,
    first: str | None,
    last: str | None,
    granularity: str,
    where: Mapping[str, str] | None,
) -> list[Any]:
    opts = {"from": first, "to": last, "granularity": granularity, "where": _where(where)}
    return _with_opts([tenant, feature], opts)


def _where(where: Mapping[str, str] | None) -> dict[str, str] | None:
    return None if where is None else dict(where)


def _grouped(tenant: str, feature: str, group_by: Sequence[str], opts: dict[str, Any]) -> list[Any]:
    if isinstance(group_by, str):
        group_by = [group_by]
    return _with_opts([tenant, feature], {**opts, "group_by": list(group_by)})


def _declare(
    feature: str,
    aggregation: str | None,
    dimensions: Sequence[str] | None,
    max_combinations: int | None,
) -> list[Any]:
    if isinstance(dimensions, str):
        raise InvalidArgument("set_feature: dimensions must be a list of names, not a string")
    opts = {
        "aggregation": aggregation,
        "dimensions": None if dimensions is None else list(dimensions),
        "max_combinations": max_combinations,
    }
    return [feature, _opts(opts)]


def _feature(feature: str) -> list[Any]:
    return [feature]


def _clear_limit(tenant: str, feature: str, where: Mapping[str, str] | None) -> list[Any]:
    return [tenant, feature] if where is None else [tenant, feature, {"where": dict(where)}]


def _subscribe(tenant: str, features: Iterable[str] | None) -> list[Any]:
    if isinstance(features, str):
        raise InvalidArgument("subscribe: features must be a list of names, not a string")
    named = list(features or ())
    return [tenant, named] if named else [tenant]


def _export(period: str, cursor: str | None, limit: int | None) -> list[Any]:
    opts = {k: v for k, v in (("cursor", cursor), ("limit", limit)) if v is not None}
    return [period, opts] if opts else [period]


def _export_state(period: str) -> list[Any]:
    return [period, {"limit": 1}]


def _close_state(answer: Any) -> dict[str, Any]:
    """An ``export`` answer's close state (docs/invoicing.md), without its rows."""
    return {k: v for k, v in cast(dict[str, Any], answer).items() if k not in ("rows", "cursor")}


def _set_plan(name: str, features: Mapping[str, Mapping[str, Any]]) -> list[Any]:
    return [name, {f: dict(spec) for f, spec in features.items()}]


def _set_limit(
    tenant: str,
    feature: str,
    limit: int | None,
    kind: str,
    enforcement: str,
    alerts: Sequence[int] | None,
    where: Mapping[str, str] | None,
    price: int | None = None,
) -> list[Any]:
    spec: dict[str, Any] = {"kind": kind, "enforcement": enforcement}
    if limit is not None:
        spec["limit"] = limit
    if price is not None:
        spec["price"] = price
    if alerts:
        spec["alerts"] = list(alerts)
    if where is not None:
        spec["where"] = dict(where)
    return [tenant, feature, spec]


def _new_ref() -> str:
    """A ref for a ledger change whose caller gave none: the client's retries reuse it."""
    return "c-" + secrets.token_hex(16)


def _grant(
    tenant: str, amount: int, ref: str | None, expires_at: int | None, priority: int | None
) -> list[Any]:
    opts: dict[str, Any] = {"ref": ref if ref is not None else _new_ref()}
    if expires_at is not None:
        opts["expires_at"] = expires_at
    if priority is not None:
        opts["priority"] = priority
    return [tenant, amount, opts]


def _debit(tenant: str, amount: int, ref: str | None) -> list[Any]:
    return [tenant, amount, {"ref": ref if ref is not None else _new_ref()}]


def _ledger_page(tenant: str, after: int | None, limit: int | None) -> list[Any]:
    opts = {k: v for k, v in (("after", after), ("limit", limit)) if v is not None}
    return [tenant, opts] if opts else [tenant]


def _ledger_timeline(
    start: float | None, end: float | None, cursor: str | None, limit: int | None
) -> list[Any]:
    given = (("from", start), ("to", end), ("cursor", cursor), ("limit", limit))
    opts = {k: v for k, v in given if v is not None}
    return [opts] if opts else []


# -- answers -----------------------------------------------------------------------------------
# Most answers are returned as the node sends them: these only give them their type.


def _total(answer: Any) -> int | None:
    return cast(int | None, answer)


def _int(answer: Any) -> int:
    return cast(int, answer)


def _str(answer: Any) -> str:
    return cast(str, answer)


def _bool(answer: Any) -> bool:
    return cast(bool, answer)


def _map(answer: Any) -> dict[str, Any]:
    return cast(dict[str, Any], answer)


def _values(answer: Any) -> dict[str, int]:
    return cast(dict[str, int], answer)


def _as_sent(answer: Any) -> Any:
    """(``subscribe``: the values now, which the client's inbox reads.)"""
    return answer


def _ignored(answer: Any) -> None:
    return None


def _many_results(answer: Any) -> list[int | MeterError | None]:
    """A ``track_many`` answer with each item's error map turned into its exception."""
    return [from_wire(r) if isinstance(r, dict) else r for r in cast(list[Any], answer)]


def _history_answer(answer: Any) -> list[tuple[str, int]]:
    return [(str(period), int(value)) for period, value in answer]


def _version(answer: Any) -> int:
    """The ``version`` of a limits change's answer."""
    return int(answer["version"])


def row_from_wire(value: Any) -> ExportRow:
    """An ``export`` answer's row as an :class:`ExportRow` (a str total back to an int)."""
    tenant, feature, period, total, *more = value
    dims = dict(more[0]) if more else {}
    gauge = len(more) > 1 and more[1] == "gauge"
    return ExportRow(str(tenant), str(feature), str(period), int(total), dims, gauge)


def _export_answer(answer: Any) -> tuple[list[ExportRow], str | None]:
    return [row_from_wire(r) for r in answer["rows"]], answer["cursor"]


# -- the table ---------------------------------------------------------------------------------

TRACK = _with_ids("track", _track, _total, Kind.COUNT)
TRACK_DETAIL = _with_ids("track_detail", _track_detail, _map, Kind.COUNT, wire="track")
TRACK_MANY = _with_ids("track_many", _track_many, _many_results, Kind.COUNT)
RESERVE = _with_ids("reserve", _reserve, _str, Kind.COUNT)
COMMIT = _with_ids("commit", _commit, _int, Kind.CHANGE)  # once per reservation id
RELEASE = _with_ids("release", _release, _ignored, Kind.CHANGE)
VOID = _with_ids("void", _void, _map, Kind.CHANGE)  # a call is taken back once
USAGE = _plain("usage", _counter, _int)
USAGE_ALL = _plain("usage_all", _counters, _values)
USAGE_BY = _plain("usage_by", _grouped, _map, wire="usage")
USAGE_CHILDREN_PAGE = _plain("usage_children_page", _children, _map, wire="usage_children")
HISTORY = _plain("history", _history, _history_answer)
PING = _plain("ping", _nothing, _str)
STATUS = _plain("status", _nothing, _map)
SUBSCRIBE = _plain("subscribe", _subscribe, _as_sent, Kind.CHANGE)
UNSUBSCRIBE = _plain("unsubscribe", _tenant, _bool, Kind.CHANGE)
SUBSCRIBE_ALERTS = _plain("subscribe_alerts", _nothing, _ignored, Kind.CHANGE)
UNSUBSCRIBE_ALERTS = _plain("unsubscribe_alerts", _nothing, _bool, Kind.CHANGE)
EXPORT_PAGE = _plain("export_page", _export, _export_answer, wire="export")
EXPORT_STATE = _plain("export_state", _export_state, _close_state, wire="export")
CHECK = _plain("check", _check, _map)
SET_PLAN = _plain("set_plan", _set_plan, _version, Kind.CHANGE)  # a plan replaced by the same
ASSIGN_PLAN = _plain("assign_plan", _assign_plan, _version, Kind.CHANGE)
SET_LIMIT = _plain("set_limit", _set_limit, _version, Kind.CHANGE)
CLEAR_LIMIT = _plain("clear_limit", _clear_limit, _version, Kind.CHANGE)
SET_FEATURE = _plain("set_feature", _declare, _map, Kind.CHANGE)  # sets: the same twice is once
GET_FEATURE = _plain("get_feature", _feature, _map)
CLOSE_PERIOD = _plain("close_period", _close_period, _map, Kind.CHANGE)  # a close is kept
LIMITS = _plain("limits", _tenant, _map)
GRANT = _plain("grant", _grant, _map, Kind.CHANGE)  # once per ref (the client makes one up)
DEBIT = _plain("debit", _debit, _map, Kind.CHANGE)
BALANCE = _plain("balance", _tenant, _map)
LEDGER_PAGE = _plain("ledger_page", _ledger_page, _map, wire="ledger")
LEDGER_TIMELINE_PAGE = _plain(
    "ledger_timeline_page", _ledger_timeline, _map, wire="ledger_timeline"
)

#: Every row, by the name of its method on both clients.
TABLE: dict[str, Method[Any, Any]] = {
    m.name: m
    for m in (
        TRACK,
        TRACK_DETAIL,
        TRACK_MANY,
        RESERVE,
        COMMIT,
        RELEASE,
        VOID,
        USAGE,
        USAGE_ALL,
        USAGE_BY,
        USAGE_CHILDREN_PAGE,
        HISTORY,
        PING,
        STATUS,
        SUBSCRIBE,
        UNSUBSCRIBE,
        SUBSCRIBE_ALERTS,
        UNSUBSCRIBE_ALERTS,
        EXPORT_PAGE,
        EXPORT_STATE,
        CHECK,
        SET_PLAN,
        ASSIGN_PLAN,
        SET_LIMIT,
        CLEAR_LIMIT,
        SET_FEATURE,
        GET_FEATURE,
        CLOSE_PERIOD,
        LIMITS,
        GRANT,
        DEBIT,
        BALANCE,
        LEDGER_PAGE,
        LEDGER_TIMELINE_PAGE,
    )
}
