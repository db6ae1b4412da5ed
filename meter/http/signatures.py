"""Every wire method's named params: the table the HTTP API dispatches on and documents.

A MessagePack-RPC call sends its params by position (docs/protocol.md); an HTTP call sends one
JSON object of them by name. A :class:`Signature` says, for one method, its positional params
in order and the fields of its trailing map (``opts``, or ``set_limit``'s limit spec), which the
JSON object holds at its top level beside the positional ones. :func:`wire_params` turns a
JSON object into the params the node's dispatch takes; :mod:`meter.http.openapi` writes the
OpenAPI document from the same table, so the two cannot disagree.

Integers beyond 2^53 are exact both ways: a param the table types as :data:`INT` may be sent
as a decimal string (:func:`coerce`), and :func:`to_json` answers any integer a JSON number
would round as its decimal string. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meter.errors import InvalidArgument

#: A JSON Schema (OpenAPI 3.1 takes JSON Schema 2020-12 as is).
Schema = Mapping[str, Any]

#: The largest integer every JSON reader holds exactly (JavaScript's ``Number``).
JSON_SAFE_INT = 2**53 - 1
_DECIMAL = re.compile(r"-?[0-9]{1,20}")

#: An integer: a JSON number, or its decimal string (exact beyond 2^53).
INT: Schema = {
    "oneOf": [
        {"type": "integer"},
        {"type": "string", "pattern": "^-?[0-9]{1,20}$"},
    ],
    "description": "an integer; beyond 2^53 send it as its decimal string",
}
STR: Schema = {"type": "string"}
BOOL: Schema = {"type": "boolean"}
#: An instant, epoch seconds.
AT: Schema = {"type": "number", "description": "epoch seconds"}
#: ``{dimension: value}``.
DIMS: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
#: A threshold alert's percentages of a limit.
ALERTS: Schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 10}


def _obj(**props: Schema) -> Schema:
    return {"type": "object", "properties": props, "additionalProperties": False}


#: A plan's limit of one feature (``set_plan``).
LIMIT_SPEC: Schema = _obj(limit=INT, kind=STR, enforcement=STR, alerts=ALERTS, price=INT)
#: One ``track_many`` item: ``[tenant, feature, qty]`` or with ``{id, dims}``.
TRACK_ITEM: Schema = {
    "type": "array",
    "prefixItems": [
        STR,
        STR,
        INT,
        {"oneOf": [{"type": "null"}, _obj(id=STR, dims=DIMS)]},
    ],
    "minItems": 3,
    "maxItems": 4,
}


@dataclass(frozen=True, slots=True)
class Param:
    """One named param: its schema; a positional one not given is sent as ``default`` (the
    value the node takes for it), unless it is ``required``."""

    name: str
    schema: Schema
    required: bool = False
    default: Any = None
    doc: str = ""


def need(name: str, schema: Schema, doc: str = "") -> Param:
    """A required param."""
    return Param(name, schema, required=True, doc=doc)


@dataclass(frozen=True, slots=True)
class Signature:
    """One method: its positional params, the fields of its trailing map (given at the top
    level of the JSON object), and which field ``Idempotency-Key`` fills (``None``: none)."""

    method: str
    summary: str
    params: tuple[Param, ...] = ()
    #: The trailing map's fields; ``None``: the method takes no trailing map.
    fields: tuple[Param, ...] | None = None
    #: The node needs the trailing map, even empty (``set_limit``'s spec); the API always
    #: sends it.
    map_required: bool = False
    key: str | None = None
    #: It changes nothing (a read).
    read: bool = False

    #: Every name the JSON object may hold, in order (filled from the params).
    names: tuple[str, ...] = ()
    #: The same, as a set (looked up for every name a call gives).
    known: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        names = tuple(p.name for p in (*self.params, *(self.fields or ())))
        object.__setattr__(self, "names", names)  # (derived once: read on every call)
        object.__setattr__(self, "known", frozenset(names))


_TENANT = need("tenant", STR, "tenant name (with tenant_hierarchy: acme/alice)")
_FEATURE = need("feature", STR)
_ID = Param("id", STR, doc="request id: a retry with it counts once (Idempotency-Key)")
_REF = Param("ref", STR, doc="the entry's ref: a retry with it writes once (Idempotency-Key)")
_RID = need("reservation_id", STR)

SIGNATURES: dict[str, Signature] = {
    s.method: s
    for s in (
        Signature(
            "track",
            "Count qty units of a feature for a tenant; answers the new total.",
            (_TENANT, _FEATURE, Param("qty", INT, default=1)),
            (
                Param("at", AT),
                _ID,
                Param("detail", BOOL, doc="answer the check map"),
                Param("dims", DIMS),
                Param("value", STR, doc="a unique feature's value"),
            ),
            key="id",
        ),
        Signature(
            "track_many",
            "Count many items in one call; one answer per item.",
            (need("items", {"type": "array", "items": TRACK_ITEM, "maxItems": 10_000}),),
        ),
        Signature(
            "usage",
            "A counter's value (one dimension value's with where; groups with group_by).",
            (_TENANT, _FEATURE),
            (
                Param("at", AT),
                Param("where", DIMS),
                Param("group_by", {"type": "array", "items": STR}),
            ),
            read=True,
        ),
        Signature(
            "usage_all",
            "Every counter of a tenant in the period: feature -> value.",
            (_TENANT,),
            (Param("at", AT),),
            read=True,
        ),
        Signature(
            "usage_children",
            "An account's users' counters of a feature in the period, a page at a time.",
            (need("account", STR), _FEATURE),
            (Param("at", AT), Param("cursor", STR), Param("limit", INT)),
            read=True,
        ),
        Signature(
            "reserve",
            "Hold qty units (not counted) until commit, release or the lease's end.",
            (_TENANT, _FEATURE, need("qty", INT)),
            (
                Param("limit", INT),
                Param("ttl_ms", INT),
                Param("at", AT),
                _ID,
                Param("dims", DIMS),
            ),
            key="id",
        ),
        Signature(
            "commit",
            "Count a reservation (actual_qty, default the reserved qty).",
            (_RID, Param("actual_qty", INT)),
            (_ID,),
            key="id",
        ),
        Signature("release", "Drop a reservation.", (_RID,), (_ID,), key="id"),
        Signature(
            "void",
            "Take back a call counted under request id call_id, once.",
            (need("call_id", STR),),
            (_ID,),
            key="id",
        ),
        Signature(
            "check",
            "Would qty more units be counted? Counts nothing.",
            (_TENANT, _FEATURE, Param("qty", INT, default=1)),
            (Param("at", AT), Param("dims", DIMS)),
            read=True,
        ),
        Signature(
            "set_plan",
            "Write a plan (replacing it): feature -> limit spec.",
            (
                need("name", STR),
                need("features", {"type": "object", "additionalProperties": LIMIT_SPEC}),
            ),
        ),
        Signature(
            "assign_plan",
            "Put a tenant on a plan (null: none); optionally its billing cycle.",
            (_TENANT, need("plan", {"type": ["string", "null"]})),
            (
                Param("anchor_day", INT),
                Param("anchor_time", STR),
                Param("tz", STR),
                Param("effective", AT),
            ),
        ),
        Signature(
            "set_limit",
            "A tenant's own limit (or price) on a feature.",
            (_TENANT, _FEATURE),
            (
                Param("limit", INT),
                Param("kind", STR, doc="hard or soft"),
                Param("enforcement", STR, doc="fast or strict"),
                Param("alerts", ALERTS),
                Param("price", INT, doc="credits a unit"),
                Param("where", DIMS, doc="one dimension value"),
            ),
            map_required=True,
        ),
        Signature(
            "clear_limit",
            "Remove a tenant's own limit on a feature.",
            (_TENANT, _FEATURE),
            (Param("where", DIMS),),
        ),
        Signature(
            "set_feature",
            "Declare a feature: aggregation, dimensions.",
            (_FEATURE,),
            (
                Param("aggregation", STR),
                Param("dimensions", {"type": "array", "items": STR}),
                Param("max_combinations", INT),
            ),
        ),
        Signature("get_feature", "A feature's declaration.", (_FEATURE,), read=True),
        Signature("limits", "A tenant's plan and effective limits.", (_TENANT,), read=True),
        Signature("ping", "Answers pong.", read=True),
        Signature("status", "The node's status, for operators.", read=True),
        Signature(
            "history",
            "Units per UTC day or month over a range.",
            (_TENANT, _FEATURE),
            (
                Param("from", STR),
                Param("to", STR),
                Param("granularity", STR, doc="day or month"),
                Param("where", DIMS),
            ),
            read=True,
        ),
        Signature(
            "export",
            "One page of a period's stored counters, every tenant's.",
            (need("period", STR),),
            (Param("cursor", STR), Param("limit", INT)),
            read=True,
        ),
        Signature(
            "close_period",
            "Close a period for a node that will never come back.",
            (need("period", STR), need("node", STR)),
        ),
        Signature(
            "grant",
            "Grant credits to a tenant.",
            (_TENANT, need("amount", INT)),
            (_REF, Param("expires_at", AT), Param("priority", INT)),
            key="ref",
        ),
        Signature(
            "debit",
            "Debit credits from a tenant.",
            (_TENANT, need("amount", INT)),
            (_REF,),
            key="ref",
        ),
        Signature("balance", "A tenant's credits.", (_TENANT,), read=True),
        Signature(
            "ledger",
            "A page of a tenant's ledger entries.",
            (_TENANT,),
            (Param("after", INT), Param("limit", INT)),
            read=True,
        ),
        Signature(
            "ledger_timeline",
            "A page of every tenant's ledger entries in time order.",
            (),
            (Param("from", AT), Param("to", AT), Param("cursor", STR), Param("limit", INT)),
            read=True,
        ),
    )
}

#: The wire methods bound to their connection: over HTTP, ``GET /v1/subscribe`` (events).
STREAMED = frozenset({"subscribe", "unsubscribe", "subscribe_alerts", "unsubscribe_alerts"})


def wire_params(sig: Signature, body: object, key: str | None = None) -> list[Any]:
    """The params of a call of ``sig`` from its JSON object ``body``; ``key`` (the
    ``Idempotency-Key`` header) fills the field ``sig.key``. :class:`InvalidArgument` for a
    body that is not an object, an unknown or missing name, or a key the method cannot take."""
    method = sig.method
    if not isinstance(body, dict):
        raise InvalidArgument(f"{method}: the body must be a JSON object of named params")
    known = sig.known
    for name in body:
        if name not in known:
            allowed = ", ".join(sig.names) or "none"
            raise InvalidArgument(f"{method}: unknown param {name[:32]!r} (allowed: {allowed})")
    if key is not None:
        if sig.key is None:
            raise InvalidArgument(f"{method} takes no Idempotency-Key")
        given = body.get(sig.key)
        if given is not None and given != key:
            raise InvalidArgument(f"{method}: Idempotency-Key and {sig.key} differ")
        body = {**body, sig.key: key}
    out: list[Any] = []
    given = 0
    for p in sig.params:
        if p.name in body:
            value = body[p.name]
            # (a string or a boolean is what the node checks: only numbers and containers
            # may hold a decimal string to read)
            out.append(value if p.schema is STR or p.schema is BOOL else coerce(p.schema, value))
            given += 1
        elif p.required:
            raise InvalidArgument(f"{method}: {p.name} is missing")
        else:
            out.append(p.default)
    if sig.fields is not None:
        fields = sig.fields if len(body) > given else ()  # (the rest of the body is fields)
        opts = {f.name: coerce(f.schema, body[f.name]) for f in fields if f.name in body}
        if opts or sig.map_required:  # (none: left out, as a client does: the fast path)
            out.append(opts)
    return out


def coerce(schema: Schema, value: Any) -> Any:
    """``value`` with every decimal string where ``schema`` types an :data:`INT` read as the
    integer it spells; anything else unchanged (the node checks types and ranges)."""
    if schema is INT:
        if type(value) is str and _DECIMAL.fullmatch(value):
            return int(value)
        return value
    if isinstance(value, dict):
        props = schema.get("properties")
        rest = schema.get("additionalProperties")
        if props is None and not isinstance(rest, Mapping):
            return value
        out = {}
        for k, v in value.items():
            inner = props.get(k) if props is not None else None
            if inner is None and isinstance(rest, Mapping):
                inner = rest
            out[k] = v if inner is None else coerce(inner, v)
        return out
    if isinstance(value, list):
        prefix = schema.get("prefixItems", ())
        items = schema.get("items")
        return [
            coerce(prefix[i], v) if i < len(prefix)
            else coerce(items, v) if isinstance(items, Mapping) else v
            for i, v in enumerate(value)
        ]  # fmt: skip
    return value


def to_json(value: Any) -> Any:
    """A node's answer as JSON can carry it exactly: integers past +-2^53-1 as decimal
    strings, tuples as arrays, bytes as UTF-8 text; :class:`ValueError` for what JSON cannot
    hold (a float NaN, a key that is not a string)."""
    t = type(value)
    if t is int:
        return value if -JSON_SAFE_INT <= value <= JSON_SAFE_INT else str(value)
    if t is str or t is bool or value is None:
        return value
    if t is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("a float JSON cannot hold")
        return value
    if t is dict:
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise ValueError(f"a map key of type {type(k).__name__}")
            out[k] = to_json(v)
        return out
    if t is list or t is tuple:
        return [to_json(v) for v in value]
    if t is bytes:
        return value.decode("utf-8")
    raise ValueError(f"a value of type {t.__name__}")


#: The HTTP status of each error code (docs/http.md). ``insufficient_balance`` is 402
#: (Payment Required: credits, not a rate) and ``limit_exceeded`` 429.
STATUS: dict[str, int] = {
    "invalid_argument": 400,
    "unauthenticated": 401,
    "insufficient_balance": 402,
    "not_found": 404,
    "unknown_method": 404,
    "conflict": 409,
    "period_closed": 409,
    "payload_too_large": 413,
    "limit_exceeded": 429,
    "internal": 500,
    "unavailable": 503,
}
