"""The two Python clients offer the same typed methods and send the same calls for them.

Their methods are one table (``meter/client/calls.py``) and two sets of thin wrappers, one
per transport: these tests keep the wrappers' signatures in step, check that every row is a
method of both clients and that both send the same call for the same arguments, and that the
client package imports only what it may.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

import meter.client
from meter.client import AsyncClient, Client, _ClientProtocol, calls
from meter.errors import Conflict
from storage.base import ExportRow as StoredRow

CLIENT_DIR = Path(meter.client.__file__).resolve().parent

#: Methods only the blocking client has: the steps of its subscriptions' iterators (an async
#: iterator is stepped with ``async for``).
BLOCKING_ONLY = {"next_usage", "next_alert"}
#: Keyword parameters only the blocking client has: how long each step of its subscriptions'
#: iterators waits (the asyncio ones wait for ever; a caller bounds them with its own timeout).
BLOCKING_ONLY_PARAMS = {"subscribe": ["timeout"], "subscribe_alerts": ["timeout"]}
#: Defaults that differ, blocking then asyncio: the blocking client bounds each wait for an
#: answer by default, the asyncio one does not.
OTHER_DEFAULTS = {("connect", "timeout"): (repr(meter.client.DEFAULT_TIMEOUT), "None")}
#: The protocols of the two sides, compared as each other's.
PAIRED_DUNDERS = {"__enter__": "__aenter__", "__exit__": "__aexit__"}


def _public(cls: type) -> dict[str, Any]:
    """The public methods and properties of ``cls``, as found on the class."""
    return {
        name: inspect.getattr_static(cls, name)
        for name in dir(cls)
        if not name.startswith("_") and not hasattr(object, name)
    }


def _function(member: Any) -> Callable[..., Any]:
    if isinstance(member, property):
        assert member.fget is not None
        return member.fget
    if isinstance(member, classmethod | staticmethod):
        return cast(Callable[..., Any], member.__func__)
    return cast(Callable[..., Any], member)


def _as_async(annotation: str) -> str:
    """A blocking method's annotation as its asyncio twin's reads."""
    annotation = re.sub(r"\bIterator\[", "AsyncIterator[", annotation)
    return re.sub(r"\bClient\b", "AsyncClient", annotation)


def _shape(fn: Callable[..., Any], blocking: bool) -> list[tuple[str, str, str, str]]:
    """Every parameter as (name, kind, default, annotation), then the return annotation,
    with the annotations (strings: the modules defer them) of a blocking method as async."""
    sig = inspect.signature(fn)

    def ann(value: Any) -> str:
        text = "" if value is inspect.Parameter.empty else str(value)
        return _as_async(text) if blocking else text

    params = [
        (p.name, p.kind.name, "" if p.default is p.empty else repr(p.default), ann(p.annotation))
        for p in sig.parameters.values()
    ]
    return [*params, ("return", "", "", ann(sig.return_annotation))]


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)


def test_both_clients_have_the_same_methods_with_the_same_signatures() -> None:
    """For every public method of one client the other has one of the same name and the same
    signature (parameters, kinds, defaults, annotations; ``Iterator`` / ``Client`` on the
    blocking side read as ``AsyncIterator`` / ``AsyncClient``), a coroutine (or an async
    generator) on the asyncio side and neither on the blocking one; the differences there
    are, and only those, are the ones listed above."""
    blocking, aio = _public(Client), _public(AsyncClient)
    assert set(blocking) - set(aio) == BLOCKING_ONLY, "a method on the blocking client only"
    assert set(aio) - set(blocking) == set(), "a method on the asyncio client only"
    problems: list[str] = []
    pairs = [(name, blocking[name], aio[name]) for name in sorted(set(aio))]
    pairs += [(b, Client.__dict__[b], AsyncClient.__dict__[a]) for b, a in PAIRED_DUNDERS.items()]
    for name, b_member, a_member in pairs:
        if isinstance(b_member, property) != isinstance(a_member, property):
            problems.append(f"{name}: a property on one client only")
            continue
        b_fn, a_fn = _function(b_member), _function(a_member)
        if not isinstance(a_member, property) and not _is_async(a_fn):
            problems.append(f"AsyncClient.{name} is not a coroutine function")
        if _is_async(b_fn):
            problems.append(f"Client.{name} is a coroutine function")
        b_shape, a_shape = _shape(b_fn, blocking=True), _shape(a_fn, blocking=False)
        extra = BLOCKING_ONLY_PARAMS.get(name, [])
        b_extra = [p for p in b_shape if p[0] in extra]
        if [p[0] for p in b_extra] != extra or any(p[1] != "KEYWORD_ONLY" for p in b_extra):
            problems.append(f"{name}: the blocking-only keywords are not {extra}")
        b_shape = [p for p in b_shape if p[0] not in extra]
        for (method, param), listed in OTHER_DEFAULTS.items():
            if method != name:
                continue
            got = tuple(p[2] for shape in (b_shape, a_shape) for p in shape if p[0] == param)
            if got != listed:
                problems.append(f"{name}: the {param} defaults are {got}, listed {listed}")
            b_shape = [(*p[:2], "", p[3]) if p[0] == param else p for p in b_shape]
            a_shape = [(*p[:2], "", p[3]) if p[0] == param else p for p in a_shape]
        if b_shape != a_shape:
            problems.append(f"{name}:\n  Client      {b_shape}\n  AsyncClient {a_shape}")
    assert not problems, "the clients' methods differ:\n" + "\n".join(problems)


def test_every_method_of_the_table_is_on_both_clients() -> None:
    rows = {v.name: v for v in vars(calls).values() if isinstance(v, calls.Method)}
    assert rows == calls.TABLE, "a row of calls.py is missing from calls.TABLE"
    # What the meter.client docstring promises: these carry request ids, and the counting
    # ones among them are sent again after no answer only with an id.
    with_ids = {"track", "track_detail", "track_many", "reserve", "commit", "release", "void"}
    assert {name for name, row in calls.TABLE.items() if row.ids} == with_ids
    counts = {name for name, row in calls.TABLE.items() if row.kind is calls.Kind.COUNT}
    assert counts == with_ids - {"commit", "release", "void"}
    for name in calls.TABLE:
        for cls in (Client, AsyncClient):
            assert name in _public(cls), f"{cls.__name__} has no {name}() for its table row"


# -- both clients send the same calls ----------------------------------------------------------


class _RecordingClient(Client):
    """A blocking client whose calls are recorded and answered here (no node, no retries)."""

    def __init__(self, sock: socket.socket, answer: Any, **kwargs: Any) -> None:
        super().__init__(sock, **kwargs)
        self.answer = answer
        self.sent: list[tuple[str, list[Any], bool]] = []

    def _invoke(self, method: str, params: list[Any], retry_unanswered: bool) -> Any:
        self.sent.append((method, params, retry_unanswered))
        return self.answer


class _RecordingAsyncClient(AsyncClient):
    """The asyncio client, recorded the same way."""

    def __init__(self, answer: Any, **kwargs: Any) -> None:
        super().__init__(cast(asyncio.Transport, None), _ClientProtocol(1 << 20), **kwargs)
        self.answer = answer
        self.sent: list[tuple[str, list[Any], bool]] = []

    async def _invoke(self, method: str, params: list[Any], retry_unanswered: bool) -> Any:
        self.sent.append((method, params, retry_unanswered))
        return self.answer


DETAIL = {"allowed": True, "value": 13}
VERSION = {"version": 3}
ENTRY = {"seq": 1}
WIRE_ROWS = {
    "rows": [["t0", "old", "2020-01", "9"], ["t0", "old", "2020-01", 4, {"m": "x"}]],
    "cursor": None,
}

#: (method, args, kwargs, the node's answer, what is sent: (method, params, resend), what
#: the method returns). With ``auto_ids=False``: the ids are the test's own.
GROUPS = {"total": 3, "groups": [{"dims": {"m": "x"}, "value": 3}]}
FEATURE = {"feature": "f", "aggregation": "sum", "dimensions": ["m"], "max_combinations": 9}
VOIDED = {"voided": 3, "value": 9}
CLOSE = {"final": False, "open_nodes": [{"node": "n2", "opened_at": 1.0, "lease_ends": None}],
         "closed_by_operator": [], "nodes": 2, "closes_at": 9.0, "read_at": 5.0}  # fmt: skip
CLOSED = {"period": "2026-11", "node": "n3", "state": "closed", "by": "operator", "at": 1.0}
SAMPLES: list[tuple[str, tuple[Any, ...], dict[str, Any], Any, tuple[Any, ...], Any]] = [
    ("track", ("a", "f"), {}, 4, ("track", ["a", "f", 1], False), 4),
    ("track", ("a", "f", 2), {"id": "r1", "at": 5, "x": None}, None,
     ("track", ["a", "f", 2, {"at": 5, "id": "r1"}], True), None),
    ("track_detail", ("a", "f", 5), {"id": "r1", "at": 7}, DETAIL,
     ("track", ["a", "f", 5, {"at": 7, "detail": True, "id": "r1"}], True), DETAIL),
    ("track_detail", ("a", "f"), {}, DETAIL, ("track", ["a", "f", 1, {"detail": True}], False),
     DETAIL),
    ("track_many", ([("a", "f", 1, "r1"), ("a", "g", 2)],), {}, [1, Conflict("m").to_wire()],
     ("track_many", [[["a", "f", 1, {"id": "r1"}], ["a", "g", 2]]], False), [1, Conflict("m")]),
    ("track_many", ([("a", "f", 1, "r1")],), {}, [None],
     ("track_many", [[["a", "f", 1, {"id": "r1"}]]], True), [None]),
    ("reserve", ("a", "f", 3), {}, "res", ("reserve", ["a", "f", 3], False), "res"),
    ("reserve", ("a", "f", 3, 10, 500), {"at": 1.5, "id": "r1"}, "res",
     ("reserve", ["a", "f", 3, {"limit": 10, "ttl_ms": 500, "at": 1.5, "id": "r1"}], True),
     "res"),
    ("commit", ("res",), {}, 9, ("commit", ["res"], True), 9),
    ("commit", ("res", 2), {"id": "r1"}, 9, ("commit", ["res", 2, {"id": "r1"}], True), 9),
    ("release", ("res",), {}, None, ("release", ["res"], True), None),
    ("release", ("res",), {"id": "r1"}, None, ("release", ["res", {"id": "r1"}], True), None),
    ("void", ("c1",), {}, VOIDED, ("void", ["c1"], True), VOIDED),
    ("export_state", ("2026-11",), {}, {"rows": [], "cursor": "c", **CLOSE},
     ("export", ["2026-11", {"limit": 1}], True), CLOSE),
    ("close_period", ("2026-11", "n3"), {}, CLOSED, ("close_period", ["2026-11", "n3"], True),
     CLOSED),
    ("void", ("c1",), {"id": "v1"}, VOIDED, ("void", ["c1", {"id": "v1"}], True), VOIDED),
    ("usage", ("a", "f"), {"at": 5}, 7, ("usage", ["a", "f", {"at": 5}], True), 7),
    ("usage_all", ("a",), {}, {"f": 1}, ("usage_all", ["a"], True), {"f": 1}),
    ("usage_children_page", ("a", "f"), {"limit": 2}, {"total": 1},
     ("usage_children", ["a", "f", {"limit": 2}], True), {"total": 1}),
    ("usage_children_page", ("a", "f", 5.0, "a/b"), {}, {"total": 1},
     ("usage_children", ["a", "f", {"at": 5.0, "cursor": "a/b"}], True), {"total": 1}),
    ("usage_by", ("a", "f", ["m"]), {"at": 5}, GROUPS,
     ("usage", ["a", "f", {"at": 5, "group_by": ["m"]}], True), GROUPS),
    ("usage", ("a", "f"), {"where": {"m": "x"}}, 2,
     ("usage", ["a", "f", {"where": {"m": "x"}}], True), 2),
    ("track", ("a", "f", 2), {"dims": {"m": "x"}}, 5,
     ("track", ["a", "f", 2, {"dims": {"m": "x"}}], False), 5),
    ("track_many", ([("a", "f", 1, {"id": "r1", "dims": {"m": "x"}}), ("a", "f", 2, {})],), {},
     [1, 3], ("track_many", [[["a", "f", 1, {"dims": {"m": "x"}, "id": "r1"}],
                              ["a", "f", 2]]], False), [1, 3]),
    ("history", ("a", "f", "2026-01-01"), {}, [["2026-01-01", "3"]],
     ("history", ["a", "f", {"from": "2026-01-01", "granularity": "day"}], True),
     [("2026-01-01", 3)]),
    ("history", ("a", "f"), {"where": {"m": "x"}}, [["2026-01-01", "3"]],
     ("history", ["a", "f", {"granularity": "day", "where": {"m": "x"}}], True),
     [("2026-01-01", 3)]),
    ("ping", (), {}, "pong", ("ping", [], True), "pong"),
    ("status", (), {}, {"node_id": "n"}, ("status", [], True), {"node_id": "n"}),
    ("unsubscribe", ("a",), {}, True, ("unsubscribe", ["a"], True), True),
    ("unsubscribe_alerts", (), {}, False, ("unsubscribe_alerts", [], True), False),
    ("export_page", ("2020-01",), {"limit": 7}, WIRE_ROWS,
     ("export", ["2020-01", {"limit": 7}], True),
     ([StoredRow("t0", "old", "2020-01", 9), StoredRow("t0", "old", "2020-01", 4, {"m": "x"})],
      None)),
    ("check", ("a", "f"), {}, DETAIL, ("check", ["a", "f", 1], True), DETAIL),
    ("set_plan", ("free", {"f": {"limit": 1}}), {}, VERSION,
     ("set_plan", ["free", {"f": {"limit": 1}}], True), 3),
    ("assign_plan", ("a", None), {}, VERSION, ("assign_plan", ["a", None], True), 3),
    ("set_limit", ("a", "f", 10), {"alerts": [80]}, VERSION,
     ("set_limit", ["a", "f", {"limit": 10, "kind": "hard", "enforcement": "fast",
                               "alerts": [80]}], True), 3),
    ("set_limit", ("a", "f", 10), {"where": {"m": "x"}}, VERSION,
     ("set_limit", ["a", "f", {"limit": 10, "kind": "hard", "enforcement": "fast",
                               "where": {"m": "x"}}], True), 3),
    ("clear_limit", ("a", "f"), {}, VERSION, ("clear_limit", ["a", "f"], True), 3),
    ("clear_limit", ("a", "f"), {"where": {"m": "x"}}, VERSION,
     ("clear_limit", ["a", "f", {"where": {"m": "x"}}], True), 3),
    ("set_feature", ("f",), {"dimensions": ["m"]}, FEATURE,
     ("set_feature", ["f", {"dimensions": ["m"]}], True), FEATURE),
    ("set_feature", ("f",), {"aggregation": "sum", "max_combinations": 9}, FEATURE,
     ("set_feature", ["f", {"aggregation": "sum", "max_combinations": 9}], True), FEATURE),
    ("get_feature", ("f",), {}, FEATURE, ("get_feature", ["f"], True), FEATURE),
    ("limits", ("a",), {}, {"plan": None}, ("limits", ["a"], True), {"plan": None}),
    ("grant", ("a", 5), {"ref": "g1", "priority": 2}, ENTRY,
     ("grant", ["a", 5, {"ref": "g1", "priority": 2}], True), ENTRY),
    ("debit", ("a", 5), {"ref": "d1"}, ENTRY, ("debit", ["a", 5, {"ref": "d1"}], True), ENTRY),
    ("balance", ("a",), {}, {"available": 5}, ("balance", ["a"], True), {"available": 5}),
    ("ledger_page", ("a",), {"after": 3}, {"entries": []}, ("ledger", ["a", {"after": 3}], True),
     {"entries": []}),
    ("ledger_timeline_page", (5.0,), {"cursor": "c", "limit": 2}, {"entries": []},
     ("ledger_timeline", [{"from": 5.0, "cursor": "c", "limit": 2}], True), {"entries": []}),
    ("ledger_timeline_page", (), {}, {"entries": []}, ("ledger_timeline", [], True),
     {"entries": []}),
]  # fmt: skip
#: Rows whose method keeps state of its own around the call (tested with a node elsewhere:
#: tests/test_subscribe.py, tests/test_alerts.py), and the wire form of one call of each.
STATEFUL: dict[str, tuple[calls.Method[Any, Any], tuple[Any, ...], tuple[Any, ...]]] = {
    "subscribe": (calls.SUBSCRIBE, ("a", ["f"]), ("subscribe", ["a", ["f"]], True)),
    "subscribe_alerts": (calls.SUBSCRIBE_ALERTS, (), ("subscribe_alerts", [], True)),
}


@pytest.fixture
def sock() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    yield sock
    sock.close()


def _comparable(value: Any) -> Any:
    """``value`` with its exceptions as (type, message): they compare by identity."""
    if isinstance(value, Exception):
        return type(value), str(value)
    if isinstance(value, list | tuple):
        return type(value)(map(_comparable, value))
    return value


@pytest.mark.parametrize(("name", "args", "kwargs", "answer", "sent", "returned"), SAMPLES)
async def test_both_clients_send_the_same_call_and_return_the_same_answer(
    sock: socket.socket,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    answer: Any,
    sent: tuple[Any, ...],
    returned: Any,
) -> None:
    blocking = _RecordingClient(sock, answer, auto_ids=False)
    aio = _RecordingAsyncClient(answer, auto_ids=False)
    got = getattr(blocking, name)(*args, **kwargs)
    got_async = await getattr(aio, name)(*args, **kwargs)
    assert blocking.sent == aio.sent == [sent]
    assert _comparable(got) == _comparable(got_async) == _comparable(returned)


def test_every_row_of_the_table_has_a_sample() -> None:
    sampled = {name for name, *_ in SAMPLES} | set(STATEFUL)
    assert sampled == set(calls.TABLE)
    for row, args, sent in STATEFUL.values():
        call = row.prepare(False, *args)
        assert (call.method, call.params, call.resend) == sent


def test_automatic_ids_are_fresh_per_call_and_make_counts_safe_to_send_again(
    sock: socket.socket,
) -> None:
    blocking = _RecordingClient(sock, 1)
    blocking.track("a", "f")
    blocking.commit("res")
    blocking.answer = [1, 1]
    blocking.track_many([("a", "f", 1), ("a", "g", 1)])
    (_, track, resend), (_, commit, _), (_, many, many_resend) = blocking.sent
    ids = [track[3]["id"], many[0][0][3]["id"], many[0][1][3]["id"], commit[2]["id"]]
    assert resend and many_resend and len(set(ids)) == 4
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{22}", rid) for rid in ids)


# -- the package -------------------------------------------------------------------------------


def test_the_client_imports_only_the_codec_errors_and_the_standard_library() -> None:
    """And ``storage.base``, for the one value it answers with (``ExportRow``): a value type,
    no storage code runs in a client."""
    allowed = re.compile(r"meter\.errors|meter\.core(\..+)?|meter\.client(\..+)?|storage\.base")
    found: dict[str, set[str]] = {}
    for path in sorted(CLIENT_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] not in sys.stdlib_module_names | {"__future__"}:
                    found.setdefault(name, set()).add(path.name)
    assert {n: f for n, f in found.items() if not allowed.fullmatch(n)} == {}
    assert "meter.core.protocol" in found  # (the check sees the imports)
