"""Batched flushes (ADR 0015): packing, tokens and cancellations (pure, storage.transactions),
and the DynamoDB backend's transactions against DynamoDB Local: a cancellation with a mix of
reasons, a bad item parked alone, hot keys written alone in ``auto``, and a hypothesis
machine of batched applies with lost answers and partial cancellations."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import aioboto3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from meter.core.table import CounterTable
from meter.persist.flusher import Flusher
from storage.base import EMPTY, Applied, Delta, Key, StoragePermanentError
from storage.dynamodb import DynamoDBStorage
from storage.transactions import HotKeys, Part, judge, pack, token
from tests.support.lossy_proxy import LossyProxy

M = "2026-11"


def _part(i: int, day: str | None = None, seq: int = 1) -> Part:
    return Part(("t", f"f{i}", M), seq, 1, day, {})


def _key_parts(i: int, with_day: bool) -> list[Part]:
    return [_part(i), *([_part(i, f"{M}-0{1 + i % 9}")] if with_day else [])]


@given(st.lists(st.booleans(), max_size=60), st.integers(2, 12))
def test_pack_keeps_a_keys_parts_together_within_the_limit(days: list[bool], limit: int) -> None:
    keys = [_key_parts(i, d) for i, d in enumerate(days)]
    groups = pack(keys, limit)
    assert [p for g in groups for p in g] == [p for k in keys for p in k]  # all, in order
    for g in groups:
        assert 1 <= len(g) <= limit
    for i in range(len(keys)):
        holding = [n for n, g in enumerate(groups) if any(p.key[1] == f"f{i}" for p in g)]
        assert len(holding) == 1  # never split


def test_a_token_names_one_send_of_one_process() -> None:
    parts = _key_parts(1, True)
    assert token("run", "n1", 1, parts) == token("run", "n1", 1, parts)
    others = {
        token("run", "n1", 2, parts),  # the next send (a later round, after a cancellation)
        token("other", "n1", 1, parts),  # another process
        token("run", "n2", 1, parts),
        token("run", "n1", 1, [_part(1, seq=2)]),
    }
    assert token("run", "n1", 1, parts) not in others and len(others) == 4
    assert len(token("run", "n1", 1, parts)) <= 36  # DynamoDB's limit


def test_judge_reads_each_item_of_a_cancellation() -> None:
    a, b, c, d = _part(1), _part(2), _part(3), _part(4)
    v = judge(
        [a, b, c, d], ["ConditionalCheckFailed", "None", "TransactionConflict", "ValidationError"]
    )
    assert v is not None
    assert v.landed == (a,) and v.again == (b, c) and v.bad == ((d, "ValidationError"),)
    assert v.busy and v.conflicted == frozenset({c.key})
    throttled = judge([a, b], ["ThrottlingError", "None"])
    assert throttled is not None and throttled.busy and throttled.again == (a, b)
    assert not throttled.conflicted
    unknown = judge([a, b], ["SomethingNew", "ItemCollectionSizeLimitExceeded"])
    assert unknown is not None and unknown.again == (a,) and unknown.busy  # never parked
    assert unknown.bad == ((b, "ItemCollectionSizeLimitExceeded"),)


def test_judge_does_not_guess() -> None:
    a, b = _part(1), _part(2)
    assert judge([a, b], None) is None  # no reasons
    assert judge([a, b], ["None"]) is None  # not one per item
    assert judge([a, b], ["None", "None"]) is None  # nothing says why


# -- against DynamoDB Local ------------------------------------------------------------------


@pytest.fixture
async def batched(dynamodb_local: str, dynamodb_table: str) -> AsyncIterator[DynamoDBStorage]:
    store = DynamoDBStorage(dynamodb_table, endpoint_url=dynamodb_local, flush_mode="batched")
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def _put_bad_item(endpoint: str, table: str, key: Key) -> None:
    """An item whose total is a string: DynamoDB refuses to ADD to it (ValidationError)."""
    session = aioboto3.Session(
        aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1"
    )
    async with session.client("dynamodb", endpoint_url=endpoint) as c:
        await c.put_item(
            TableName=table,
            Item={"pk": {"S": key[0]}, "sk": {"S": f"{key[2]}#{key[1]}"}, "t": {"S": "oops"}},
        )


@pytest.mark.dynamodb
async def test_a_cancellation_settles_each_item_by_its_reason(batched: DynamoDBStorage) -> None:
    """One transaction holding a delta that landed before (its counter and bucket both
    fail their conditions) and new ones (``None``): cancelled once; the landed delta is a
    duplicate, the new ones land once, in the next transaction."""
    landed: Key = ("acme", "landed", M)
    new: list[Key] = [("acme", f"new{i}", M) for i in range(4)]
    first = (await batched.apply("n1", [Delta(landed, 1, 5, f"{M}-03")]))[landed]
    assert isinstance(first, Applied) and not first.duplicate
    sent = batched.transactions
    deltas = [Delta(landed, 1, 5, f"{M}-03"), *[Delta(k, 1, 2, f"{M}-03") for k in new]]
    out = await batched.apply("n1", deltas)
    assert batched.cancelled == 1 and batched.transactions == sent + 2
    assert batched.calls["update_item"] == 0
    got = out[landed]
    assert isinstance(got, Applied) and got.duplicate and got.snapshot.total == 5
    for k in new:
        fresh = out[k]
        assert isinstance(fresh, Applied) and not fresh.duplicate
        assert fresh.snapshot.total == 2 and fresh.snapshot.seq_of("n1") == 1
    stored = await batched.load([landed, *new])
    assert {k: s.total for k, s in stored.items()} == {landed: 5, **dict.fromkeys(new, 2)}
    assert await batched.day_buckets("acme", "new0", f"{M}-01", f"{M}-30") == {f"{M}-03": 2}
    assert await batched.day_buckets("acme", "landed", f"{M}-01", f"{M}-30") == {f"{M}-03": 5}


@pytest.mark.dynamodb
async def test_a_refused_transaction_writes_its_keys_alone(
    batched: DynamoDBStorage, dynamodb_local: str, dynamodb_table: str
) -> None:
    """DynamoDB refuses the whole request for an item it cannot update (no reason per
    item): the transaction's keys then go one UpdateItem each, and only the bad one fails."""
    bad: Key = ("acme", "bad", M)
    ok = [("acme", f"ok{i}", M) for i in range(4)]
    await _put_bad_item(dynamodb_local, dynamodb_table, bad)
    out = await batched.apply("n1", [Delta(bad, 1, 7, f"{M}-03"), *[Delta(k, 1, 2) for k in ok]])
    assert isinstance(out[bad], StoragePermanentError)
    for k in ok:
        got = out[k]
        assert isinstance(got, Applied) and got.snapshot.total == 2
    assert batched.calls["update_item"] >= 5  # every key of the refused transaction alone
    assert {s.total for s in (await batched.load(ok)).values()} == {2}


@pytest.mark.dynamodb
async def test_a_flusher_parks_the_bad_key_alone_and_stores_the_rest(
    batched: DynamoDBStorage, dynamodb_local: str, dynamodb_table: str
) -> None:
    bad: Key = ("acme", "bad", M)
    await _put_bad_item(dynamodb_local, dynamodb_table, bad)
    table = CounterTable("n1")
    keys: list[Key] = [bad, *[("acme", f"ok{i}", M) for i in range(12)]]
    for k in keys:
        table.seed(k, EMPTY)
        table.incr(k, 3)
    flusher = Flusher(table, batched)
    await flusher.flush_once()
    assert list(flusher.stats.poisoned) == [bad]
    stored = await batched.load(keys[1:])
    assert {s.total for s in stored.values()} == {3}
    assert batched.write_stats().transactions >= 2  # 12 keys, 24 items: 10 a transaction


def test_hot_keys_are_written_alone_for_a_while_after_a_conflict() -> None:
    hot = HotKeys(30.0)
    a, b = ("t", "a", M), ("t", "b", M)
    assert hot.hot(0.0) == frozenset() and len(hot) == 0
    hot.conflicted([a], 10.0)
    hot.conflicted([b], 20.0)
    assert hot.hot(39.9) == {a, b}
    assert hot.hot(40.0) == {b}  # a's hold ended
    hot.conflicted([b], 45.0)  # conflicted again: held longer
    assert hot.hot(70.0) == {b} and hot.hot(75.0) == frozenset() and len(hot) == 0


@pytest.mark.dynamodb
async def test_dynamodb_local_never_reports_a_conflict_between_transactions(
    dynamodb_local: str, dynamodb_table: str
) -> None:
    """Three writers on the same five keys at once (two in transactions, one alone):
    DynamoDB Local runs them one after the other, so no transaction is cancelled, and every
    total is exact. (On DynamoDB such writes conflict; ``auto`` then writes the key alone,
    tested above: a conflict cannot be made here.)"""
    stores = [
        DynamoDBStorage(dynamodb_table, endpoint_url=dynamodb_local, flush_mode=mode)
        for mode in ("batched", "single", "auto")
    ]
    for st_ in stores:
        await st_.open()
    keys: list[Key] = [("hot", f"f{i}", M) for i in range(5)]
    try:
        for seq in range(1, 31):
            outs = await asyncio.gather(
                *(
                    st_.apply(f"n{i}", [Delta(k, seq, 1, f"{M}-02") for k in keys])
                    for i, st_ in enumerate(stores)
                )
            )
            for out in outs:
                assert all(isinstance(r, Applied) for r in out.values()), out
        assert {s.total for s in (await stores[0].load(keys)).values()} == {90}
        assert stores[0].cancelled == stores[2].cancelled == 0
        assert stores[0].transactions == stores[2].transactions == 30
    finally:
        for st_ in stores:
            await st_.close()


# -- the flusher's machine: batched writes through lost answers ------------------------------


class BatchedFlushMachine(RuleBasedStateMachine):
    """A table and its flusher writing in transactions (``batched``, no retry in the store)
    through a proxy that loses a quarter of the answers: a lost answer fails its keys; the
    next round sends their deltas again in new transactions (a new token), where the items
    that had landed fail their conditions beside new ones: a partial cancellation. Stored
    totals never pass what was tracked nor fall below it by more than the flusher's backlog;
    once the losses stop, every counter and day bucket holds exactly what was tracked."""

    endpoint = ""
    table_name = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        upstream = int(self.endpoint.rsplit(":", 1)[1])
        self.proxy = LossyProxy(upstream, loss=0.25, seed=len(self.table_name))
        self.loop.run_until_complete(self.proxy.start())
        # One retry in the store: a lost answer is sent again under its token (DynamoDB
        # answers without writing twice), or, lost again, in the next round under another.
        self.store = DynamoDBStorage(
            self.table_name,
            endpoint_url=self.proxy.endpoint,
            flush_mode="batched",
            retries=0,
            max_attempts=2,
            backoff_cap=0.01,
        )
        self.direct = DynamoDBStorage(self.table_name, endpoint_url=self.endpoint)
        self.loop.run_until_complete(self.store.open())
        self.loop.run_until_complete(self.direct.open())
        self.counters = CounterTable("node-a")
        self.flusher = Flusher(self.counters, self.store)
        self.flusher.clock = lambda: 1_795_000_000.0  # a day of 2026-11
        tenant = f"m{uuid.uuid4().hex[:10]}"
        self.keys: list[Key] = [(tenant, f"f{i}", M) for i in range(7)]
        for k in self.keys:
            self.counters.seed(k, EMPTY)
        self.tracked = dict.fromkeys(self.keys, 0)

    @rule(i=st.integers(0, 6), qty=st.integers(1, 9))
    def track(self, i: int, qty: int) -> None:
        self.counters.incr(self.keys[i], qty)
        self.tracked[self.keys[i]] += qty

    @rule()
    def flush(self) -> None:
        self.loop.run_until_complete(self.flusher.flush_once())

    def _stored(self) -> dict[Key, int]:
        got = self.loop.run_until_complete(self.direct.load(self.keys))
        return {k: s.total for k, s in got.items()}

    @invariant()
    def never_twice_never_lost(self) -> None:
        stored = self._stored()
        _, backlog = self.flusher.backlog()
        for k in self.keys:
            assert stored[k] <= self.tracked[k], (k, stored[k], self.tracked[k])
            # The view rests on answers, read back or derived: it is what was tracked.
            assert self.counters.value(k) == self.tracked[k], k
        assert sum(stored.values()) >= sum(self.tracked.values()) - backlog

    def teardown(self) -> None:
        try:
            self.proxy.loss = 0.0
            for _ in range(20):
                self.loop.run_until_complete(self.flusher.flush_once())
                if not self.flusher.backlog_keys():
                    break
            assert self._stored() == self.tracked
            got = self.loop.run_until_complete(self.direct.load(self.keys))
            for k in self.keys:
                rests = self.counters.based_on(k)  # what the row rests on is the stored item
                assert rests is not None and rests.total == got[k].total, k
                assert rests.seq_of("node-a") == got[k].seq_of("node-a"), k
                days = self.loop.run_until_complete(
                    self.direct.day_buckets(k[0], k[1], f"{M}-01", f"{M}-30")
                )
                assert sum(days.values()) == self.tracked[k], (k, days)
            assert not self.flusher.stats.poisoned
        finally:
            self.loop.run_until_complete(self.store.close())
            self.loop.run_until_complete(self.direct.close())
            self.loop.run_until_complete(self.proxy.close())
            self.loop.close()


@pytest.mark.dynamodb
@pytest.mark.slow
def test_batched_flushes_through_lost_answers_count_each_unit_once(
    dynamodb_local: str, dynamodb_table: str
) -> None:
    BatchedFlushMachine.endpoint = dynamodb_local
    BatchedFlushMachine.table_name = dynamodb_table
    run_state_machine_as_test(
        BatchedFlushMachine,
        settings=settings(max_examples=12, stateful_step_count=12, deadline=None, database=None),
    )


@pytest.mark.dynamodb
async def test_a_single_writer_key_is_answered_without_a_read_but_every_eighth_flush(
    batched: DynamoDBStorage,
) -> None:
    """Sixteen flushes of one key: 14 answered from what the row rested on plus the delta,
    the 8th and 16th read back; after each, the view and what the row rests on are the
    stored item exactly."""
    key: Key = ("solo", "api", M)
    table = CounterTable("n1")
    table.seed(key, EMPTY)
    flusher = Flusher(table, batched)
    for i in range(1, 17):
        table.incr(key, i)
        reads = batched.calls["batch_get_item"]
        assert await flusher.flush_once()
        read = batched.calls["batch_get_item"] - reads
        assert read == (1 if i % 8 == 0 else 0), i
        stored = (await batched.load([key]))[key]
        assert table.based_on(key) == stored and table.value(key) == stored.total
        assert stored.total == i * (i + 1) // 2
    assert batched.derived == 14


@pytest.mark.dynamodb
async def test_once_a_row_knows_another_writer_every_answer_is_a_read(
    dynamodb_local: str, dynamodb_table: str
) -> None:
    """Two nodes flushing one key in turns, no gossip between them: their answers are derived
    until each key's 8th flush reads the item back, which names the other node; from then on
    every answer is a read, and each view is the stored item."""
    stores = [
        DynamoDBStorage(dynamodb_table, endpoint_url=dynamodb_local, flush_mode="batched")
        for _ in range(2)
    ]
    for st_ in stores:
        await st_.open()
    key: Key = ("pair", "api", M)
    try:
        tables = [CounterTable(f"n{i}") for i in range(2)]
        for t in tables:
            t.seed(key, EMPTY)
        flushers = [Flusher(t, st_) for t, st_ in zip(tables, stores, strict=True)]
        for _ in range(12):
            for t, f in zip(tables, flushers, strict=True):
                t.incr(key, 1)
                assert await f.flush_once()
        stored = (await stores[0].load([key]))[key]
        assert stored.total == 24
        assert [st_.derived for st_ in stores] == [7, 7]  # flushes 1-7, then the read at 8
        for t in tables:
            assert (t.value(key) or 0) >= 23  # the other node's last flush is read at the next
        last = tables[1]  # flushed last: its answer, a read, is the item
        assert last.based_on(key) == stored and last.value(key) == 24
    finally:
        for st_ in stores:
            await st_.close()


async def test_the_wire_takes_its_proxy_from_the_environment_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from storage.dynamodb_wire import Wire

    def wire() -> Wire:
        return Wire(
            "http://dynamodb.example:8000",
            "us-east-1",
            None,
            connections=1,
            connect_timeout=1,
            read_timeout=1,
            user_agent="t",
        )

    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    through = wire()
    await through.open()
    assert through._proxy == "http://proxy.example:3128"
    await through.close()
    monkeypatch.setenv("NO_PROXY", "dynamodb.example")
    bypass = wire()
    await bypass.open()
    assert bypass._proxy is None
    await bypass.close()
