"""Strict limits (escrowed shares, ADR 0009) through real nodes and their sockets.

Several nodes in this process share one SQLite file (each its own data dir, node id and
connection), so the budget is contended as across a fleet; the multi-process proofs on
DynamoDB Local and Redis are in test_strict_cluster.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meter.client import AsyncClient
from meter.config import CounterConfig, FlushConfig, NodeConfig, ServerConfig, StorageConfig
from meter.core.ports import NoBudget
from meter.errors import LimitExceeded
from meter.node.lifecycle import Node
from meter.quotas.escrow import Budget
from meter.quotas.shares import Shares, decode
from storage.base import BudgetItem, Key, StorageUnavailable
from storage.memory import MemoryStorage
from storage.sqlite import SQLiteStorage


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:  # short path: socket paths are limited
        yield Path(d)


def _config(tmp: Path, name: str, **counters: Any) -> NodeConfig:
    return NodeConfig(
        data_dir=tmp / name,
        node_id=name,
        server=ServerConfig(socket=tmp / f"{name}.sock"),
        storage=StorageConfig(kind="sqlite", sqlite_file=str(tmp / "shared.db")),
        flush=FlushConfig(interval_ms=100),
        counters=CounterConfig(**counters),
    )


@contextlib.asynccontextmanager
async def _nodes(tmp: Path, n: int, **counters: Any) -> AsyncIterator[list[AsyncClient]]:
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for i in range(n):
            cfg = _config(tmp, f"n{i}", **counters)
            await stack.enter_async_context(Node(cfg))
            c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
            stack.push_async_callback(c.close)
            clients.append(c)
        yield clients


async def _burst(c: AsyncClient, tenant: str, feature: str, qty: int = 1) -> int:
    """Track until refused; how many units were admitted."""
    ok = 0
    while True:
        try:
            await c.track(tenant, feature, qty)
        except LimitExceeded:
            return ok
        ok += qty


def _period() -> str:
    return time.strftime("%Y-%m", time.gmtime())


async def _stored(tmp: Path, key: Key) -> int:
    storage = SQLiteStorage(tmp / "shared.db")
    await storage.open()
    try:
        return (await storage.load([key]))[key].total
    finally:
        await storage.close()


async def _budget(tmp: Path, key: Key) -> Budget | None:
    storage = SQLiteStorage(tmp / "shared.db")
    await storage.open()
    try:
        item = await storage.budget_read(key)
    finally:
        await storage.close()
    return decode(item)


async def test_a_strict_limit_admits_exactly_the_limit_across_nodes(tmp: Path) -> None:
    async with _nodes(tmp, 3, strict_share_max=50) as (a, b, c):
        await a.set_limit("acme", "api", 1000, "hard", "strict")
        # Every node has the limit before the burst (each polls the stored version).
        for node in (a, b, c):
            await _wait_for_limit(node, "acme", "api", "strict")
        conns = [x for x in (a, b, c) for _ in range(4)]
        got = await asyncio.gather(*(_burst(x, "acme", "api") for x in conns))
        assert sum(got) == 1000
        # The limit stays reached.
        with pytest.raises(LimitExceeded, match="strict limit 1000"):
            await b.track("acme", "api", 1)
        st = await a.status()
        assert st["limits"]["strict"]["writes"] >= 1
        key = ("acme", "api", _period())
    # Drained: refused calls counted nothing, and the budget matches what was admitted.
    assert await _stored(tmp, key) == 1000
    budget = await _budget(tmp, key)
    assert budget is not None and budget.granted == 1000
    assert all(s.g == s.c for s in budget.shares.values())  # every share given back or used


async def test_shares_given_back_at_a_clean_stop_are_admitted_by_the_others(tmp: Path) -> None:
    async with _nodes(tmp, 1, strict_share_max=400) as (a,):
        await a.set_limit("acme", "api", 1000, "hard", "strict")
        assert await a.track("acme", "api", 10) == 10  # takes a share of up to 400
    # n0 stopped cleanly: what it held and did not admit is back in the budget.
    async with _nodes(tmp, 2, strict_share_max=400) as (a, b):
        await _wait_for_limit(b, "acme", "api", "strict")
        got = await asyncio.gather(_burst(b, "acme", "api"), _burst(b, "acme", "api"))
        assert sum(got) == 990


async def _wait_for_limit(c: AsyncClient, tenant: str, feature: str, enforcement: str) -> None:
    deadline = asyncio.get_running_loop().time() + 5
    while True:
        lim = await c.limits(tenant)
        eff = lim["limits"].get(feature)
        if eff and eff.get("enforcement") == enforcement:
            return
        assert asyncio.get_running_loop().time() < deadline, lim
        await asyncio.sleep(0.02)


async def _wait_value(c: AsyncClient, tenant: str, feature: str, value: int) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while (got := await c.usage(tenant, feature)) != value:
        assert asyncio.get_running_loop().time() < deadline, got
        await asyncio.sleep(0.05)


async def test_reservations_commits_and_batches_take_from_the_strict_share(tmp: Path) -> None:
    async with _nodes(tmp, 2, strict_share_max=20) as (a, b):
        await a.set_limit("acme", "api", 100, "hard", "strict")
        await _wait_for_limit(b, "acme", "api", "strict")
        r1 = await a.reserve("acme", "api", 30)
        r2 = await b.reserve("acme", "api", 30)
        # 60 held: a batch gets the 40 left, item by item, and the rest is refused.
        answers = await b.track_many(
            [("acme", "api", 25), ("acme", "api", 10), ("acme", "api", 10)]
        )
        assert answers[:2] == [55, 65], answers  # with b's 30 held
        assert isinstance(answers[2], LimitExceeded), answers
        # b has 5 left of what it could take; a committing 10 less gives a 10 more to admit.
        await a.commit(r1, 20)
        await b.release(r2)  # back to b's share
        assert (await a.check("acme", "api", 10))["allowed"] is True
        r3 = await a.reserve("acme", "api", 5)
        got = await asyncio.gather(_burst(a, "acme", "api"), _burst(b, "acme", "api"))
        # 20 committed + 35 tracked + 5 held + the burst: exactly 100 in all.
        assert 20 + 35 + 5 + sum(got) == 100
        assert (await b.check("acme", "api", 1))["allowed"] is False
        with pytest.raises(LimitExceeded, match="strict limit 100"):
            await a.reserve("acme", "api", 1)
        # A commit above its reservation needs room for its extra units: refused, it changes
        # nothing and the reservation still holds.
        with pytest.raises(LimitExceeded):
            await a.commit(r3, 6)
        assert await a.commit(r3, 5) >= 5
        st = await a.status()
        assert st["limits"]["strict"]["refused"] >= 1


async def test_a_strict_limit_raised_or_lowered_takes_effect_at_the_next_admission(
    tmp: Path,
) -> None:
    async with _nodes(tmp, 1) as (a,):
        await a.set_limit("acme", "api", 10, "hard", "strict")
        assert await _burst(a, "acme", "api") == 10
        await a.set_limit("acme", "api", 1000, "hard", "strict")
        assert await a.track("acme", "api", 5) == 15  # its share now has room to spare
        assert (await a.status())["limits"]["strict"]["room"] > 100
        # Lowered while the share still has room: the share goes back, the new limit holds.
        await a.set_limit("acme", "api", 17, "hard", "strict")
        assert await _burst(a, "acme", "api") == 2
        await a.set_limit("acme", "api", 12, "hard", "strict")  # below what was admitted
        with pytest.raises(LimitExceeded):
            await a.track("acme", "api", 1)
        assert await a.usage("acme", "api") == 17
        # Turned fast: the view decides again.
        await a.set_limit("acme", "api", 20, "hard", "fast")
        assert await _burst(a, "acme", "api") == 3


async def test_lost_answers_and_races_on_the_budget_are_never_counted_twice() -> None:
    """Shares over a memory storage that loses answers after writing: every unit of the
    limit is admitted once, by one of three nodes, and the budget agrees."""
    from meter.quotas.shares import Shares
    from storage.memory import MemoryStorage

    storage = MemoryStorage()
    key = ("acme", "api", "2026-11")
    nodes = [Shares(storage, f"n{i}", share_max=7, nodes=lambda: 3) for i in range(3)]
    admitted = [0, 0, 0]
    refused = 0
    for round_ in range(400):
        i = round_ % 3
        if round_ % 5 == 0:
            storage.budget_lose_next = 1  # the next write lands and its answer is lost
        s = nodes[i]
        if not s.ready(key, 1, 100):
            try:
                await s.ensure(key, 1, 100, 0)
            except Exception:
                refused += 1
                continue
        s.admit(key, 1)
        admitted[i] += 1
    await asyncio.gather(*(asyncio.sleep(0) for _ in range(3)))
    assert sum(admitted) == 100, admitted
    budget = decode(await storage.budget_read(key))
    assert budget is not None
    assert budget.granted == 100
    for n, s in enumerate(nodes):
        loc = s.local[key]
        assert loc.a == admitted[n] and loc.a <= loc.c <= loc.g
    assert refused > 0


async def test_with_storage_down_a_strict_call_without_room_is_unavailable() -> None:
    from meter.quotas.shares import Shares
    from storage.base import StorageUnavailable
    from storage.memory import MemoryStorage

    storage = MemoryStorage()
    key = ("acme", "api", "2026-11")
    s = Shares(storage, "n0", share_max=4)
    await s.ensure(key, 1, 100, 0)
    room = s.local[key].room
    storage.budget_fail_next = 10**6  # every write fails before landing
    for _ in range(room):
        assert s.ready(key, 1, 100)
        s.admit(key, 1)
    assert not s.ready(key, 1, 100)
    with pytest.raises(StorageUnavailable):
        await s.ensure(key, 1, 100, 0)
    assert s.status()["last_error"] is None or "injected" in s.status()["last_error"]


async def test_a_process_that_does_not_own_its_node_id_writes_no_share() -> None:
    """Shares are per node id: a second process under the id (waiting, or fenced) must not
    touch the owner's share; its calls are unavailable and storage is unchanged."""
    from meter.quotas.shares import Shares
    from storage.base import StorageUnavailable
    from storage.memory import MemoryStorage

    storage = MemoryStorage()
    key = ("acme", "api", "2026-11")
    s = Shares(storage, "n0", fenced=lambda: "node id 'n0' is owned by another process")
    with pytest.raises(StorageUnavailable, match="owned by another process"):
        await s.ensure(key, 1, 100, 0)
    await s.drain()
    assert storage.budgets == {}


# -- interleavings at the awaits of Shares (found by review; each failed before its fix) -----

KEY = ("acme", "api", "2026-11")
L = 100


def stored(storage: MemoryStorage) -> Budget:
    budget = decode(storage._budget_item(KEY))
    assert budget is not None
    return budget


class HookStorage(MemoryStorage):
    """Memory storage whose budget_read/budget_swap can run a hook (another coroutine's work
    interleaving at the await) or fail."""

    def __init__(self) -> None:
        super().__init__()
        self.on_read: Callable[[], None] | None = None
        self.on_swap: Callable[[], None] | None = None
        self.read_fails = 0

    async def budget_read(self, key: Key) -> BudgetItem:
        if self.read_fails > 0:
            self.read_fails -= 1
            raise StorageUnavailable("injected: read fails")
        hook, self.on_read = self.on_read, None
        if hook is not None:
            hook()
        await asyncio.sleep(0)
        return await super().budget_read(key)

    async def budget_swap(self, key: Key, version: int, body: str) -> bool:
        hook, self.on_swap = self.on_swap, None
        if hook is not None:
            hook()
        await asyncio.sleep(0)
        return await super().budget_swap(key, version, body)


async def test_units_freed_during_a_give_back_are_not_admitted_twice() -> None:
    """A: a reservation released while an (idle/limit-change) give-back reads the budget:
    the give-back writes g=c=a_after_free, but the local cap stays a_before_free, so the hot
    path admits the freed units again while the budget hands them to another node."""
    st = HookStorage()
    a = Shares(st, "a", share_max=40, lease_ms=10_000)
    b = Shares(st, "b", share_max=1000, lease_ms=10_000)
    await a.ensure(KEY, 30, L, 0)  # a: room for 30 at least
    # 20 units tracked (committed), 10 held by a reservation.
    a.admit(KEY, 20)
    a.admit(KEY, 10)  # the reservation (escrowed)
    real_admitted_by_a = 30
    loc = a.local[KEY]

    # Release the reservation while the give-back's read is in flight.
    def release() -> None:
        nonlocal real_admitted_by_a
        a.free(KEY, 10)
        real_admitted_by_a -= 10

    st.on_read = release

    # A track of 10 arrives while the swap is in flight: the hot path checks ready/admit.
    def track() -> None:
        nonlocal real_admitted_by_a
        if a.ready(KEY, 10, L):
            a.admit(KEY, 10)
            real_admitted_by_a += 10

    st.on_swap = track
    async with a._lock(KEY):
        await a._give_back(KEY, loc)
    s = stored(st)
    print(
        "stored a:",
        s.shares["a"],
        "local a:",
        a.local.get(KEY),
        "really admitted:",
        real_admitted_by_a,
    )
    # b now takes everything left in the budget and admits it.
    left = L - s.granted
    await b.ensure(KEY, left, L, 0)
    b.admit(KEY, left)
    total = real_admitted_by_a + left
    assert total <= L, f"overshoot: {total} admitted under strict limit {L}"


async def test_a_give_back_whose_answer_and_reread_are_lost_keeps_the_cap_lowered() -> None:
    """B: a give-back lands, its answer is lost, the re-read fails: _give_back restores the
    local cap to what it was, though storage already handed the units back to the pool."""
    st = HookStorage()
    a = Shares(st, "a", share_max=40, lease_ms=10_000)
    b = Shares(st, "b", share_max=1000, lease_ms=10_000)
    await a.ensure(KEY, 1, L, 0)
    a.admit(KEY, 1)
    loc = a.local[KEY]
    room_before = loc.c - loc.a
    assert room_before > 0
    st.budget_lose_next = 1  # the give-back lands, its answer is lost

    def fail_reads() -> None:
        st.read_fails = 1  # ... and the read that would tell fails

    st.on_swap = fail_reads
    # idle give-back as Shares.step does it (the exception is logged there)
    loc.used_at = time.monotonic() - 60
    await a.step()
    s = stored(st)
    admitted_a = 1
    while a.ready(KEY, 1, L):
        a.admit(KEY, 1)
        admitted_a += 1
    left = L - s.granted
    await b.ensure(KEY, left, L, 0)
    b.admit(KEY, left)
    assert admitted_a + left <= L, f"overshoot: {admitted_a}+{left} admitted under {L}"


async def test_an_idle_give_back_while_units_are_held_keeps_them_coming_back() -> None:
    """A reservation held past a lease: the idle give-back keeps the held units spent, and
    their release gives them back (held through ``hold``, and through a plain admit whose
    share went back before the release: owed to the next share)."""
    for held in (True, False):
        st = HookStorage()
        a = Shares(st, "a", share_max=1000, lease_ms=10_000)
        await a.ensure(KEY, L, L, 0)
        if held:
            a.hold(KEY, L)  # reserve(L): every unit of the limit held
        else:
            a.admit(KEY, L)
        a.local[KEY].used_at = time.monotonic() - 60  # idle for a lease
        await a.step()
        if held:
            a.settle(KEY, L, L)  # released: nothing used
        else:
            a.free(KEY, L)
        await a.ensure(KEY, L, L, 0)  # the whole limit can be admitted again
        assert a.ready(KEY, L, L)


async def test_two_processes_under_one_node_id_never_share_a_share() -> None:
    """D: a second process under the same node id while neither is fenced (the new one in
    ownership state 'unknown' - its claim_owner failed - which Ownership.refusal() maps to
    None; or the old one before its next renew/may_write notices the claim). Both write
    the one share 'a' with their own admitted counts."""
    st = MemoryStorage()
    p1 = Shares(st, "a", share_max=20)
    p2 = Shares(st, "a", share_max=20)
    admitted = 0
    for _ in range(400):
        progressed = False
        for p in (p1, p2):
            if not p.ready(KEY, 1, L):
                try:
                    await p.ensure(KEY, 1, L, 0)
                except NoBudget:
                    continue
            p.admit(KEY, 1)
            admitted += 1
            progressed = True
        if not progressed:
            break
    assert admitted <= L, f"overshoot: {admitted} admitted under {L}"


async def test_a_stop_gives_back_the_share_a_call_in_flight_replaced() -> None:
    """A clean stop gives back the share a call still running holds now, not the one it
    listed before that call replaced it (found by review: the record kept the old count,
    10 of the 13 units admitted)."""
    key = ("acme", "api", "2026-11")

    class Slow(MemoryStorage):
        slow = False

        async def budget_swap(self, k: Any, version: int, body: str) -> bool:
            if self.slow:
                await asyncio.sleep(0.01)
            return await super().budget_swap(k, version, body)

    store = Slow()
    s = Shares(store, "n0", lease_ms=10_000, share_max=100)
    await s.ensure(key, 10, 100, 0)
    s.admit(key, 10)
    other = Shares(store, "q", lease_ms=10_000, share_max=100)
    await other.ensure(key, 1, 100, 0)
    store.slow = True

    async def call() -> None:  # the limit moved: the share is given back and taken anew
        await s.ensure(key, 3, 101, 0)
        s.admit(key, 3)

    running = asyncio.create_task(call())
    await asyncio.sleep(0)  # (it holds the counter's lock)
    await s.drain()
    await running
    budget = decode(await store.budget_read(key))
    assert budget is not None and budget.shares["n0"].c == 13
