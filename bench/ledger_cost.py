"""Scenario ``ledger``: credits ledger debits through a node against the bare writes.

Ours: ``debit`` calls through a node on DynamoDB Local (``LANES`` lanes, each its own
connection and its own tenant, one call in flight per lane; every debit carries a ref and is
answered only after its ``TransactWriteItems`` landed). Reference: a bare loop in this
process, straight to the same DynamoDB Local with the same concurrency, of the same
conditional write per debit - one ``TransactWriteItems`` of the balance item (on the
condition of its version), the ref item and the entry item (each on the condition that it
does not exist), the version kept in the loop. Target: ours at least 0.9x the bare loop.
Sides alternate which goes first, round by round.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from bench.harness import (
    ALTERNATING,
    Progress,
    Row,
    Services,
    Sizes,
    create_table,
    in_turn,
    median,
    ratios,
)

#: (Not numbered: the chart takes scenarios starting with "1" for scenario 1.)
LEDGER = "ledger debits (DynamoDB Local)"
#: Calls in flight at once, on each side.
LANES = 8
#: The balance each tenant starts with: never runs out during a run.
START = 10**15
TARGET = 0.9


async def _node_side(socket: str, tag: str, seconds: float) -> tuple[float, int, int]:
    from meter.client import AsyncClient

    clients = [await AsyncClient.connect(socket, retry_timeout=0) for _ in range(LANES)]
    try:
        for i, c in enumerate(clients):
            await c.grant(f"{tag}-{i}", START, ref=f"{tag}-{i}-start")
        done = errors = 0
        deadline = time.monotonic() + seconds
        t0 = time.monotonic()

        async def lane(i: int) -> None:
            nonlocal done, errors
            n = 0
            while time.monotonic() < deadline:
                n += 1
                try:
                    await clients[i].debit(f"{tag}-{i}", 1, ref=f"{tag}-{i}-{n}")
                    done += 1
                except Exception:
                    errors += 1

        await asyncio.gather(*(lane(i) for i in range(LANES)))
        elapsed = time.monotonic() - t0
    finally:
        for c in clients:
            await c.close()
    return done / elapsed, done, errors


async def _bare_side(endpoint: str, table: str, tag: str, seconds: float) -> tuple[float, int, int]:
    import aioboto3

    session = aioboto3.Session(
        aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1"
    )
    done = errors = 0
    async with session.client("dynamodb", endpoint_url=endpoint) as client:
        deadline = time.monotonic() + seconds
        t0 = time.monotonic()

        async def lane(i: int) -> None:
            nonlocal done, errors
            tenant = f"{tag}-{i}"
            version, seq, balance = 0, 0, START
            while time.monotonic() < deadline:
                seq += 1
                balance -= 1
                body = json.dumps({"s": seq, "b": balance, "g": [[1, balance, 0, None]]})
                entry = json.dumps({"s": seq, "t": time.time(), "k": "debit", "a": -1})
                cond: dict[str, Any] = (
                    {"ConditionExpression": "attribute_not_exists(v)"}
                    if version == 0
                    else {
                        "ConditionExpression": "v = :v",
                        "ExpressionAttributeValues": {":v": {"N": str(version)}},
                    }
                )
                items = [
                    {
                        "Put": {
                            "TableName": table,
                            "Item": {
                                "pk": {"S": tenant},
                                "sk": {"S": "#l#bal"},
                                "v": {"N": str(version + 1)},
                                "b": {"S": body},
                            },
                            **cond,
                        }
                    },
                    *(
                        {
                            "Put": {
                                "TableName": table,
                                "Item": {"pk": {"S": tenant}, "sk": {"S": sk}, "b": {"S": b}},
                                "ConditionExpression": "attribute_not_exists(pk)",
                            }
                        }
                        for sk, b in ((f"#l#r#{tenant}-{seq}", entry), (f"#l#e#{seq:020d}", entry))
                    ),
                ]
                try:
                    await client.transact_write_items(TransactItems=items)
                    version += 1
                    done += 1
                except Exception:
                    errors += 1
                    seq -= 1
                    balance += 1

        await asyncio.gather(*(lane(i) for i in range(LANES)))
        elapsed = time.monotonic() - t0
    return done / elapsed, done, errors


def ledger(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    progress("starting DynamoDB Local")
    endpoint = svc.dynamodb()
    table = f"meter_bench_{uuid.uuid4().hex[:8]}"
    asyncio.run(create_table(endpoint, table))
    node = svc.node(
        "ledger",
        METER_STORAGE="dynamodb",
        METER_DYNAMODB_ENDPOINT=endpoint,
        METER_DYNAMODB_TABLE=table,
    )
    seconds = sizes.ddb_seconds
    ours: list[float] = []
    ref: list[float] = []
    errors = ref_errors = 0
    counter = iter(range(10**6))

    def node_side() -> None:
        nonlocal errors
        rate, _, e = asyncio.run(_node_side(str(node.socket), f"n{next(counter)}", seconds))
        ours.append(rate)
        errors += e

    def bare_side() -> None:
        nonlocal ref_errors
        rate, _, e = asyncio.run(_bare_side(endpoint, table, f"b{next(counter)}", seconds))
        ref.append(rate)
        ref_errors += e

    progress("warming up DynamoDB Local and the node (not measured)")
    asyncio.run(_bare_side(endpoint, table, "warm-b", min(1.0, seconds)))
    asyncio.run(_node_side(str(node.socket), "warm-n", min(1.0, seconds)))
    rounds = max(sizes.rounds, sizes.ddb_rounds)
    for r in range(rounds):
        progress(f"ledger debits: node vs bare TransactWriteItems, round {r + 1}/{rounds}")
        in_turn(r, node_side, bare_side)
    svc.stop_node(node)
    ratio = ratios(ours, ref)
    return [
        Row(
            LEDGER,
            f"debits/s: node vs bare TransactWriteItems loop, {LANES} in flight",
            "ops/s",
            median(ours),
            median(ref),
            ratio,
            f">= {TARGET}x",
            ratio >= TARGET and errors == 0 and ref_errors == 0,
            {
                "lanes": LANES,
                "tenants": LANES,
                "errors": errors,
                "bare_errors": ref_errors,
                "rounds_ours": ours,
                "rounds_bare": ref,
                "seconds_per_side": seconds,
                "order": ALTERNATING,
            },
        )
    ]
