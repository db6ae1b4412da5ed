"""Day-bucket repairs against the key's next sequence (docs/history.md, H09): a bucket keeps one
sequence per node, so a key's next delta must not reach its bucket before the repair of the
one before it, or the repair would look like a duplicate and its units be lost from the days."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from meter.core.table import CounterTable
from meter.persist.flusher import Flusher
from storage.base import Snapshot
from storage.memory import MemoryStorage

K = ("acme", "api", "2026-11")
K2 = ("acme", "other", "2026-11")


def _at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def _setup(store: MemoryStorage, **kw: Any) -> tuple[CounterTable, Flusher]:
    table = CounterTable("n1")
    table.seed(K, Snapshot(0, {}))
    table.seed(K2, Snapshot(0, {}))
    flusher = Flusher(table, store, **kw)
    flusher.clock = lambda: _at("2026-11-29T12:00:00")
    return table, flusher


def _days_sum(store: MemoryStorage, key: tuple[str, str, str]) -> int:
    return sum(s.total for (t, f, d), s in store.days.items() if (t, f) == key[:2])


async def test_a_failed_repair_holds_back_the_keys_next_delta() -> None:
    """Repair of seq 1 fails (transient), the same round writes seq 2 to the same day's
    bucket; the bucket's watermark is now 2 and the repair of seq 1 is taken as a duplicate."""
    store = MemoryStorage()
    table, flusher = _setup(store)
    table.incr(K, 5)
    store.day_fail_next = 1
    assert not await flusher.flush_once()  # counter has seq 1, bucket not
    assert table.rebase(K, store.items[K], "gossip")  # a peer's snapshot ends it in flight
    table.incr(K, 7)  # more units, same day
    store.fail_next = 1  # the repair's write fails once
    await flusher.flush_once()  # repair fails, seq 2 lands (counter+bucket)
    assert await flusher.drain(5)
    assert store.items[K].total == 12
    assert _days_sum(store, K) == 12, store.days


async def test_a_rebase_during_a_round_repairs_before_the_next_delta() -> None:
    """No second failure needed: a peer's snapshot ends K's in-flight delta while the round's
    first batch (K2) is being written; K's batch then takes seq 2 (the repair of seq 1 is only
    queued, in _take) and writes it to today's bucket before the repair, which the next round
    finds refused as a duplicate (bucket watermark 2 >= 1)."""
    store = MemoryStorage()
    table, flusher = _setup(store, batch_keys=1)
    table.incr(K2, 1)
    table.incr(K, 5)
    store.day_fail_next = 2
    assert not await flusher.flush_once()  # both: counter seq 1 landed, bucket failed
    table.incr(K, 7)
    real_apply = store.apply

    async def apply(node: str, deltas: Any) -> Any:
        out = await real_apply(node, deltas)
        if any(d.key == K2 for d in deltas):
            # gossip arriving while batch 1 is in flight: a peer's snapshot holding K's seq 1
            assert table.rebase(K, Snapshot(5, {"n1": 1}), "gossip")
        return out

    store.apply = apply  # type: ignore[method-assign]
    assert await flusher.drain(5)
    assert store.items[K].total == 12
    assert _days_sum(store, K2) == 1
    assert _days_sum(store, K) == 12, store.days
