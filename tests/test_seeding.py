"""Coalesced seeding on a real node process against Amazon DynamoDB Local (L01, L03, L04).

The node reads cold keys from DynamoDB in batches (``BatchGetItem`` of 100 keys), not one read
per key. Each test runs a fresh ``meter serve`` whose endpoint is a :class:`DynamoDBProxy`: the
proxy counts the requests the node really sends, and makes ``BatchGetItem`` answer part of a
batch as unprocessed, or fail, while every other operation passes untouched. Stored totals are
read at the end straight from DynamoDB Local, past the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from meter.client import AsyncClient
from meter.core.keys import period_start
from meter.errors import Unavailable
from storage.base import Delta, Key, Snapshot
from storage.dynamodb import DynamoDBStorage
from tests.support.dynamodb_proxy import DynamoDBProxy
from tests.support.nodes import NodeProcess, short_tmpdir

pytestmark = [pytest.mark.dynamodb, pytest.mark.slow]

#: The node id the nodes under test run as (some keys hold stored sequences of it).
NODE_ID = "seeding-node"
#: Another writer's id, whose flushes pre-populate keys.
OTHER_ID = "earlier-writer"
#: Keys per BatchGetItem.
CHUNK = 100


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmpdir()
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


@pytest.fixture
async def proxy(dynamodb_local: str) -> AsyncIterator[DynamoDBProxy]:
    async with DynamoDBProxy(int(dynamodb_local.rsplit(":", 1)[1])) as p:
        yield p


def node_env(endpoint: str, table: str, **extra: str) -> dict[str, str]:
    return {
        "METER_STORAGE": "dynamodb",
        "METER_DYNAMODB_ENDPOINT": endpoint,
        "METER_DYNAMODB_TABLE": table,
        "METER_NODE_ID": NODE_ID,
        "METER_FLUSH_INTERVAL_MS": "200",
        **extra,
    }


def month_keys(tenants: int, features: int) -> list[Key]:
    period = period_start("month")
    return [(f"t{t}", f"f{f}", period) for t in range(tenants) for f in range(features)]


async def prepopulate(endpoint: str, table: str, keys: list[Key]) -> dict[Key, Snapshot]:
    """Store known totals for ``keys``: the even ones written by this node's own id (its
    sequence 3 stored, as if it ran before on another data dir), the odd ones by another
    writer. Returns what is stored."""
    store = DynamoDBStorage(table, endpoint_url=endpoint)
    await store.open()
    try:
        mine = [Delta(k, 3, 100 * i + 3) for i, k in enumerate(keys) if i % 2 == 0]
        theirs = [Delta(k, 5, 7 * i + 5) for i, k in enumerate(keys) if i % 2 == 1]
        for node, deltas in ((NODE_ID, mine), (OTHER_ID, theirs)):
            out = await store.apply(node, deltas)
            assert all(not isinstance(r, Exception) for r in out.values()), out
        stored = await store.load(keys)
    finally:
        await store.close()
    assert all(s.total > 0 for s in stored.values())
    return stored


async def stored_snapshots(endpoint: str, table: str, keys: list[Key]) -> dict[Key, Snapshot]:
    """What DynamoDB Local holds, read by a fresh storage instance, not through the proxy."""
    store = DynamoDBStorage(table, endpoint_url=endpoint)
    await store.open()
    try:
        return await store.load(keys)
    finally:
        await store.close()


async def status(sock: Path) -> dict[str, Any]:
    async with await AsyncClient.connect(str(sock)) as client:
        st: dict[str, Any] = await client.status()
        return st


async def wait_status(sock: Path, cond: Any, what: str, timeout: float = 60) -> dict[str, Any]:
    """Poll the node's status until ``cond(status)`` holds; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        st = await status(sock)
        if cond(st):
            return st
        assert loop.time() < deadline, f"timed out after {timeout}s waiting for {what}: {st}"
        await asyncio.sleep(0.05)


async def test_cold_keys_asked_for_concurrently_are_read_in_batches_of_a_hundred(
    workdir: Path, dynamodb_local: str, dynamodb_table: str, proxy: DynamoDBProxy
) -> None:
    """L01: 1,000 cold keys asked for by four clients at once, each in five ``track_many``
    calls of 200 items (every client every key, in its own order): every item is counted,
    the node reads the keys in about 1,000 / 100 ``BatchGetItem`` requests, each key once;
    then 300 more cold keys, one per ``track`` call, from four clients at once: read in a few
    batches too, not one read per call. After the drain DynamoDB holds exactly what was
    tracked."""
    keys = month_keys(10, 100)
    period = keys[0][2]
    rng = random.Random(5)
    tracked: Counter[Key] = Counter()
    calls: list[list[tuple[str, str, int]]] = []
    for _client in range(4):
        order = rng.sample(keys, len(keys))
        items = [(t, f, rng.randint(1, 9)) for t, f, _ in order]
        calls.extend(items[i : i + 200] for i in range(0, len(items), 200))
    for call in calls:
        tracked.update({(t, f, period): qty for t, f, qty in call})
    # One cold key per call, afterwards: 300 single tracks from four clients at once.
    singles = [(f"u{n % 4}", f"g{n}", period) for n in range(300)]
    # DynamoDB Local takes some 15 ms per UpdateItem on a small machine: no flush round
    # while the clients track (each key is written once, by the drain), and time to drain.
    node = NodeProcess(
        workdir,
        **node_env(proxy.endpoint, dynamodb_table, METER_FLUSH_INTERVAL_MS="600000"),
        METER_DRAIN_TIMEOUT_S="300",
    )
    await asyncio.to_thread(node.start)
    try:
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(await AsyncClient.connect(str(node.socket)))
                for _ in range(4)
            ]
            answers = await asyncio.gather(
                *(clients[n % 4].track_many(call) for n, call in enumerate(calls))
            )
            for call, answer in zip(calls, answers, strict=True):
                # Counted, on a seeded key (nil: counted with the total unknown).
                values = [a for a in answer if type(a) is int]
                assert len(values) == len(answer) == len(call), answer
                assert all(a >= q for a, (_, _, q) in zip(values, call, strict=True))
            first = (await status(node.socket))["seeding"]
            batch_gets = proxy.ops["BatchGetItem"]
            asked = sum(proxy.asked.values())

            singles_answers = await asyncio.gather(
                *(clients[n % 4].track(t, f, 2) for n, (t, f, _) in enumerate(singles))
            )
            assert singles_answers == [2] * len(singles)
            tracked.update(dict.fromkeys(singles, 2))
            second = (await status(node.socket))["seeding"]
    finally:
        code = await asyncio.to_thread(node.stop)
    assert code == 0, node.log()

    bound = math.ceil(len(keys) / CHUNK) + 6
    reads = second["reads"] - first["reads"]
    single_bound = math.ceil(len(singles) / CHUNK) + 12
    print(
        f"\n{len(keys)} cold keys, {len(calls)} track_many calls of 200 items from 4 clients: "
        f"{first['reads']} seeding reads, {batch_gets} BatchGetItem requests (bound {bound}); "
        f"{len(singles)} single tracks of cold keys: {reads} seeding reads "
        f"(bound {single_bound})"
    )
    assert first["on_demand"] == len(keys), first
    assert first["failed_reads"] == 0 and first["prefetched"] == 0, first
    assert first["reads"] <= bound, first
    # What the node sent (the flusher reads nothing here: every key was seeded on demand).
    assert batch_gets <= bound, proxy.ops
    assert asked == len(keys), "every key read once"
    assert second["on_demand"] - first["on_demand"] == len(singles), second
    assert second["failed_reads"] == 0, second
    assert reads <= single_bound, second
    assert proxy.ops["BatchGetItem"] - batch_gets == reads, proxy.ops
    stored = await stored_snapshots(dynamodb_local, dynamodb_table, list(tracked))
    assert {k: s.total for k, s in stored.items()} == dict(tracked)


async def test_a_batch_answered_partly_unprocessed_seeds_every_key_with_its_stored_total(
    workdir: Path, dynamodb_local: str, dynamodb_table: str, proxy: DynamoDBProxy
) -> None:
    """L03: DynamoDB answers the seeding reads with part of their keys unprocessed (eight
    times); the storage asks for those again, so every key is seeded with its stored total
    and sequences: ``usage`` answers exactly the stored totals, and the node's tracks are
    stored on top of them once (the keys its id wrote before continue after its stored
    sequence)."""
    keys = month_keys(3, 100)
    before = await prepopulate(dynamodb_local, dynamodb_table, keys)
    proxy.unprocessed = 8
    node = NodeProcess(workdir, **node_env(proxy.endpoint, dynamodb_table))
    await asyncio.to_thread(node.start)
    try:
        async with await AsyncClient.connect(str(node.socket), retry_timeout=0) as client:
            usage = await asyncio.gather(*(client.usage(t, f) for t, f, _ in keys))
            assert dict(zip(keys, usage, strict=True)) == {k: s.total for k, s in before.items()}
            st = await status(node.socket)
            items = [(t, f, 1 + i % 5) for i, (t, f, _) in enumerate(keys)]
            answers = await client.track_many(items)
            assert answers == [before[k].total + 1 + i % 5 for i, k in enumerate(keys)]
    finally:
        code = await asyncio.to_thread(node.stop)
    assert code == 0, node.log()
    seeding = st["seeding"]
    print(
        f"\n{len(keys)} keys: {proxy.rewritten} BatchGetItem answers rewritten, {proxy.moved} "
        f"items moved to UnprocessedKeys, {proxy.ops['BatchGetItem']} BatchGetItem requests, "
        f"{seeding['reads']} seeding reads"
    )
    assert proxy.rewritten == 8 and proxy.moved > 0, "the fault path was exercised"
    assert seeding["failed_reads"] == 0 and seeding["on_demand"] == len(keys), seeding
    assert proxy.ops["BatchGetItem"] >= seeding["reads"] + 8, "unprocessed keys asked again"
    stored = await stored_snapshots(dynamodb_local, dynamodb_table, keys)
    for i, key in enumerate(keys):
        assert stored[key].total == before[key].total + 1 + i % 5, key
        # One more flush of this node's, after the sequences it had stored: none reused.
        assert stored[key].seq_of(NODE_ID) == before[key].seq_of(NODE_ID) + 1, key


@pytest.mark.parametrize("fault", ["500", "drop"])
async def test_a_failed_seeding_batch_counts_and_the_flusher_seeds_it_when_storage_heals(
    workdir: Path, dynamodb_local: str, dynamodb_table: str, proxy: DynamoDBProxy, fault: str
) -> None:
    """L04: while every ``BatchGetItem`` fails (answered 500, or the connection dropped),
    cold keys are still counted (``track`` and ``track_many`` answer nil), ``usage`` on them
    answers ``unavailable``, and no total is invented; once reads work again the flusher
    seeds them by itself and stores every unit once on top of the stored totals."""
    keys = month_keys(2, 60)
    before = await prepopulate(dynamodb_local, dynamodb_table, keys)
    proxy.fail = fault
    node = NodeProcess(
        workdir,
        **node_env(proxy.endpoint, dynamodb_table),
        METER_DYNAMODB_READ_TIMEOUT_S="1",
    )
    await asyncio.to_thread(node.start)
    tracked: Counter[Key] = Counter()
    try:
        async with await AsyncClient.connect(str(node.socket), retry_timeout=0) as client:
            first, *rest = keys
            items = [(t, f, 2) for t, f, _ in rest]
            one, many = await asyncio.gather(
                client.track(first[0], first[1], 3), client.track_many(items)
            )
            assert one is None and many == [None] * len(rest), "counted, total unknown"
            tracked[first] += 3
            tracked.update({k: 2 for k in rest})
            asked = (first, rest[0], rest[-1])
            answers = await asyncio.gather(
                *(client.usage(t, f) for t, f, _ in asked), return_exceptions=True
            )
            assert all(isinstance(a, Unavailable) for a in answers), answers
            during = await status(node.socket)
            assert proxy.failed > 0 and during["seeding"]["failed_reads"] >= 1, during
            assert during["seeding"]["on_demand"] == 0, during
            assert during["keys"]["unseeded"] == len(keys), during
            # Dirty and unseeded, each key is in the backlog once, with its units once.
            assert during["flush"]["backlog_keys"] == len(keys), during["flush"]
            assert during["flush"]["backlog_units"] == sum(tracked.values()), during["flush"]

            proxy.fail = None  # reads work again: nobody asks, the flusher seeds them
            healed = await wait_status(
                node.socket,
                lambda st: st["keys"]["unseeded"] == 0 and st["keys"]["dirty"] == 0,
                "the flusher to seed and store every key",
            )
            assert healed["seeding"]["on_demand"] == 0, "seeded by the flusher, not a caller"
            usage = await asyncio.gather(*(client.usage(t, f) for t, f, _ in keys))
            expected = {k: before[k].total + tracked[k] for k in keys}
            assert dict(zip(keys, usage, strict=True)) == expected
            # Warm now: counted with their totals.
            again = await client.track_many([(t, f, 1) for t, f, _ in keys])
            assert again == [expected[k] + 1 for k in keys]
            tracked.update(keys)
    finally:
        code = await asyncio.to_thread(node.stop)
    assert code == 0, node.log()
    print(
        f"\n{fault}: {proxy.failed} BatchGetItem requests failed, "
        f"seeding {during['seeding']['failed_reads']} failed reads, "
        f"last error {during['seeding']['last_error']!r}"
    )
    stored = await stored_snapshots(dynamodb_local, dynamodb_table, keys)
    assert {k: s.total for k, s in stored.items()} == {
        k: before[k].total + tracked[k] for k in keys
    }, "nothing lost, nothing doubled"
    for key in keys:
        assert stored[key].seq_of(NODE_ID) > before[key].seq_of(NODE_ID), key
