"""Strict calls near the limit: meter against the seeds' design, in one run (issue 23, item 8).

A burst of 3 nodes x ``clients`` client threads, each tracking 1 unit at a time until it is
refused, to a small strict limit: flat (``limit`` on one counter) and hierarchical (an account
``limit`` with two users at 60 % of it each, half the clients on each user). Every call's
latency is taken from its send to its final answer (an ``unavailable`` answer is retried by
the client and counts in the same call), refusals included: near the limit the refusal is
the answer most calls get.

The reference is the seeds' design on the same DynamoDB Local: every call one conditional
``UpdateItem`` on the counter item (``ADD v :q`` if ``v <= limit - q``), or for the hierarchy
one ``TransactWriteItems`` of the account's and the user's conditional updates (seed 000's
``ddb_hierarchical_atomic_counter.js``), a cancelled transaction with no failed condition
retried. Its clients run as 3 processes of ``clients`` threads (one per node), so neither
side's clients share one interpreter's lock with the other's.

Both sides run ``rounds`` times in turn (alternating which goes first), each round on fresh
counters, after an unmeasured warm-up (a burst of the same shape on other counters for the
nodes; one read per client of the seeds' design, which opens its connection); p99 and max
are over every call of every round. Each round must admit exactly the limit on both sides.

``python -m bench.strict_latency`` prints these rows alone; ``python -m bench --only quotas``
runs them beside the other rows of scenario 10.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from bench.harness import Progress, Row, Services, in_turn, percentile
from bench.scale import cluster_env, start_cluster
from tests.support.cluster_harness import Conn
from tests.support.nodes import NodeProcess

SCENARIO = "10 quotas (DynamoDB Local, 1 or 3 nodes)"
#: Meter's strict calls near the limit at most this many times the seeds' design's.
TARGET = 1.0
#: A user's limit, as a share of its account's (issue 23: account 100, users 60).
USER_SHARE = 0.6
USERS = ("alice", "bob")
#: Retries of one call (``unavailable``, a transaction conflict) before the bench gives up.
MAX_RETRIES = 1000


def _meter_client(
    node: NodeProcess, tenant: str, feature: str, go: threading.Event, out: list[Any]
) -> None:
    conn = Conn(node.socket, timeout=30)
    lat: list[float] = []
    admitted = retries = 0
    try:
        go.wait()
        while True:
            t0 = time.perf_counter()
            for _ in range(MAX_RETRIES):
                error, _ = conn.call("track", tenant, feature, 1)
                if error is None or error["code"] != "unavailable":
                    break
                retries += 1
            lat.append(time.perf_counter() - t0)
            if error is None:
                admitted += 1
            elif error["code"] == "limit_exceeded":
                break
            else:
                raise RuntimeError(f"unexpected error {error}")
    finally:
        conn.close()
        out.append((lat, admitted, retries))


def _meter_burst(
    nodes: list[NodeProcess], tenants: list[str], feature: str, clients: int
) -> dict[str, Any]:
    """``clients`` threads per node, client ``j`` of a node on ``tenants[j % len]``."""
    go = threading.Event()
    out: list[Any] = []
    threads = [
        threading.Thread(
            target=_meter_client, args=(p, tenants[j % len(tenants)], feature, go, out)
        )
        for p in nodes
        for j in range(clients)
    ]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(300)
    return _summary(out)


def _summary(out: list[Any]) -> dict[str, Any]:
    lat = [x for got in out for x in got[0]]
    return {
        "latencies": lat,
        "admitted": sum(got[1] for got in out),
        "retries": sum(got[2] for got in out),
        "calls": len(lat),
    }


def _seed_client(
    endpoint: str, table: str, items: list[tuple[str, int]], go: Any, out: Any
) -> None:
    """One client of the seeds' design: ``items`` = the ``(pk, limit)`` the call updates."""
    import boto3  # type: ignore[import-untyped]  # (in the worker process only)
    from botocore.config import Config

    client = boto3.session.Session().client(
        "dynamodb",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        config=Config(retries={"max_attempts": 1, "mode": "standard"}),
    )
    errors = client.exceptions
    lat: list[float] = []
    admitted = retries = 0
    # (unmeasured: the client's connection opened before the burst, as a running app's is)
    client.get_item(TableName=table, Key={"pk": {"S": items[0][0]}, "sk": {"S": "seed"}})

    def update(pk: str, limit: int) -> dict[str, Any]:
        return {
            "TableName": table,
            "Key": {"pk": {"S": pk}, "sk": {"S": "seed"}},
            "UpdateExpression": "ADD v :q",
            "ConditionExpression": "attribute_not_exists(v) OR v <= :room",
            "ExpressionAttributeValues": {":q": {"N": "1"}, ":room": {"N": str(limit - 1)}},
        }

    go.wait()
    while True:
        t0 = time.perf_counter()
        refused = False
        for _ in range(MAX_RETRIES):
            try:
                if len(items) == 1:
                    client.update_item(**update(*items[0]))
                else:
                    client.transact_write_items(
                        TransactItems=[{"Update": update(pk, lim)} for pk, lim in items]
                    )
                break
            except errors.ConditionalCheckFailedException:
                refused = True
                break
            except errors.TransactionCanceledException as exc:
                reasons = exc.response.get("CancellationReasons", [])
                if any(r.get("Code") == "ConditionalCheckFailed" for r in reasons):
                    refused = True
                    break
                retries += 1  # a conflict with another transaction: the seeds retry
            except (errors.TransactionConflictException, errors.InternalServerError):
                retries += 1
        lat.append(time.perf_counter() - t0)
        if refused:
            break
        admitted += 1
    out.put((lat, admitted, retries))


def _seed_process(
    endpoint: str, table: str, calls: list[list[tuple[str, int]]], go: Any, out: Any
) -> None:
    with ThreadPoolExecutor(len(calls)) as pool:
        for items in calls:
            pool.submit(_seed_client, endpoint, table, items, go, out)


def _seed_burst(
    endpoint: str, table: str, per_client: list[list[tuple[str, int]]], n_procs: int
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_seed_process, args=(endpoint, table, per_client, go, out))
        for _ in range(n_procs)
    ]
    for p in procs:
        p.start()
    time.sleep(3.0)  # (spawned interpreters importing boto3: not part of any call)
    go.set()
    got = [out.get(timeout=300) for _ in range(n_procs * len(per_client))]
    for p in procs:
        p.join(30)
    return _summary(got)


def _row(what: str, stat: str, ours: dict[str, Any], ref: dict[str, Any], rounds: int) -> Row:
    q = 100.0 if stat == "max" else 99.0
    o = percentile(ours["latencies"], q) * 1000
    r = percentile(ref["latencies"], q) * 1000
    ratio = o / r if r else None
    return Row(
        SCENARIO,
        f"strict call latency near the limit, {stat}, {what} vs the seeds' design",
        "ms",
        round(o, 2),
        round(r, 2),
        ratio,
        f"<= {TARGET}x",
        ratio is not None and ratio <= TARGET,
        {
            "rounds": rounds,
            "ours": {k: v for k, v in ours.items() if k != "latencies"},
            "seeds": {k: v for k, v in ref.items() if k != "latencies"},
            "ours_p50_ms": round(percentile(ours["latencies"], 50) * 1000, 2),
            "seeds_p50_ms": round(percentile(ref["latencies"], 50) * 1000, 2),
        },
    )


def near_limit(
    svc: Services, flat: int, account: int, clients: int, rounds: int, progress: Progress
) -> list[Row]:
    """The flat (limit ``flat``) and the hierarchical (account ``account``) rows, p99 and
    max each."""
    rows: list[Row] = []
    for hier in (False, True):
        rows += _shape(svc, hier, account if hier else flat, clients, rounds, progress)
    return rows


def _shape(
    svc: Services, hier: bool, limit: int, clients: int, rounds: int, progress: Progress
) -> list[Row]:
    user_limit = int(limit * USER_SHARE)
    what = (
        f"hierarchical (account {limit}, users {user_limit})" if hier else f"flat (limit {limit})"
    )
    shape = f"3 nodes x {clients} clients, {what}"
    progress(f"quotas: strict burst latency near the limit, {shape}")
    _, env, _ = cluster_env(svc, "near" + ("h" if hier else "f"))
    if hier:
        env["METER_TENANT_HIERARCHY"] = "true"
    nodes = start_cluster(svc, [f"n{i}" for i in range(3)], env)
    table = env["METER_DYNAMODB_TABLE"]
    ours: dict[str, Any] = {"latencies": [], "admitted": [], "retries": 0, "calls": 0}
    ref: dict[str, Any] = {"latencies": [], "admitted": [], "retries": 0, "calls": 0}

    def counters() -> tuple[str, list[str]]:
        acct = f"near-{uuid.uuid4().hex[:6]}"
        return acct, [f"{acct}/{u}" for u in USERS] if hier else [acct]

    def meter_side(acct: str, tenants: list[str]) -> None:
        _add(ours, meter_burst(acct, tenants))

    def seeds_side(acct: str, tenants: list[str]) -> None:
        _add(ref, seeds_burst(acct, tenants))

    def meter_burst(acct: str, tenants: list[str]) -> dict[str, Any]:
        specs = [(acct, limit)] + [(t, user_limit) for t in tenants if t != acct]
        for t, lim in specs:
            _strict(nodes, t, lim)
        for p in nodes:  # warm on every node (seeded), as a sidecar would be
            for t in tenants:
                p.call("usage", t, "f")
        return _meter_burst(nodes, tenants, "f", clients)

    def seeds_burst(acct: str, tenants: list[str]) -> dict[str, Any]:
        calls = [[(acct, limit), (t, user_limit)] for t in tenants] if hier else [[(acct, limit)]]
        per_client = [calls[j % len(calls)] for j in range(clients)]
        return _seed_burst(svc.dynamodb(), table, per_client, 3)

    try:
        meter_burst(*counters())  # (unmeasured: the nodes' first strict burst)
        for r in range(rounds):
            acct, tenants = counters()
            in_turn(r, partial(meter_side, acct, tenants), partial(seeds_side, acct, tenants))
    finally:
        for p in nodes:
            svc.stop_node(p)
    for side, name in ((ours, "meter"), (ref, "seeds")):
        if any(a != limit for a in side["admitted"]):
            raise RuntimeError(f"{name}: admitted {side['admitted']}, not {limit} a round")
    return [_row(shape, s, ours, ref, rounds) for s in ("p99", "max")]


def _add(acc: dict[str, Any], got: dict[str, Any]) -> None:
    acc["latencies"] += got["latencies"]
    acc["admitted"].append(got["admitted"])
    acc["retries"] += got["retries"]
    acc["calls"] += got["calls"]


def _strict(nodes: list[NodeProcess], tenant: str, limit: int) -> None:
    spec = {"limit": limit, "kind": "hard", "enforcement": "strict"}
    version = nodes[0].call("set_limit", tenant, "f", spec)["version"]
    deadline = time.monotonic() + 10
    while not all(p.call("limits", tenant)["version"] >= version for p in nodes):
        if time.monotonic() > deadline:
            raise RuntimeError("the limit did not reach every node")
        time.sleep(0.01)


def main() -> int:
    """``python -m bench.strict_latency``: the rows alone, printed."""
    with Services() as svc:
        for row in near_limit(svc, 300, 100, 4, 2, print):
            print(f"{row.metric}: {row.ours} ms vs {row.reference} ms ({row.ratio:.2f}x)")
            print(f"    {row.detail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
