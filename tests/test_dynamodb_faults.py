"""Exactly-once under faults, against the real DynamoDB Local.

1. Through :class:`LossyProxy` (a share of responses never arrives although the write landed),
   nodes flush like the flusher does - each keeps its ``(key, seq, delta)`` in flight until it
   gets an ``Applied`` - and the table ends up holding exactly the sum of the deltas.
2. The same proxy makes a plain, unconditional ``ADD`` over-count: proof it loses acknowledged
   writes, and the reason for the conditional write.
3. DynamoDB Local (with its data on disk) is stopped for seconds under load and restarted on the
   same port: the totals are exact afterwards.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import aioboto3
import pytest
from botocore.config import Config

from storage.base import Applied, Delta, Key, StorageError, StoragePermanentError
from storage.dynamodb import DynamoDBStorage
from tests.support.dynamodb_local import TEST_JAVA_OPTIONS, DynamoDBLocal
from tests.support.fixtures_dynamodb import create_table
from tests.support.lossy_proxy import LossyProxy

pytestmark = [pytest.mark.dynamodb, pytest.mark.slow]

LOSS = 0.25


class FlushingNode:
    """Drives ``apply`` like a flusher: one sequence per key in flight, retried until applied."""

    def __init__(self, name: str, store: DynamoDBStorage, keys: list[Key], seed: int) -> None:
        self.name = name
        self.store = store
        self.keys = keys
        self.rng = random.Random(seed)
        self.seq: Counter[Key] = Counter()
        #: What this node has had acknowledged per key (== what it added).
        self.acked: Counter[Key] = Counter()
        self.rounds = 0
        self.errors: Counter[str] = Counter()

    async def flush_round(self) -> None:
        """Apply one delta to every key, retrying each until it is ``Applied``."""
        inflight: dict[Key, Delta] = {}
        for key in self.keys:
            self.seq[key] += 1
            inflight[key] = Delta(key, self.seq[key], self.rng.randint(1, 1000))
        while inflight:
            try:
                out = await self.store.apply(self.name, list(inflight.values()))
            except StorageError as exc:  # the whole batch's fate unknown: retry it all
                self.errors[type(exc).__name__] += 1
                out = {}
            for key, result in out.items():
                if isinstance(result, Applied):
                    self.acked[key] += inflight.pop(key).delta
                    assert result.snapshot.seq_of(self.name) >= self.seq[key]
                else:
                    assert not isinstance(result, StoragePermanentError), result
                    self.errors[type(result).__name__] += 1
            if inflight:
                await asyncio.sleep(0.05)
        self.rounds += 1


async def _totals(endpoint: str, table: str, keys: list[Key]) -> dict[Key, int]:
    """The stored totals, read by a fresh storage instance (like a restarted node)."""
    fresh = DynamoDBStorage(table, endpoint_url=endpoint)
    await fresh.open()
    try:
        return {k: s.total for k, s in (await fresh.load(keys)).items()}
    finally:
        await fresh.close()


def _expected(nodes: list[FlushingNode]) -> Counter[Key]:
    total: Counter[Key] = Counter()
    for node in nodes:
        total.update(node.acked)
    return total


@pytest.mark.parametrize("mode", ["single", "batched"])
async def test_lossy_proxy_flushes_exactly_once(
    dynamodb_local: str, dynamodb_table: str, mode: str
) -> None:
    """Lost answers of UpdateItems (``single``) or of transactions (``batched``: botocore's
    retry carries the transaction's token; a later round's is answered by the conditions)."""
    upstream = int(dynamodb_local.rsplit(":", 1)[1])
    keys: list[Key] = [("acme", f"f{i}", "2026-11") for i in range(12)]
    keys += [("acme/u1", f"f{i}", "2026-11-05") for i in range(6)]
    async with LossyProxy(upstream, loss=LOSS, seed=7) as proxy:
        store = DynamoDBStorage(
            dynamodb_table,
            endpoint_url=proxy.endpoint,
            concurrency=16,
            backoff_cap=0.2,
            flush_mode=mode,
        )
        await store.open()
        try:
            nodes = [FlushingNode(f"node-{n}", store, keys, seed=n) for n in range(3)]
            for _ in range(6):
                await asyncio.gather(*(node.flush_round() for node in nodes))
        finally:
            await store.close()
    stored = await _totals(dynamodb_local, dynamodb_table, keys)
    expected = _expected(nodes)
    print(
        f"\nlossy proxy: {proxy.lost} responses lost, {proxy.forwarded} forwarded; "
        f"{store.writes} writes ({store.transactions} transactions), {store.duplicates} "
        f"duplicates answered from the item; node errors "
        f"{sum((n.errors for n in nodes), Counter())}"
    )
    assert proxy.lost > 0  # the fault path was really exercised
    if mode == "single":
        assert store.duplicates > 0
    else:  # every write went in transactions, some sent again after a lost answer
        assert store.calls["update_item"] == 0 and store.transactions > 0
        # a lost answer's transaction sent again under its token (in the same apply)
        assert store.calls["transact_write_items"] > store.transactions
    assert stored == dict(expected)


async def test_lossy_proxy_plain_add_over_counts(dynamodb_local: str, dynamodb_table: str) -> None:
    """Without the condition, a botocore retry after a lost response adds a second time."""
    upstream = int(dynamodb_local.rsplit(":", 1)[1])
    key = {"pk": {"S": "acme"}, "sk": {"S": "2026-11#plain"}}
    acked = 0
    async with LossyProxy(upstream, loss=LOSS, seed=11) as proxy:
        session = aioboto3.Session(
            aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1"
        )
        config = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=2)
        async with session.client("dynamodb", endpoint_url=proxy.endpoint, config=config) as c:
            sem = asyncio.Semaphore(10)

            async def add_one() -> None:
                nonlocal acked
                async with sem:
                    try:
                        await c.update_item(
                            TableName=dynamodb_table,
                            Key=key,
                            UpdateExpression="ADD t :one",
                            ExpressionAttributeValues={":one": {"N": "1"}},
                        )
                    except Exception:
                        return  # not acknowledged (it may still have landed)
                    acked += 1

            await asyncio.gather(*(add_one() for _ in range(300)))
    store = DynamoDBStorage(dynamodb_table, endpoint_url=dynamodb_local)
    await store.open()
    try:
        stored = (await store.load([("acme", "plain", "2026-11")]))[("acme", "plain", "2026-11")]
    finally:
        await store.close()
    print(f"\nplain ADD through the lossy proxy: {acked} acknowledged, {stored.total} stored")
    assert stored.total > acked


async def test_outage_and_restart_keeps_totals_exact(
    dynamodb_local_home: Path, tmp_path: Path
) -> None:
    server = DynamoDBLocal(
        dynamodb_local_home, db_path=tmp_path / "ddb", java_options=TEST_JAVA_OPTIONS
    )
    await asyncio.to_thread(server.start)
    try:
        table = await create_table(server.endpoint)

        keys: list[Key] = [("acme", f"f{i}", "2026-11") for i in range(10)]
        # Short timeouts and few retries: fail fast while the server is down, as a node would.
        store = DynamoDBStorage(
            table, endpoint_url=server.endpoint, connect_timeout=1, read_timeout=2, retries=1
        )
        await store.open()
        nodes = [FlushingNode(f"n{n}", store, keys, seed=100 + n) for n in range(2)]
        stop = asyncio.Event()

        async def run(node: FlushingNode) -> None:
            while not stop.is_set():
                await node.flush_round()

        runners = [asyncio.create_task(run(node)) for node in nodes]

        def progressed(rounds: int) -> bool:
            for task in runners:
                if task.done():
                    task.result()  # a runner failed: raise its error here
            return sum(n.rounds for n in nodes) >= rounds

        try:
            await _until(lambda: progressed(6))
            await asyncio.to_thread(server.stop)
            await asyncio.sleep(4)  # an outage of several seconds under load
            during = sum(n.rounds for n in nodes)
            await asyncio.to_thread(server.start)
            await _until(lambda: progressed(during + 6))
            stop.set()
            await asyncio.gather(*runners)
        finally:
            stop.set()
            for task in runners:
                task.cancel()
            await asyncio.gather(*runners, return_exceptions=True)
            await store.close()
        errors = sum((n.errors for n in nodes), Counter())
        print(f"\noutage: rounds {[n.rounds for n in nodes]}, errors while down {dict(errors)}")
        assert errors["StorageUnavailable"] > 0  # the outage was really seen
        assert await _totals(server.endpoint, table, keys) == dict(_expected(nodes))
    finally:
        await asyncio.to_thread(server.__exit__)


async def _until(condition: Callable[[], bool], timeout: float = 120) -> None:
    """Wait until ``condition()`` holds (polling); fail the test after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)
