"""Credit-metered features (docs/ledger.md, "Credit-metered features"): a feature with a price
spends the tenant's credits through a pool funded from its ledger, escrowed to nodes like a
strict limit's budget; at zero a call is `insufficient_balance`, and nothing is overdrawn.

Real nodes in this process on one SQLite file (each its own data dir and node id); the fleet
test on Redis and DynamoDB Local is in test_credits_cluster.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meter.client import AsyncClient
from meter.config import CounterConfig, FlushConfig, NodeConfig, ServerConfig, StorageConfig
from meter.core.gate import pool_key
from meter.core.keys import Key
from meter.core.ports import POOL, NoBudget
from meter.errors import InsufficientBalance, InvalidArgument
from meter.ledger import model as ledger_model
from meter.ledger.funding import LedgerFunder
from meter.ledger.store import LedgerStore
from meter.quotas.escrow import Budget
from meter.quotas.shares import Shares, decode
from storage.memory import MemoryStorage
from storage.sqlite import SQLiteStorage


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:  # short path: socket paths are limited
        yield Path(d)


def _config(tmp: Path, name: str) -> NodeConfig:
    return NodeConfig(
        data_dir=tmp / name,
        node_id=name,
        server=ServerConfig(socket=tmp / f"{name}.sock"),
        storage=StorageConfig(kind="sqlite", sqlite_file=str(tmp / "shared.db")),
        flush=FlushConfig(interval_ms=100),
        counters=CounterConfig(),
    )


@contextlib.asynccontextmanager
async def _nodes(tmp: Path, n: int) -> AsyncIterator[list[AsyncClient]]:
    from meter.node.lifecycle import Node

    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for i in range(n):
            cfg = _config(tmp, f"n{i}")
            await stack.enter_async_context(Node(cfg))
            c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
            stack.push_async_callback(c.close)
            clients.append(c)
        yield clients


async def _spend(c: AsyncClient, tenant: str, feature: str, qty: int = 1) -> int:
    """Track until refused for credits (or 100,000 units: never refused); the units admitted."""
    ok = 0
    while ok < 100_000:
        try:
            await c.track(tenant, feature, qty)
        except InsufficientBalance:
            return ok
        ok += qty
    return ok


async def _pool(tmp: Path, tenant: str) -> Budget | None:
    storage = SQLiteStorage(tmp / "shared.db")
    await storage.open()
    try:
        item = await storage.budget_read(pool_key(tenant))
    finally:
        await storage.close()
    return decode(item)


async def _ledger(tmp: Path, tenant: str) -> ledger_model.State:
    """The tenant's ledger balance record in the shared store (read once the nodes stopped)."""
    storage = SQLiteStorage(tmp / "shared.db")
    await storage.open()
    try:
        _, body = await storage.ledger_read(tenant)
    finally:
        await storage.close()
    return ledger_model.decode_state(body)


async def _wait_price(c: AsyncClient, tenant: str, feature: str, price: int) -> None:
    deadline = asyncio.get_running_loop().time() + 5
    while (await c.limits(tenant))["limits"].get(feature, {}).get("price") != price:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)


async def test_a_priced_feature_spends_credits_and_stops_at_zero(tmp: Path) -> None:
    async with _nodes(tmp, 1) as (a,):
        await a.set_plan("pro", {"gpu": {"price": 3}, "api": {"limit": 10**6}})
        await a.assign_plan("acme", "pro")
        assert (await a.limits("acme"))["limits"]["gpu"]["price"] == 3
        await a.grant("acme", 100, ref="g1")
        assert await _spend(a, "acme", "gpu") == 33  # 99 credits; the 34th unit needs 3
        with pytest.raises(InsufficientBalance):
            await a.track("acme", "gpu", 1)
        assert await a.usage("acme", "gpu") == 33  # refused units counted nothing
        assert await a.track("acme", "api", 5) == 5  # unpriced features are not charged
        # check says so, with the credits a call would cost.
        detail = await a.check("acme", "gpu", 1)
        assert detail["allowed"] is False and detail["credits"] == 3
        # A grant makes room again: the pool is funded from the ledger as needed.
        await a.grant("acme", 30, ref="g2")
        assert await _spend(a, "acme", "gpu") == 10  # 1 credit left over + 30 = 31: 10 units
        # The ledger shows the metered debits: every credit that went to the pool.
        page = await a.ledger_page("acme")
        metered = [e for e in page["entries"] if e["kind"] == "metered"]
        assert sum(-e["amount"] if e["amount"] < 0 else e["amount"] for e in metered) == 130
        # The ledger gave everything to the pool; the pool holds the 1 credit left unspent.
        balance = await a.balance("acme")
        assert balance["ledger_available"] == 0
        assert balance["pool"] == {"funded": 130, "unspent": 1, "held_elsewhere": 0, "in_flight": 0}
        assert balance["available"] == 1
        # A reservation on a priced feature is refused, clearly.
        with pytest.raises(InvalidArgument, match="credit-metered"):
            await a.reserve("acme", "gpu", 1)
    # A clean stop gives the idle pool's unspent credit back, onto the grant it came from.
    pool = await _pool(tmp, "acme")
    assert pool is not None and pool.funded == 129 and pool.fund is None
    assert pool.granted == pool.funded
    state = await _ledger(tmp, "acme")
    # (the 129 spent are let go by the return: no grant keeps them as in the pool)
    assert state.balance == 1 and [g.pooled for g in state.grants] == [0]


async def test_nodes_sharing_credits_never_overdraw(tmp: Path) -> None:
    async with _nodes(tmp, 3) as (a, b, c):
        await a.set_plan("metered", {"gpu": {"price": 2}})
        await a.assign_plan("acme", "metered")
        for node in (a, b, c):
            await _wait_price(node, "acme", "gpu", 2)
        await a.grant("acme", 1001, ref="g1")
        conns = [x for x in (a, b, c) for _ in range(4)]
        got = await asyncio.gather(*(_spend(x, "acme", "gpu") for x in conns))
        spent = 2 * sum(got)
        # Never more than granted; each node strands at most one unit's price in its share.
        assert 1001 - 3 * 2 < spent <= 1001, got
        balance = await a.balance("acme")
    assert balance["ledger_available"] >= 0
    pool = await _pool(tmp, "acme")
    assert pool is not None and pool.funded is not None
    # What the pool holds came from the ledger (the stop gave its unspent part back).
    state = await _ledger(tmp, "acme")
    assert state.balance + pool.funded == 1001 and pool.granted == pool.funded
    assert sum(g.pooled for g in state.grants) <= pool.funded


async def test_bad_prices_are_refused_with_a_clear_error(tmp: Path) -> None:
    async with _nodes(tmp, 1) as (a,):
        bad: list[tuple[dict[str, Any], str]] = [
            ({"price": 0}, "price must be 1.."),
            ({"price": -2}, "price must be 1.."),
            ({"price": "3"}, "price must be an integer"),
            ({"price": True}, "price must be an integer"),
            ({"price": 10**13}, "price must be 1.."),
        ]
        for spec, message in bad:
            with pytest.raises(InvalidArgument, match=message):
                await a.set_plan("p", {"gpu": spec})
        assert await a.set_limit("acme", "gpu", 10) >= 1  # an override without a price: fine


def test_a_balance_going_below_an_amount_alerts_once_per_crossing() -> None:
    """``balance_alerts = 100,10``: each ledger write that takes the balance below an amount
    fires one alert (named by its entry), a grant and a later fall fires again, metered
    fundings count too, and nothing fires while the balance stays above."""
    import shutil

    from meter.client import Client
    from meter.quotas.alerts import BALANCE, alert_id
    from tests.support.nodes import NodeProcess, short_tmpdir

    workdir = short_tmpdir("mb-")
    try:
        node = NodeProcess(workdir, METER_STORAGE="sqlite", METER_BALANCE_ALERTS="100,10")
        with node, Client.connect(node.socket, timeout=5) as c, Client.connect(node.socket) as w:
            it = w.subscribe_alerts(timeout=5)
            c.grant("acme", 150, ref="g1")
            c.debit("acme", 40, ref="d1")  # 110: nothing crossed
            assert w.next_alert(0.3) is None
            entry = c.debit("acme", 20, ref="d2")  # 90: below 100
            first = next(it)
            assert (first["tenant"], first["feature"], first["threshold"]) == ("acme", BALANCE, 100)
            assert first["value"] == 90
            assert first["id"] == alert_id("acme", BALANCE, f"seq-{entry['seq']}", 100)
            c.debit("acme", 85, ref="d3")  # 5: below 10
            assert next(it)["threshold"] == 10
            assert w.next_alert(0.3) is None
            c.grant("acme", 200, ref="g2")  # 205
            c.set_plan("metered", {"gpu": {"price": 1}})
            c.assign_plan("acme", "metered")
            c.track("acme", "gpu", 1)  # the pool takes every credit left: below 100 and 10
            got = sorted(a["threshold"] for a in (next(it), next(it)))
            assert got == [10, 100]
            assert w.next_alert(0.3) is None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def test_a_write_is_judged_by_its_net_change_for_balance_alerts() -> None:
    """A pool's return of an expired grant's credits writes ``unpooled`` then ``expire`` in
    one write: the balance ends where it began, so no alert fires, whichever amount the
    first entry lifted it over; a write that does end below an amount fires once, named by
    its last entry."""
    from meter.node.wiring import _balance_alerts
    from meter.quotas.alerts import Alerts

    async def claim(aid: str, body: str) -> bool:
        return True

    clock = [1_800_000_000.0]
    alerts = Alerts("n", claim)
    book = LedgerStore(
        MemoryStorage(), clock=lambda: clock[0], on_entries=_balance_alerts(alerts, (600,))
    )
    await book.apply("acme", ledger_model.credit(1_000, "g1"))
    expires = int(clock[0]) + 5
    await book.apply("acme", ledger_model.credit(500, "g2", priority=5, expires_at=expires))
    funded = await book.apply("acme", ledger_model.pool_funding(1_200, "pool:p:1", 0))
    assert funded["balance_after"] == 300 and len(alerts.pending) == 1  # (1,500 to 300)
    clock[0] = expires + 1.0
    back = await book.apply("acme", ledger_model.pool_return(400, "pool:p:2", 700))
    assert back["grants"] == [[2, 400]]
    entries = (await book.page("acme", 0, 100))["entries"]
    assert [(e["kind"], e["balance_after"]) for e in entries[-2:]] == [
        ("unpooled", 700),
        ("expire", 300),
    ]
    assert len(alerts.pending) == 1  # (300 to 300: nothing crossed)


async def test_pipelined_metered_tracks_are_charged_too(tmp: Path) -> None:
    """Pipelined plain tracks of a priced feature are counted in one step with their
    credits (Service.warm_tracks) while the share has room, and wait for a write when not:
    exactly the granted credits are spent either way."""
    async with _nodes(tmp, 1) as (a,):
        await a.set_plan("metered", {"gpu": {"price": 1}})
        await a.assign_plan("acme", "metered")
        await a.grant("acme", 100, ref="g1")
        assert await a.track("acme", "gpu", 1) == 1  # warm: the key and a share exist
        # Plain tracks (no request ids), pipelined on one connection.
        plain = await AsyncClient.connect(tmp / "n0.sock", retry_timeout=0, auto_ids=False)
        try:
            results = await asyncio.gather(
                *(plain.track("acme", "gpu", 1) for _ in range(150)), return_exceptions=True
            )
        finally:
            await plain.close()
        ok = [r for r in results if isinstance(r, int)]
        assert len(ok) == 99
        assert all(isinstance(r, InsufficientBalance) for r in results if not isinstance(r, int))
        assert await a.usage("acme", "gpu") == 100


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("100,x", "expected amounts"),
        ("0", "1..2"),
        ("100,100", "listed twice"),
        (",".join(str(i) for i in range(1, 13)), "at most 10"),
    ],
)
def test_bad_balance_alerts_stop_the_node_naming_the_setting(raw: str, message: str) -> None:
    from meter.config import load
    from meter.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as err:
        load(env={"METER_BALANCE_ALERTS": raw})
    assert "balance_alerts" in str(err.value)
    assert load(env={"METER_BALANCE_ALERTS": "10,1000"}).counters.balance_alerts == (10, 1000)


async def test_a_batch_over_two_priced_features_takes_room_for_their_sum(tmp: Path) -> None:
    """Every priced feature of a tenant spends from its one pool: a batch makes room for the
    items' credits together, not feature by feature (found by review)."""
    async with _nodes(tmp, 1) as (a,):
        await a.set_plan("m", {"gpu": {"price": 1}, "cpu": {"price": 1}})
        await a.assign_plan("acme", "m")
        await a.grant("acme", 1_000_000, ref="g1")
        await a.track("acme", "gpu", 1)
        await a.track("acme", "cpu", 1)
        got = await a.track_many([("acme", "gpu", 50_000), ("acme", "cpu", 50_000)])
        assert got == [50_001, 50_001], got


async def test_pool_refs_are_reserved_and_huge_costs_are_refused_clearly(tmp: Path) -> None:
    async with _nodes(tmp, 1) as (a,):
        for call in (a.grant("acme", 5, ref="pool:x:1"), a.debit("acme", 5, ref="pool:x:2")):
            with pytest.raises(InvalidArgument, match="reserved for credit pools"):
                await call
        await a.set_plan("m", {"gpu": {"price": 10**12}})
        await a.assign_plan("acme", "m")
        with pytest.raises(InvalidArgument, match="cost more than"):
            await a.check("acme", "gpu", 2**62)
        with pytest.raises(InvalidArgument, match="cost more than"):
            await a.track("acme", "gpu", 2**62)


async def test_a_node_that_loses_a_funding_race_does_not_finish_the_winners() -> None:
    """Only the process that began a funding finishes it at once (others wait two leases):
    a lost race to begin one leaves nothing behind (found by review: the loser kept the
    funding as its own and could send its ref while the winner was still deciding)."""
    from meter.ledger.funding import LedgerFunder
    from meter.ledger.store import LedgerStore
    from meter.quotas import escrow as esc
    from meter.quotas.shares import Shares
    from storage.memory import MemoryStorage

    storage = MemoryStorage()
    key = pool_key("acme")
    book = LedgerStore(storage)
    from meter.ledger import model as ledger

    await book.apply("acme", ledger.credit(10_000, "g1"))
    loser = Shares(storage, "l")
    # The winner's funding lands in the record first (as if between the loser's read and its
    # swap); the loser's begin then fails its compare-and-swap.
    winner_fund = esc.begin_fund(None, 1000, int(time.time() * 1000), "p1")
    real_swap = storage.budget_swap

    async def swap_after_winner(k: Any, version: int, body: str) -> bool:
        if k == key and version == 0 and storage.budgets.get(key) is None:
            await real_swap(k, 0, winner_fund.to_json())
        return await real_swap(k, version, body)

    storage.budget_swap = swap_after_winner  # type: ignore[method-assign, assignment]
    assert await loser._fund(key, 10, LedgerFunder(book)) is False
    assert loser._funding == set()
    # And a young funding of another node is not finished by it: nothing is debited.
    assert await loser._fund(key, 10, LedgerFunder(book)) is False
    assert (await book.balance("acme"))["available"] == 10_000


async def test_making_room_leaves_no_exception_behind(tmp: Path) -> None:
    """A compiled coroutine that awaited inside an ``except`` block left the caught exception
    as the thread's current one (mypyc): every exception raised later on the loop's thread
    chained onto it, an ever longer chain kept alive. Funding a pool is such a wait."""
    async with _nodes(tmp, 2) as (a, b):
        await a.set_plan("pro", {"gpu": {"price": 3}})
        await a.assign_plan("acme", "pro")
        await _wait_price(b, "acme", "gpu", 3)
        await a.grant("acme", 300, ref="g1")
        # Both nodes fund their shares of the pool while calls wait for room.
        spent = await asyncio.gather(*(_spend(c, "acme", "gpu") for c in (a, b, a, b)))
        assert 0 < sum(spent) <= 100  # (room stranded on the other node may refuse a few)
    assert sys.exc_info() == (None, None, None)
    try:
        raise RuntimeError("a fresh error")
    except RuntimeError as exc:
        assert exc.__context__ is None, repr(exc.__context__)


async def _spend_all(shares: Shares, pool: tuple[str, str, str]) -> None:
    """What the share and the pool hold, admitted at once, until the pool is dry."""
    while True:
        try:
            await shares.ensure(pool, 1, POOL, 0)
        except NoBudget:
            return
        loc = shares.local[pool]
        shares.admit(pool, loc.c - loc.a)


async def test_a_pool_funding_is_sized_by_the_recent_spend_and_grows_at_most_four_times() -> None:
    """The first funding moves fund_chunk (or a few calls' worth); a pool spent again at once
    gets at most four times its last funding (not the whole ledger), and one spent slowly
    stays at fund_chunk."""
    storage = MemoryStorage()
    await storage.open()
    store = LedgerStore(storage)
    await store.apply("acme", ledger_model.credit(10**9, "g1"))
    funder = LedgerFunder(store)
    shares = Shares(storage, "n1", funder=funder)
    pool = ("acme", "#credits", "")

    async def funded() -> int:
        budget = decode(await storage.budget_read(pool))
        assert budget is not None
        f = budget.funded
        assert f is not None
        return f

    sizes: list[int] = []
    for _ in range(4):
        before = await funded() if sizes else 0
        await shares.ensure_pool(pool, 1)
        sizes.append(await funded() - before)
        await _spend_all(shares, pool)
    assert sizes == [1_000, 4_000, 16_000, 64_000]  # spent within a second: x4, no more
    # A call that needs more than the chunk funds a few calls' worth.
    await shares.ensure_pool(pool, 5_000)
    assert await funded() - sum(sizes) >= 5_000
    assert (await store.balance("acme"))["available"] == 10**9 - await funded()


async def test_a_pool_funding_is_sized_by_what_every_node_moved_in_since() -> None:
    """Two nodes share a pool: a node's next funding is sized by what both moved in since its
    last one (the pool's spend), not by its own funding alone (with three nodes that kept the
    pool at slivers every node raced for)."""
    storage = MemoryStorage()
    await storage.open()
    store = LedgerStore(storage)
    await store.apply("acme", ledger_model.credit(10**9, "g1"))
    funder = LedgerFunder(store)
    a, b = Shares(storage, "a", funder=funder), Shares(storage, "b", funder=funder)
    pool = ("acme", "#credits", "")

    async def funded() -> int:
        budget = decode(await storage.budget_read(pool))
        assert budget is not None and budget.funded is not None
        return budget.funded

    await a.ensure_pool(pool, 1)  # a: 1,000
    await _spend_all(a, pool)
    await b.ensure_pool(pool, 1)  # b: 1,000 (its first)
    await _spend_all(b, pool)
    await _spend_all(a, pool)
    before = await funded()
    await a.ensure_pool(pool, 1)
    # 2,000 moved in since a's last funding began, within a second: x4 of that.
    assert await funded() - before == 8_000


async def test_a_pool_is_funded_ahead_before_it_runs_dry() -> None:
    storage = MemoryStorage()
    await storage.open()
    store = LedgerStore(storage)
    await store.apply("acme", ledger_model.credit(10**9, "g1"))
    funder = LedgerFunder(store)
    s = Shares(storage, "a", share_max=100, funder=funder)
    pool = ("acme", "#credits", "")
    await s.ensure_pool(pool, 1)  # 1,000 in
    spent = 0
    while spent < 600:  # more than half of it shared out and spent, never dry
        await s.ensure_pool(pool, 1)
        loc = s.local[pool]
        spent += loc.c - loc.a
        s.admit(pool, loc.c - loc.a)
    await asyncio.gather(*list(s._ahead.values()))
    budget = decode(await storage.budget_read(pool))
    assert budget is not None and budget.funded is not None
    assert budget.funded > 1_000  # funded again before the pool ran dry
    assert budget.funded - budget.granted > 0
    assert (await store.balance("acme"))["available"] == 10**9 - budget.funded


@pytest.mark.parametrize("crash", ["before the ledger credit", "after the ledger credit"])
async def test_a_return_left_in_flight_by_a_crash_lands_once(crash: str) -> None:
    """A return is in the pool's record (off ``funded``) before the ledger is credited under
    its ref, so a process killed between the steps loses nothing: another node waits two
    leases for it, then sends the same ref (once in the ledger, whichever sent it first) and
    records it; the pool never hands out the returned credits meanwhile."""
    from meter.quotas import escrow as esc

    storage = MemoryStorage()
    key = pool_key("acme")
    clock = [1_800_000_000.0]
    book = LedgerStore(storage, clock=lambda: clock[0])
    funder = LedgerFunder(book)
    await book.apply("acme", ledger_model.credit(5_000, "g1"))
    a = Shares(storage, "a", lease_ms=1_000, clock=lambda: clock[0], funder=funder)
    await a.ensure_pool(key, 10)
    a.admit(key, 10)
    await a.drain()  # (gives the share back; its own return is undone below)
    pool = decode(await storage.budget_read(key))
    assert pool is not None and pool.funded == 10  # the clean stop returned the 990
    # Now the same again, killed midway: the pool funded, 10 spent, the return begun.
    b = Shares(storage, "b", lease_ms=1_000, clock=lambda: clock[0], funder=funder)
    await b.ensure_pool(key, 10)
    b.admit(key, 10)
    async with b._lock(key):
        await b._give_back(key, b.local[key])  # (given back, not returned)
    version, pool = await b._read(key)
    assert pool is not None and pool.funded is not None
    free = pool.funded - pool.granted
    begun = esc.begin_return(pool, free, int(clock[0] * 1000))
    assert await storage.budget_swap(key, version, begun.to_json())
    assert begun.fund is not None
    ref = esc.fund_ref(begun, begun.fund[0])
    if crash == "after the ledger credit":
        assert await funder.give("acme", free, ref, 0)
    c = Shares(storage, "c", lease_ms=1_000, clock=lambda: clock[0], funder=funder)
    assert await c._fund(key, 5, funder) is False  # young: its process may still send it
    clock[0] += 2.5  # two leases later
    assert await c._fund(key, 5, funder) is True  # finished: the same ref, once
    entries = (await book.page("acme", 0, 100))["entries"]
    assert [e["amount"] for e in entries if e["ref"] == ref] == [free]
    pool = decode(await storage.budget_read(key))
    assert pool is not None and pool.fund is None and pool.funded == 20
    state = await book.balance("acme")
    assert state["available"] == 5_000 - 20  # 20 spent, nothing lost, nothing twice


async def _expiring_grant(
    storage: MemoryStorage, first: int = 0
) -> tuple[list[float], LedgerStore, LedgerFunder, int]:
    """A ledger on ``storage`` under a settable clock: a grant of ``first`` credits that
    never expires (none if 0), then one of 500 at priority 5 that expires in 5 s."""
    clock = [1_800_000_000.0]
    book = LedgerStore(storage, clock=lambda: clock[0])
    expires = int(clock[0]) + 5
    if first:
        await book.apply("acme", ledger_model.credit(first, "g1"))
    await book.apply("acme", ledger_model.credit(500, "g2", priority=5, expires_at=expires))
    return clock, book, LedgerFunder(book), expires


async def test_a_busy_pool_gives_back_the_credits_of_an_expired_grant_it_holds() -> None:
    """The pool keeps its grants' expiry while in use: the upkeep pass after a grant's expiry
    gives back this node's share (its unused cap) and then the pool's unshared credits of
    the grant, which expire in the same write: none of them can be spent after it. Nothing
    is lost or counted twice; the other grant's credits are spent on."""
    storage = MemoryStorage()
    key = pool_key("acme")
    clock, book, funder, expires = await _expiring_grant(storage, first=1_000)
    a = Shares(storage, "a", lease_ms=10_000, clock=lambda: clock[0], funder=funder)
    a.fund_chunk = 800
    spent = 0

    async def spend(n: int) -> None:
        nonlocal spent
        await a.ensure_pool(key, n)
        a.admit(key, n)
        spent += n

    async def pool() -> Budget:
        got = decode(await storage.budget_read(key))
        assert got is not None and got.funded is not None
        return got

    async def expired() -> int:
        entries = (await book.page("acme", 0, 100))["entries"]
        return -sum(int(e["amount"]) for e in entries if e["kind"] == "expire")

    async def adds_up() -> None:  # grants - expired - spent = ledger + pool unspent
        p = await pool()
        ledger = (await book.balance("acme"))["available"]
        assert spent <= (p.funded or 0)
        assert 1_500 - await expired() - spent == ledger + (p.funded or 0) - spent

    await spend(10)
    p = await pool()
    assert p.funded == 800  # (grant 2's 500 first, then grant 1's 300)
    room = a.local[key].c - a.local[key].a
    # (unshared: less than grant 2's 490 unspent; the share holds the rest, some unused)
    assert room > 0 and p.funded - p.granted < 490
    await a.step()  # (before the expiry: nothing to give back)
    assert await expired() == 0 and a.local[key].c - a.local[key].a == room
    clock[0] = expires + 1.0
    await a.step()  # (the share in use, but holding expired credits: given back first)
    entries = (await book.page("acme", 0, 100))["entries"]
    assert [(e["kind"], e["amount"], e["grants"]) for e in entries[-2:]] == [
        ("unpooled", 490, [[2, 490]]),
        ("expire", -490, [[2, 490]]),
    ]
    assert key not in a.local  # (its share given back: nothing more admitted from it)
    await adds_up()
    p = await pool()
    assert (p.funded, p.granted) == (310, 10)
    grants = (await book.balance("acme"))["grants"]
    # (grant 2 lets go of the 10 spent: the pool spends it first; it closes)
    assert [(g["seq"], g["pooled"]) for g in grants] == [(1, 300)]
    await a.step()  # (nothing left of it: nothing more, nothing twice)
    assert await expired() == 490

    # Spending goes on: a new share, then new fundings of grant 1.
    await spend(600)
    await adds_up()
    # The share idle for a lease: given back with the pool's unspent, all grant 1's.
    clock[0] += 11
    a.local[key].used_at = float("-inf")
    await a.step()
    await adds_up()
    p = await pool()
    assert p.funded == p.granted == spent == 610
    got = await book.balance("acme")
    assert got["available"] == 1_500 - 610 - 490
    assert [g["seq"] for g in got["grants"]] == [1]
    assert await expired() == 490


class RacingStorage(MemoryStorage):
    """Memory storage that runs ``before_return`` (once) just before the first write that
    begins a pool's return: another node's write lands first, and the return's loses."""

    def __init__(self) -> None:
        super().__init__()
        self.before_return: Callable[[], Awaitable[None]] | None = None
        self.raced = 0

    async def budget_swap(self, key: Key, version: int, body: str) -> bool:
        hook = self.before_return
        fund = Budget.from_json(body).fund
        if hook is not None and fund is not None and fund[1] < 0:
            self.before_return = None
            self.raced += 1
            await hook()
        return await super().budget_swap(key, version, body)


async def test_every_node_holding_a_share_of_a_pool_looks_for_expired_credits() -> None:
    """A node whose share of a pool came by a refill (not a priced call's funding) looks at
    it after a grant's expiry too, and a look whose return loses a write race to another
    node's share tries again in the same pass: its own share given back, what it sees of
    the grant in the pool expires. Nothing is lost or counted twice."""
    storage = RacingStorage()
    key = pool_key("acme")
    clock, book, funder, expires = await _expiring_grant(storage)

    def node(name: str) -> Shares:
        return Shares(storage, name, lease_ms=10_000, clock=lambda: clock[0], funder=funder)

    a, b, c = node("a"), node("b"), node("c")
    await a.ensure_pool(key, 10)  # (a funds the pool: all 500)
    a.admit(key, 10)
    await b.ensure(key, 5, POOL, 0, background=True)  # (as a refill takes it)
    b.admit(key, 5)

    async def expired() -> int:
        entries = (await book.page("acme", 0, 100))["entries"]
        return -sum(int(e["amount"]) for e in entries if e["kind"] == "expire")

    clock[0] = expires + 1.0
    # b's first write of a return loses to a write of c's (c takes a share just before).
    storage.before_return = lambda: c.ensure(key, 3, POOL, 0, background=True)
    await b.step()
    assert storage.raced == 1 and key not in b.local
    pool = decode(await storage.budget_read(key))
    assert pool is not None and pool.funded is not None and pool.fund is None
    # In that pass: read again, returned, and nothing of the grant is left unshared.
    assert await expired() > 0 and pool.funded == pool.granted
    # What b sees unspent is only what a's and c's shares were granted past their caps:
    # theirs, not b's to return (b counts their caps spent).
    got = await b.pool("acme")
    assert got["unspent"] == sum(s.g - s.c for n, s in pool.shares.items() if n != "b") > 0
    ledger = (await book.balance("acme"))["available"]
    assert await expired() + 15 + ledger + pool.funded - 15 == 500
