"""DynamoDB-specific behaviour of :class:`DynamoDBStorage` against the real DynamoDB Local.

The backend-neutral semantics are in ``test_storage_contract.py``; here: the item layout, the
TTL, paging, init_schema, error mapping and the write counter.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aioboto3
import pytest

from storage.base import Applied, Delta, Key, Snapshot, StoragePermanentError, StorageUnavailable
from storage.dynamodb import DynamoDBStorage
from tests.support.dynamodb_local import free_port
from tests.support.dynamodb_proxy import DynamoDBProxy

pytestmark = pytest.mark.dynamodb

K: Key = ("acme", "api_calls", "2026-11")
#: A month that ends after today: a write to a period already over expires from now.
K_LATER: Key = ("acme", "api_calls", "2099-11")
END_OF_NOV_2099 = 4099766400


@pytest.fixture
async def raw(dynamodb_local: str) -> AsyncIterator[Any]:
    """A bare low-level client, to look at items as DynamoDB stores them."""
    session = aioboto3.Session(
        aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1"
    )
    async with session.client("dynamodb", endpoint_url=dynamodb_local) as client:
        yield client


async def test_item_layout(dynamodb_storage: DynamoDBStorage, raw: Any) -> None:
    await dynamodb_storage.apply("node-a", [Delta(K_LATER, 3, 10**30)])
    await dynamodb_storage.apply("node-b", [Delta(K_LATER, 1, -1)])
    resp = await raw.get_item(
        TableName=dynamodb_storage.table,
        Key={"pk": {"S": "acme"}, "sk": {"S": "2099-11#api_calls"}},
        ConsistentRead=True,
    )
    assert resp["Item"] == {
        "pk": {"S": "acme"},
        "sk": {"S": "2099-11#api_calls"},
        "t": {"N": str(10**30 - 1)},
        "s_node-a": {"N": "3"},
        "s_node-b": {"N": "1"},
        "ttl": {"N": str(END_OF_NOV_2099 + 400 * 86400)},
    }


async def test_ttl_is_the_later_of_period_end_and_now_plus_retention(
    dynamodb_local: str, dynamodb_table: str
) -> None:
    store = DynamoDBStorage(dynamodb_table, endpoint_url=dynamodb_local, retention_days=30)
    await store.open()
    try:
        client: Any = store._client

        async def ttl(key: Key) -> int:
            resp = await client.get_item(
                TableName=dynamodb_table,
                Key={"pk": {"S": key[0]}, "sk": {"S": f"{key[2]}#{key[1]}"}},
                ConsistentRead=True,
            )
            return int(resp["Item"]["ttl"]["N"])

        # A day that ends in the future: the period's end decides the expiry.
        day: Key = ("acme", "api_calls", "2099-11-30")
        await store.apply("n1", [Delta(day, 1, 1)])
        assert await ttl(day) == END_OF_NOV_2099 + 30 * 86400
        store.retention_days = 99  # every write sets it again (it only ever grows)
        await store.apply("n1", [Delta(day, 2, 1)])
        assert await ttl(day) == END_OF_NOV_2099 + 99 * 86400
        # A late write to a period long gone must not expire at once: now decides.
        old: Key = ("acme", "api_calls", "2020-01")
        before = int(time.time())
        await store.apply("n1", [Delta(old, 1, 1)])
        after = int(time.time())
        assert before + 99 * 86400 <= await ttl(old) <= after + 99 * 86400
    finally:
        await store.close()


async def test_one_query_lists_a_period_across_pages(dynamodb_storage: DynamoDBStorage) -> None:
    keys: list[Key] = [("acme", f"feature-{i:03d}", "2026-11") for i in range(45)]
    keys += [("acme", "feature-000", "2026-11-01"), ("acme", "x", "2026-10")]
    await dynamodb_storage.apply("n1", [Delta(k, 1, i) for i, k in enumerate(keys)])
    dynamodb_storage.page_size = 10  # force several pages of the one Query
    before = dynamodb_storage.calls["query"]
    listed = await dynamodb_storage.list_period("acme", "2026-11")
    assert listed == {f"feature-{i:03d}": Snapshot(i, {"n1": 1}) for i in range(45)}
    assert dynamodb_storage.calls["query"] - before == 5  # 45 items, 10 a page (+1 empty)


@pytest.fixture
async def single_storage(
    dynamodb_local: str, dynamodb_table: str
) -> AsyncIterator[DynamoDBStorage]:
    """A store writing one UpdateItem a key's item (``flush_mode = single``)."""
    store = DynamoDBStorage(dynamodb_table, endpoint_url=dynamodb_local, flush_mode="single")
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def test_duplicate_answers_with_a_consistent_read(single_storage: DynamoDBStorage) -> None:
    await single_storage.apply("n1", [Delta(K, 1, 5)])
    await single_storage.apply("n2", [Delta(K, 9, 7)])
    reads = single_storage.calls["get_item"]
    out = await single_storage.apply("n1", [Delta(K, 1, 5)])
    assert out[K] == Applied(Snapshot(12, {"n1": 1, "n2": 9}), duplicate=True)
    assert single_storage.duplicates == 1
    # DynamoDB Local returns no item with the failed condition: we read it, consistently.
    assert single_storage.calls["get_item"] - reads == 1


async def test_a_batched_duplicate_is_read_back_in_a_batch(
    dynamodb_storage: DynamoDBStorage,
) -> None:
    await dynamodb_storage.apply("n1", [Delta(K, 1, 5)])
    await dynamodb_storage.apply("n2", [Delta(K, 9, 7)])
    reads = dynamodb_storage.calls["batch_get_item"]
    out = await dynamodb_storage.apply("n1", [Delta(K, 1, 5)])
    assert out[K] == Applied(Snapshot(12, {"n1": 1, "n2": 9}), duplicate=True)
    assert dynamodb_storage.duplicates == 1
    assert dynamodb_storage.calls["batch_get_item"] - reads == 1
    assert dynamodb_storage.calls["get_item"] == 0


async def test_load_many_keys_in_chunks(dynamodb_storage: DynamoDBStorage) -> None:
    keys: list[Key] = [("t", f"f{i}", "2026-11") for i in range(250)]
    await dynamodb_storage.apply("n1", [Delta(k, 1, i + 1) for i, k in enumerate(keys[::2])])
    before = dynamodb_storage.calls["batch_get_item"]
    got = await dynamodb_storage.load(keys + keys[:5])  # repeats are fine
    assert dynamodb_storage.calls["batch_get_item"] - before == 3
    assert [got[k].total for k in keys[:4]] == [1, 0, 2, 0]
    assert sum(s.total for s in got.values()) == sum(range(1, 126))


async def test_init_schema_twice(dynamodb_local: str) -> None:
    store = DynamoDBStorage("meter_init_twice", endpoint_url=dynamodb_local)
    await store.open()
    try:
        first = await store.init_schema()
        second = await store.init_schema()
    finally:
        await store.close()
    assert "created" in first and "TTL on 'ttl' enabled" in first
    assert "exists" in second and "already enabled" in second
    assert "\n" not in first + second


async def test_write_counter(single_storage: DynamoDBStorage) -> None:
    keys: list[Key] = [("acme", f"f{i}", "2026-11") for i in range(20)]
    await single_storage.apply("n1", [Delta(k, 1, 1000) for k in keys])
    assert single_storage.writes == 20  # one UpdateItem per key, whatever the delta
    await single_storage.apply("n1", [Delta(k, 1, 1000) for k in keys[:5]])
    assert single_storage.writes == 25 and single_storage.duplicates == 5
    assert single_storage.write_stats().write_units == 25


async def test_write_counter_batched(dynamodb_storage: DynamoDBStorage) -> None:
    keys: list[Key] = [("acme", f"f{i}", "2026-11") for i in range(20)]
    await dynamodb_storage.apply("n1", [Delta(k, 1, 1000) for k in keys])
    ws = dynamodb_storage.write_stats()
    assert ws.writes == ws.transactions == 2  # 10 items a transaction on DynamoDB Local
    assert ws.items == 20 and ws.write_units == 40 and ws.cancelled == 0
    await dynamodb_storage.apply("n1", [Delta(k, 1, 1000) for k in keys[:5]])
    ws = dynamodb_storage.write_stats()
    assert ws.transactions == 3 and ws.cancelled == 1 and dynamodb_storage.duplicates == 5


async def test_validation_error_is_permanent(single_storage: DynamoDBStorage) -> None:
    other: Key = ("acme", "fine", "2026-11")
    # 41 significant digits, beyond DynamoDB's 38: a ValidationException, never retried.
    out = await single_storage.apply("n1", [Delta(K, 1, 10**40 + 1), Delta(other, 1, 1)])
    assert isinstance(out[K], StoragePermanentError)
    assert "api_calls" in str(out[K]) and "ValidationException" in str(out[K])
    assert out[other] == Applied(Snapshot(1, {"n1": 1}))
    assert single_storage.writes == 2


async def test_validation_error_in_a_transaction_parks_only_its_key(
    dynamodb_storage: DynamoDBStorage,
) -> None:
    """The refused transaction's keys are written alone: only the bad one fails."""
    other: Key = ("acme", "fine", "2026-11")
    out = await dynamodb_storage.apply("n1", [Delta(K, 1, 10**40 + 1), Delta(other, 1, 1)])
    assert isinstance(out[K], StoragePermanentError) and "ValidationException" in str(out[K])
    assert out[other] == Applied(Snapshot(1, {"n1": 1}))
    assert dynamodb_storage.write_stats().transactions == 1
    assert dynamodb_storage.calls["update_item"] == 2


async def test_bad_keys_and_node_ids_are_permanent(dynamodb_storage: DynamoDBStorage) -> None:
    long_feature: Key = ("acme", "f" * 1100, "2026-11")
    bad_period: Key = ("acme", "f", "2026-13")
    out = await dynamodb_storage.apply("n1", [Delta(long_feature, 1, 1), Delta(bad_period, 1, 1)])
    assert all(isinstance(r, StoragePermanentError) for r in out.values())
    bad_node = await dynamodb_storage.apply("n 1", [Delta(K, 1, 1)])
    assert isinstance(bad_node[K], StoragePermanentError)
    assert dynamodb_storage.writes == 0  # refused before any request
    with pytest.raises(StoragePermanentError):
        await dynamodb_storage.load([long_feature])


async def test_missing_table_is_unavailable(dynamodb_local: str) -> None:
    store = DynamoDBStorage("meter_no_such_table", endpoint_url=dynamodb_local)
    await store.open()
    try:
        out = await store.apply("n1", [Delta(K, 1, 1)])
        assert isinstance(out[K], StorageUnavailable) and "ResourceNotFound" in str(out[K])
        with pytest.raises(StorageUnavailable):
            await store.list_period("acme", "2026-11")
    finally:
        await store.close()


async def test_endpoint_down_is_unavailable(dynamodb_table: str) -> None:
    # Nothing listens on this loopback port: connection refused, mapped, not hanging.
    store = DynamoDBStorage(dynamodb_table, endpoint_url=f"http://127.0.0.1:{free_port()}")
    await store.open()
    try:
        out = await store.apply("n1", [Delta(K, 1, 1)])
        result = out[K]
        assert isinstance(result, StorageUnavailable) and result.retryable
        with pytest.raises(StorageUnavailable):
            await store.load([K])
        with pytest.raises(StorageUnavailable):
            await store.init_schema()
    finally:
        await store.close()


async def test_not_open_is_unavailable(dynamodb_table: str) -> None:
    store = DynamoDBStorage(dynamodb_table, endpoint_url="http://127.0.0.1:9")
    out = await store.apply("n1", [Delta(K, 1, 1)])
    assert isinstance(out[K], StorageUnavailable)


async def test_write_limit_retries_only_a_change_that_raced_it(
    dynamodb_local: str, dynamodb_table: str
) -> None:
    """A conflict re-reads the version (not retried on the stale one by the call layer); a
    cancellation for the version's condition is retried; one for another reason (validation,
    size) fails at once with that reason, not as "the version kept changing"."""
    async with DynamoDBProxy(int(dynamodb_local.rsplit(":", 1)[1])) as proxy:
        store = DynamoDBStorage(dynamodb_table, endpoint_url=proxy.endpoint)
        await store.open()
        try:
            v0 = await store.limits_version()
            body = '{"limit": 1, "kind": "hard", "enforcement": "fast"}'

            def ops() -> tuple[int, int]:
                return proxy.ops["GetItem"], proxy.ops["TransactWriteItems"]

            before = ops()
            proxy.answer_next("TransactWriteItems", "TransactionConflictException", "conflict")
            assert await store.write_limit("limit", "acme", "api", body) == v0 + 1
            reads, writes = (a - b for a, b in zip(ops(), before, strict=True))
            assert (reads, writes) == (2, 2)  # the version read again before the retry

            before = ops()
            proxy.answer_next(
                "TransactWriteItems",
                "TransactionCanceledException",
                "Transaction cancelled, please refer cancellation reasons for specific reasons "
                "[None, ConditionalCheckFailed]",
                CancellationReasons=[{"Code": "None"}, {"Code": "ConditionalCheckFailed"}],
            )
            assert await store.write_limit("limit", "acme", "api", body) == v0 + 2
            assert ops()[1] - before[1] == 2

            before = ops()
            proxy.answer_next(
                "TransactWriteItems",
                "TransactionCanceledException",
                "Transaction cancelled, please refer cancellation reasons for specific reasons "
                "[ValidationError, None]",
                CancellationReasons=[
                    {"Code": "ValidationError", "Message": "Item size has exceeded the limit"},
                    {"Code": "None"},
                ],
            )
            with pytest.raises(StoragePermanentError, match="ValidationError"):
                await store.write_limit("limit", "acme", "api", body)
            assert ops()[1] - before[1] == 1  # not retried
            assert await store.limits_version() == v0 + 2  # nothing changed
        finally:
            await store.close()
