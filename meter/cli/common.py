"""What the command groups share: the node flags, the ``--json`` client parsers, printing."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Coroutine
from typing import Any

# Flags shared by every subcommand that reads the configuration: dest is the setting name.
NODE_FLAGS: list[tuple[str, str]] = [
    ("--data-dir", "data directory (METER_DATA_DIR, default ./.meter)"),
    ("--storage", "sqlite (default), memory or dynamodb (METER_STORAGE)"),
    ("--node-id", "stable node id (METER_NODE_ID; default generated once, kept in data dir)"),
    ("--flush-interval-ms", "flush period (METER_FLUSH_INTERVAL_MS, default 1000)"),
    ("--gossip-interval-ms", "gossip period (METER_GOSSIP_INTERVAL_MS, default 100)"),
    ("--redis-url", "Redis for gossip (METER_REDIS_URL; unset: run alone)"),
    ("--dynamodb-table", "DynamoDB table (METER_DYNAMODB_TABLE, default meter_counters)"),
    ("--dynamodb-endpoint", "DynamoDB endpoint URL (METER_DYNAMODB_ENDPOINT)"),
    ("--socket-group", "make the socket 0660 for this group (METER_SOCKET_GROUP)"),
    ("--log-level", "DEBUG, INFO, WARNING or ERROR (METER_LOG_LEVEL, default INFO)"),
    (
        "--metrics-address",
        "host:port for /metrics, /healthz, /readyz over HTTP (METER_METRICS_ADDRESS; "
        "port 0: any free port; unset: no listener)",
    ),
    ("--http-socket", "the HTTP/JSON API's Unix socket (METER_HTTP_SOCKET; unset: none)"),
    (
        "--http-address",
        "host:port for the HTTP/JSON API (METER_HTTP_ADDRESS; a non-loopback host needs "
        "METER_HTTP_TOKEN)",
    ),
]

#: What a counting answer says when the node counted but could not tell the total.
NOT_KNOWN = "counted (total not known yet: storage unreachable)"

#: Adds ``--config`` and ``--socket`` to a parser.
Common = Callable[[argparse.ArgumentParser], None]


def client_parser(parent: Any, name: str, text: str, common: Common) -> argparse.ArgumentParser:
    """A subcommand that talks to a node: ``--config``, ``--socket`` and ``--json``."""
    sp: argparse.ArgumentParser = parent.add_parser(name, help=text)
    common(sp)
    sp.add_argument("--json", action="store_true", help="print JSON, for scripts")
    return sp


def out(as_json: bool, text: str, **fields: Any) -> None:
    """Print ``text`` for people, or ``fields`` as one JSON object for scripts."""
    print(json.dumps(fields, sort_keys=True) if as_json else text)


def run_async(coro: Coroutine[Any, Any, int]) -> int:
    """Run ``coro`` on uvloop; its exit code."""
    import uvloop

    code: int = uvloop.run(coro)
    return code
