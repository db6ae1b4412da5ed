"""The flusher against the in-memory store with injected failures: exactly once, nothing lost."""

from __future__ import annotations

from typing import Any

import pytest

from meter.core.table import CounterTable
from meter.persist.flusher import MAX_STRETCH, Flusher
from storage.base import Applied, Delta, Snapshot, StorageError, StoragePermanentError
from storage.memory import MemoryStorage

K1 = ("acme", "api", "2026-11")
K2 = ("acme", "seats", "2026-11")


def seeded(node: str = "n1", *keys: Any) -> CounterTable:
    table = CounterTable(node)
    for key in keys or (K1, K2):
        table.seed(key, Snapshot(0, {}))
    return table


async def test_flush_writes_dirty_keys_and_rebases() -> None:
    store = MemoryStorage()
    table = seeded()
    table.incr(K1, 3)
    table.incr(K2, 4)
    flusher = Flusher(table, store)
    assert await flusher.flush_once()
    assert store.items[K1] == Snapshot(3, {"n1": 1})
    assert store.items[K2] == Snapshot(4, {"n1": 1})
    assert table.dirty_keys() == [] or all(table.take_flush(k) is None for k in (K1, K2))
    assert table.value(K1) == 3 and table.pending(K1) == 0
    assert flusher.stats.keys_written == 2 and flusher.stats.last_result == "ok"


async def test_failed_write_keeps_the_delta_and_retries_same_sequence() -> None:
    store = MemoryStorage()
    table = seeded()
    table.incr(K1, 5)
    flusher = Flusher(table, store)
    store.fail_next = 1
    assert not await flusher.flush_once()
    assert K1 not in store.items
    assert table.value(K1) == 5 and table.pending(K1) == 5
    assert flusher.stats.backlog_since is not None
    table.incr(K1, 1)  # lands while the first delta is in flight: goes under the next seq
    assert await flusher.flush_once()
    assert store.items[K1] == Snapshot(5, {"n1": 1})
    assert await flusher.flush_once()
    assert store.items[K1] == Snapshot(6, {"n1": 2})
    assert flusher.stats.backlog_since is None


async def test_lost_acknowledgement_is_not_counted_twice() -> None:
    store = MemoryStorage()
    table = seeded()
    flusher = Flusher(table, store)
    for i in range(20):
        table.incr(K1, 2)
        table.incr(K2, 1)
        if i % 3 == 0:
            store.lose_next_ack = 1
        await flusher.flush_once()
    assert await flusher.drain(5)
    assert store.items[K1].total == 40
    assert store.items[K2].total == 20
    assert table.value(K1) == 40
    assert flusher.stats.duplicates > 0, "the retries after lost acks were refused as applied"


async def test_permanent_error_parks_the_key_and_others_still_flush() -> None:
    class Refusing(MemoryStorage):
        async def apply(self, node: str, deltas: Any) -> dict[Any, Applied | StorageError]:
            good = [d for d in deltas if d.key != K1]
            out: dict[Any, Applied | StorageError] = dict(await super().apply(node, good))
            if len(good) != len(deltas):
                out[K1] = StoragePermanentError("ValidationException: item too large")
            return out

    store = Refusing()
    table = seeded()
    table.incr(K1, 1)
    table.incr(K2, 1)
    flusher = Flusher(table, store)
    assert not await flusher.flush_once()
    assert store.items[K2].total == 1
    assert K1 in flusher.stats.poisoned
    assert "ValidationException" in (flusher.stats.last_error or "")
    writes = store.writes
    await flusher.flush_once()
    assert store.writes == writes, "a parked key is not retried"
    assert table.pending(K1) == 1, "and its units are kept, not dropped"


async def test_unseeded_keys_are_seeded_before_flushing() -> None:
    store = MemoryStorage()
    await store.apply("n1", [Delta(K1, 4, 100)])
    table = CounterTable("n1")
    assert table.incr(K1, 2) is None
    flusher = Flusher(table, store)
    assert await flusher.flush_once()
    assert store.items[K1] == Snapshot(102, {"n1": 5}), "continues after the stored sequence"
    assert table.value(K1) == 102


async def test_batches_are_split(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStorage()
    keys = [("t", f"f{i}", "2026-11") for i in range(25)]
    table = seeded("n1", *keys)
    for k in keys:
        table.incr(k, 1)
    sizes: list[int] = []
    real = store.apply

    async def spy(node: str, deltas: list[Delta]) -> Any:
        sizes.append(len(deltas))
        return await real(node, deltas)

    monkeypatch.setattr(store, "apply", spy)
    assert await Flusher(table, store, batch_keys=10).flush_once()
    assert sorted(sizes) == [5, 10, 10]
    assert sum(s.total for s in store.items.values()) == 25


async def test_drain_gives_up_after_timeout_when_storage_is_down() -> None:
    store = MemoryStorage()
    table = seeded()
    table.incr(K1, 1)
    store.fail_next = 10**6
    flusher = Flusher(table, store)
    assert not await flusher.drain(0.3)
    assert flusher.backlog_keys() == [K1]
    assert table.pending(K1) == 1


async def test_a_backend_bug_does_not_stop_the_round_or_lose_units() -> None:
    """A storage backend raising something other than a StorageError (a bug) fails its batch
    like an unknown outcome: the deltas stay in flight, other batches are still written."""

    class Buggy(MemoryStorage):
        async def apply(self, node: str, deltas: Any) -> dict[Any, Applied | StorageError]:
            if any(d.key == K1 for d in deltas):
                raise ValueError("year 10000 is out of range")
            return await super().apply(node, deltas)

    store = Buggy()
    table = seeded()
    table.incr(K1, 1)
    table.incr(K2, 2)
    flusher = Flusher(table, store, batch_keys=1)
    assert not await flusher.flush_once()
    assert store.items[K2].total == 2, "the other batch was written"
    assert table.pending(K1) == 1, "the failed batch's units are kept, in flight"
    assert "ValueError" in (flusher.stats.last_error or "")
    assert not await flusher.drain(0.2), "drain reports it could not store everything"


class _Slow(MemoryStorage):
    """Memory storage whose writes take ``delay`` seconds a key (rounds that outlast a short
    interval), recording the keys each write carries."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.batches: list[set[Any]] = []

    async def apply(self, node: str, deltas: Any) -> Any:
        import asyncio

        self.batches.append({d.key for d in deltas})
        await asyncio.sleep(self.delay * len(deltas))
        return await super().apply(node, deltas)


async def test_a_backlog_stretches_keys_under_no_limit_and_loses_nothing() -> None:
    """Rounds of about 20 ms against a 5 ms interval: keys under a limit are written every
    round, the others each in its turn, their units kept in memory meanwhile; once rounds
    fit again every key is written every round; a drain writes every key."""
    limited = [("acme", f"lim{i}", "2026-11") for i in range(5)]
    free = [("acme", f"free{i}", "2026-11") for i in range(40)]
    table = seeded("n1", *limited, *free)
    store = _Slow(0.0005)
    flusher = Flusher(table, store, interval=0.005, limited=lambda k: k[1].startswith("lim"))
    tracked = dict.fromkeys(limited + free, 0)
    for _ in range(12):
        for k in tracked:
            table.incr(k, 1)
            tracked[k] += 1
        assert await flusher.flush_once()
    assert flusher.stats.stretch > 1  # rounds of every key outlast the interval
    late = store.batches[1:]  # once stretched
    assert all(set(limited) <= b for b in late)
    for k in free:
        assert sum(k in b for b in late) < len(late), k  # in its turns, not every round
        for start in range(len(late) - MAX_STRETCH + 1):  # ...but every 8 rounds at least
            assert any(k in b for b in late[start : start + MAX_STRETCH]), (k, start)
    assert any(len(b) < len(tracked) / 2 for b in late) and flusher.stats.stretched > 0
    assert {k: s.total for k, s in store.items.items() if k in limited} == {
        k: tracked[k] for k in limited
    }
    assert all(store.items.get(k, Snapshot(0)).total <= tracked[k] for k in free)
    # A round whose write fails: every key it took stays in flight, and is in every round
    # after, whatever its turn, until it is stored.
    for k in tracked:
        table.incr(k, 1)
        tracked[k] += 1
    store.fail_next = 1
    assert not await flusher.flush_once()
    failed = store.batches[-1]
    assert failed and flusher.stats.stretch > 1
    assert await flusher.flush_once()
    assert failed <= store.batches[-1]
    store.delay = 0.0
    flusher.interval = 1.0
    for k in tracked:
        table.incr(k, 1)
        tracked[k] += 1
    assert await flusher.flush_once()  # the stretched round was short: it fits now
    assert flusher.stats.stretch == 1
    assert await flusher.drain(5.0)
    assert {k: s.total for k, s in store.items.items()} == tracked
    for k in tracked:  # every delta once, its sequences in order
        assert store.items[k].seq_of("n1") == table.based_on(k).seq_of("n1")  # type: ignore[union-attr]


async def test_a_drain_writes_every_key_however_stretched() -> None:
    free = [("acme", f"free{i}", "2026-11") for i in range(30)]
    table = seeded("n1", *free)
    store = _Slow(0.001)
    flusher = Flusher(table, store, interval=0.001, limited=lambda k: False)
    for k in free:
        table.incr(k, 2)
    assert await flusher.flush_once()
    assert flusher.stats.stretch == 8  # 30 ms over 1 ms: the most
    for k in free:
        table.incr(k, 3)
    assert await flusher.drain(5.0)
    assert store.batches[-1] == set(free)  # one round of every key
    assert {store.items[k].total for k in free} == {5}
