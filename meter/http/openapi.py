"""The OpenAPI 3.1 document of the HTTP/JSON API, written from :data:`SIGNATURES` (the table
the API dispatches on); served at ``/openapi.json`` and kept in docs/openapi.json
(``python -m meter.http.openapi`` writes it). Pure: no I/O."""

from __future__ import annotations

import json
import sys
from typing import Any

from meter import __version__
from meter.http.signatures import SIGNATURES, STATUS, Param, Schema, Signature

_ERROR: Schema = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "enum": sorted(STATUS)},
                "message": {"type": "string"},
            },
            "required": ["code", "message"],
        }
    },
    "required": ["error"],
}
_RESULT: Schema = {
    "type": "object",
    "properties": {"result": {"description": "the method's answer (docs/protocol.md)"}},
    "required": ["result"],
}


def _property(p: Param) -> Schema:
    return {**p.schema, "description": p.doc} if p.doc else dict(p.schema)


def _operation(sig: Signature) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": "object",
        "properties": {p.name: _property(p) for p in (*sig.params, *(sig.fields or ()))},
        "additionalProperties": False,
    }
    required = [p.name for p in sig.params if p.required]
    if required:
        body["required"] = required
    op: dict[str, Any] = {
        "operationId": sig.method,
        "summary": sig.summary,
        "requestBody": {
            "required": bool(required),
            "content": {"application/json": {"schema": body}},
        },
        "responses": {
            "200": {
                "description": "the answer",
                "content": {"application/json": {"schema": _RESULT}},
            },
            **{
                str(status): {
                    "description": ", ".join(c for c, s in STATUS.items() if s == status),
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
                    },
                }
                for status in sorted(set(STATUS.values()))
            },
        },
    }
    if sig.key is not None:
        op["parameters"] = [
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "schema": {"type": "string"},
                "description": f"the call's {sig.key}: a retry with the same key counts once",
            }
        ]
    return op


def document() -> dict[str, Any]:
    """The API's OpenAPI 3.1 document."""
    paths: dict[str, Any] = {
        f"/v1/{sig.method}": {"post": _operation(sig)} for sig in SIGNATURES.values()
    }
    paths["/v1/subscribe"] = {
        "get": {
            "operationId": "subscribe",
            "summary": "Live usage and threshold alerts as Server-Sent Events.",
            "parameters": [
                {
                    "name": "tenant",
                    "in": "query",
                    "schema": {"type": "array", "items": {"type": "string"}},
                    "style": "form",
                    "explode": True,
                    "description": "a tenant to watch (repeat for more)",
                },
                {
                    "name": "features",
                    "in": "query",
                    "schema": {"type": "string"},
                    "description": "comma-separated features to watch (default all)",
                },
                {
                    "name": "alerts",
                    "in": "query",
                    "schema": {"type": "boolean"},
                    "description": "also stream threshold and balance alerts",
                },
            ],
            "responses": {
                "200": {
                    "description": "events: usage (one counter's value), alert",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}},
                },
                "400": {
                    "description": "invalid_argument",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
                    },
                },
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "meter",
            "version": __version__,
            "description": "The meter node's HTTP/JSON API: every wire method as POST "
            "/v1/<method> with its params by name (docs/http.md, docs/protocol.md).",
        },
        "paths": paths,
        # A token only on ``http_address`` with ``http_token`` set (docs/http.md).
        "security": [{}, {"bearer": []}],
        "components": {
            "schemas": {"Error": _ERROR},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def main() -> None:
    """Print the document (``python -m meter.http.openapi > docs/openapi.json``)."""
    json.dump(document(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
