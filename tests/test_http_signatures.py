"""The HTTP API's method table (meter/http/signatures.py) against the server it fronts, and the
OpenAPI document written from it: every method the node dispatches is in the table (or is a
stream), each method's positional params take as many params as the node's handler does, each
trailing map names exactly the options the handler allows; the document is valid OpenAPI 3.1,
is what docs/openapi.json holds, and names every param of the table. Big integers, unknown and
missing names."""

from __future__ import annotations

import json
import re
from inspect import isawaitable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from openapi_spec_validator import validate

from meter.core.table import CounterTable
from meter.errors import InvalidArgument
from meter.http.api import read_json
from meter.http.openapi import document
from meter.http.signatures import (
    INT,
    SIGNATURES,
    STREAMED,
    TRACK_ITEM,
    coerce,
    to_json,
    wire_params,
)
from meter.node.wiring import build_service
from storage.memory import MemoryStorage

ROOT = Path(__file__).resolve().parents[1]

#: A value for each required positional param that passes the node's own checks, so that a
#: call gets as far as its arity and option checks.
VALID: dict[str, Any] = {
    "tenant": "t",
    "account": "t",
    "feature": "f",
    "qty": 1,
    "reservation_id": "r",
    "call_id": "c",
    "period": "2026-12",
    "name": "p",
    "features": {},
    "plan": None,
    "node": "n",
    "amount": 1,
    "items": [],
}


async def _error(method: str, params: list[Any]) -> str:
    """The node's refusal of ``params`` (a real service over memory storage)."""
    svc = build_service(CounterTable("n1"), MemoryStorage())
    with pytest.raises(InvalidArgument) as exc:
        result = svc.dispatch(method, params)
        if isawaitable(result):
            await result
    return str(exc.value)


def test_the_table_names_every_method_the_node_dispatches() -> None:
    svc = build_service(CounterTable("n1"), MemoryStorage())
    assert set(SIGNATURES) | STREAMED == set(svc.methods)
    assert not set(SIGNATURES) & STREAMED


@pytest.mark.parametrize("method", sorted(SIGNATURES))
async def test_each_method_takes_as_many_params_as_the_node(method: str) -> None:
    sig = SIGNATURES[method]
    least = sum(p.required for p in sig.params) + sig.map_required
    most = len(sig.params) + (sig.fields is not None)
    message = await _error(method, [None] * (most + 1))
    want = str(least) if least == most else f"{least} to {most}"
    assert f"takes {want} params, got {most + 1}" in message


@pytest.mark.parametrize("method", sorted(m for m, s in SIGNATURES.items() if s.fields is not None))
async def test_each_trailing_map_names_the_options_the_node_allows(method: str) -> None:
    sig = SIGNATURES[method]
    assert sig.fields is not None
    params = [VALID[p.name] if p.required else p.default for p in sig.params]
    message = await _error(method, [*params, {"zz_unknown": 1}])
    allowed = re.search(r"\(allowed: ([^)]*)\)", message)
    assert allowed is not None, message
    names = {f.name for f in sig.fields}
    if method == "set_limit":  # ``where`` is read before the limit spec's fields
        names.discard("where")
    assert set(allowed.group(1).split(", ")) == names


def test_the_document_is_valid_openapi_and_names_every_param() -> None:
    doc = document()
    validate(doc)
    for method, sig in SIGNATURES.items():
        op = doc["paths"][f"/v1/{method}"]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert list(schema["properties"]) == list(sig.names)
        assert schema.get("required", []) == [p.name for p in sig.params if p.required]
        assert ("parameters" in op) == (sig.key is not None)
    assert "/v1/subscribe" in doc["paths"]


def test_docs_openapi_json_is_the_document() -> None:
    """Regenerate with ``python -m meter.http.openapi > docs/openapi.json``."""
    on_disk = json.loads((ROOT / "docs" / "openapi.json").read_text())
    assert on_disk == json.loads(json.dumps(document()))


def test_named_params_become_the_wire_params() -> None:
    track = SIGNATURES["track"]
    assert wire_params(track, {"tenant": "a", "feature": "f"}) == ["a", "f", 1]
    assert wire_params(SIGNATURES["set_limit"], {"tenant": "a", "feature": "f"}) == ["a", "f", {}]
    assert wire_params(track, {"tenant": "a", "feature": "f", "at": 5}, "k") == [
        "a",
        "f",
        1,
        {"at": 5, "id": "k"},
    ]
    commit = SIGNATURES["commit"]
    assert wire_params(commit, {"reservation_id": "r", "id": "i"}) == ["r", None, {"id": "i"}]
    assert wire_params(SIGNATURES["ping"], {}) == []
    assert wire_params(SIGNATURES["grant"], {"tenant": "a", "amount": "5"}, "g") == [
        "a",
        5,
        {"ref": "g"},
    ]
    for body, key, why in [
        ([], None, "must be a JSON object"),
        ({"tenant": "a"}, None, "feature is missing"),
        ({"tenant": "a", "feature": "f", "x": 1}, None, "unknown param 'x'"),
        ({"tenant": "a", "feature": "f", "id": "j"}, "k", "Idempotency-Key and id differ"),
    ]:
        with pytest.raises(InvalidArgument, match=why):
            wire_params(track, body, key)
    with pytest.raises(InvalidArgument, match="takes no Idempotency-Key"):
        wire_params(SIGNATURES["usage"], {"tenant": "a", "feature": "f"}, "k")


def test_integers_past_2_53_are_strings_both_ways() -> None:
    big = 2**63 - 1
    assert coerce(INT, str(big)) == big
    assert coerce(INT, "-12") == -12
    assert coerce(INT, "12a") == "12a"  # the node refuses it, naming the param
    assert coerce(INT, "1" * 21) == "1" * 21
    assert coerce(TRACK_ITEM, ["a", "f", "9007199254740993", {"id": "7"}]) == [
        "a",
        "f",
        9007199254740993,
        {"id": "7"},
    ]
    plan = SIGNATURES["set_plan"].params[1].schema
    assert coerce(plan, {"api": {"limit": "100", "kind": "hard"}}) == {
        "api": {"limit": 100, "kind": "hard"}
    }
    assert to_json({"a": [2**53, 2**53 - 1, -(2**53)], "b": (1, None)}) == {
        "a": [str(2**53), 2**53 - 1, str(-(2**53))],
        "b": [1, None],
    }
    for bad in (float("nan"), {1: 2}, object()):
        with pytest.raises(ValueError):
            to_json(bad)


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(_JSON_VALUES)
def test_a_body_reads_as_the_standard_decoder_reads_it(value: Any) -> None:
    """orjson where it is exact, the standard decoder else: the same value (integers past
    64 bits exact), and the same refusals."""
    for raw in (json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode()):
        assert read_json(raw) == json.loads(raw) == value


@pytest.mark.parametrize(
    "raw",
    [b"", b"  ", b'{"a": NaN}', b'{"a": 1e400}', b'"\\ud800"', b'{"a": 18446744073709551616}',
     b'{"a": -9223372036854775809}', b'[1,', b"\xff", b'{"a":1,"a":2}', b"[" * 2000],
)  # fmt: skip
def test_odd_bodies_read_or_fail_as_the_standard_decoder(raw: bytes) -> None:
    try:
        text = raw.decode()
        want: Any = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        with pytest.raises(ValueError):  # (too deep too: a 400, not an internal error)
            read_json(raw)
        return
    got = read_json(raw)
    assert got == want or (got != got and want != want)  # (NaN)
