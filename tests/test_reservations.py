"""Reservations as leases (issue 12, item 12): finished leases do not pile up in the deadline
heap, expiry stays exact however leases are closed, and an open lease pins its row whatever
its quantity (a lease of 0 too)."""

from __future__ import annotations

import random

from meter.core.leases import Reservations
from meter.core.table import CounterTable
from meter.node.wiring import build_service
from storage.base import EMPTY, Delta
from storage.memory import MemoryStorage

K = ("acme", "api", "2026-11")


def test_finished_leases_do_not_pile_up_in_the_deadline_heap() -> None:
    r = Reservations()
    keep = [r.open(K, 1, 1e9) for _ in range(10)]
    for _ in range(100_000):  # a busy node: leases of a long TTL, each finished at once
        r.close(r.open(K, 1, 1e9).id)
    assert len(r) == 10
    assert r.deadlines_kept <= max(2 * len(r), r.COMPACT_AT), r.deadlines_kept
    assert {lease.id for lease in r.held()} == {lease.id for lease in keep}
    assert {lease.id for lease in r.expire(1e9)} == {lease.id for lease in keep}
    assert r.deadlines_kept == 0


def test_expiry_is_exact_whatever_leases_are_closed_and_reopened() -> None:
    rng = random.Random(12)
    r = Reservations()
    model: dict[str, float] = {}  # open lease -> deadline
    now = 0.0
    for step in range(20_000):
        roll = rng.random()
        if roll < 0.5:
            lease = r.open(K, rng.randrange(3), now + rng.uniform(0, 50))
            model[lease.id] = lease.deadline
        elif roll < 0.85 and model:
            lease_id = rng.choice(list(model))
            lease = r.close(lease_id)
            del model[lease_id]
            if rng.random() < 0.1:  # an undone close (the log write failed)
                r.open_again(lease)
                model[lease.id] = lease.deadline
        else:
            now += rng.uniform(0, 5)
            expired = {lease.id for lease in r.expire(now)}
            due = {i for i, d in model.items() if d <= now}
            assert expired == due, step
            for i in due:
                del model[i]
        assert len(r) == len(model)
        assert r.deadlines_kept <= max(2 * len(model), r.COMPACT_AT)
    assert {lease.id for lease in r.expire(now + 100)} == set(model)


def test_an_open_lease_pins_its_row_whatever_its_quantity() -> None:
    t = CounterTable("n1")
    held = ("acme", "held", "2026-11")
    zero = ("acme", "zero", "2026-11")
    for key in (held, zero):
        t.seed(key, EMPTY)
    t.reserve(held, 2, None)
    t.reserve(zero, 0, None)
    t.reserve(zero, 0, None)
    for _ in range(3):
        t.evict_idle()
    assert t.is_warm(held) and t.is_warm(zero), "open leases pin their rows"
    assert t.stats().reserved_keys == 2
    t.release(zero, 0)
    for _ in range(3):
        t.evict_idle()
    assert t.is_warm(zero), "one lease of 0 is still open"
    t.commit(zero, 0, 0)
    t.release(held, 2)
    for _ in range(3):
        t.evict_idle()
    assert not t.is_warm(zero) and not t.is_warm(held)


async def test_a_lease_of_zero_keeps_its_counter_loaded_until_it_is_committed() -> None:
    store = MemoryStorage()
    svc = build_service(CounterTable("n1"), store)
    key = svc.key_for("acme", "api")
    await store.apply("other", [Delta(key, 1, 10)])
    assert await svc.seed(key)
    rid = svc.dispatch("reserve", ["acme", "api", 0, {"ttl_ms": 3_600_000}])
    assert isinstance(rid, str)
    for _ in range(3):  # the node's eviction loop, three intervals
        svc.table.evict_idle()
    assert svc.table.is_seeded(key), "the open lease keeps the counter loaded"
    assert svc.dispatch("commit", [rid, 3]) == 13, "the commit knows the total"
    for _ in range(3):
        svc.table.evict_idle()
    assert svc.table.is_warm(key), "its units are not stored yet"
