"""Credits ledgers through a real node and its socket (docs/ledger.md): the methods, both
clients, the CLI, bad inputs, storage down - and, against DynamoDB Local through the lossy
proxy, grants and debits landing exactly once."""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from meter.cli.main import main as cli_main
from meter.client import AsyncClient, Client
from meter.config import FlushConfig, NodeConfig, ServerConfig
from meter.errors import Conflict, InsufficientBalance, InvalidArgument, Unavailable
from meter.ledger import model as ledger
from meter.ledger.store import LedgerStore
from meter.node.lifecycle import Node
from storage.memory import MemoryStorage


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:  # short path: socket paths are limited
        yield Path(d)


def _config(tmp: Path) -> NodeConfig:
    return NodeConfig(
        data_dir=tmp / "data",
        node_id="n1",
        server=ServerConfig(socket=tmp / "m.sock"),
        flush=FlushConfig(interval_ms=200),
    )


@pytest.fixture
async def client(tmp: Path) -> AsyncIterator[AsyncClient]:
    cfg = _config(tmp)
    async with Node(cfg):
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        try:
            yield c
        finally:
            await c.close()


async def _entries(client: AsyncClient, tenant: str) -> list[dict[str, Any]]:
    return [e async for e in client.ledger_entries(tenant, page_size=2)]


async def test_grants_debits_and_the_balance_round_trip(client: AsyncClient) -> None:
    g = await client.grant("acme", 100, ref="g1")
    assert g == {
        "seq": 1,
        "time": g["time"],
        "kind": "grant",
        "amount": 100,
        "ref": "g1",
        "balance_after": 100,
        "priority": 0,
        "expires_at": None,
    }
    far = int(time.time()) + 3600
    await client.grant("acme", 30, ref="g2", priority=5, expires_at=far)
    d = await client.debit("acme", 40, ref="d1")
    # Higher priority first: all of grant 2, then 10 of grant 1.
    assert (d["amount"], d["balance_after"], d["grants"]) == (-40, 90, [[2, 30], [1, 10]])
    bal = await client.balance("acme")
    assert bal == {
        "tenant": "acme",
        "available": 90,
        "ledger_available": 90,
        "pool": {"funded": 0, "unspent": 0, "held_elsewhere": 0, "in_flight": 0},
        "seq": 3,
        "grants": [
            {
                "seq": 1,
                "remaining": 90,
                "priority": 0,
                "expires_at": None,
                "pooled": 0,
                "in_pool": 0,
            }
        ],
    }
    entries = await _entries(client, "acme")
    assert [(e["seq"], e["kind"], e["amount"]) for e in entries] == [
        (1, "grant", 100),
        (2, "grant", 30),
        (3, "debit", -40),
    ]
    assert sum(e["amount"] for e in entries) == bal["available"]
    page = await client.ledger_page("acme", after=1, limit=1)
    assert [e["seq"] for e in page["entries"]] == [2] and page["cursor"] == 2
    assert (await client.ledger_page("acme", after=3))["entries"] == []
    # Another tenant's ledger is its own.
    assert (await client.balance("beta"))["available"] == 0


async def test_an_overdraft_is_refused_and_changes_nothing(client: AsyncClient) -> None:
    await client.grant("acme", 10, ref="g")
    with pytest.raises(InsufficientBalance, match="debit of 11 exceeds the available balance"):
        await client.debit("acme", 11, ref="d")
    assert (await client.balance("acme"))["available"] == 10
    assert len(await _entries(client, "acme")) == 1
    # The refused ref was not used up: it lands once there is enough.
    await client.grant("acme", 1, ref="g2")
    assert (await client.debit("acme", 11, ref="d"))["balance_after"] == 0


async def test_a_ref_lands_once_and_a_reused_ref_conflicts(client: AsyncClient) -> None:
    first = await client.grant("acme", 10, ref="r")
    assert await client.grant("acme", 10, ref="r") == first
    d = await client.debit("acme", 4, ref="d")
    assert await client.debit("acme", 4, ref="d") == d
    with pytest.raises(Conflict, match="ref 'd' was already used"):
        await client.debit("acme", 5, ref="d")
    with pytest.raises(Conflict):
        await client.grant("acme", 4, ref="d")  # a grant under a debit's ref
    with pytest.raises(Conflict):
        await client.grant("acme", 10, ref="r", priority=1)
    # The first answer again even when the debit no longer fits.
    await client.debit("acme", 6, ref="all")
    assert await client.debit("acme", 4, ref="d") == d
    assert [e["ref"] for e in await _entries(client, "acme")] == ["r", "d", "all"]


async def test_an_expired_grant_stops_counting_without_touching_others(
    client: AsyncClient,
) -> None:
    soon = int(time.time()) + 1
    await client.grant("acme", 10, ref="keep")
    await client.grant("acme", 7, ref="soon", expires_at=soon)
    await client.debit("acme", 2, ref="d")  # taken from the expiring grant first
    while time.time() < soon:
        await asyncio.sleep(0.05)
    bal = await client.balance("acme")
    assert bal["available"] == 10
    assert [(g["seq"], g["remaining"]) for g in bal["grants"]] == [(1, 10)]
    entries = await _entries(client, "acme")
    assert [(e["kind"], e["amount"], e.get("grants")) for e in entries[3:]] == [
        ("expire", -5, [[2, 5]])
    ]
    assert sum(e["amount"] for e in entries) == 10
    # Written once: a second read adds nothing.
    await client.balance("acme")
    assert len(await _entries(client, "acme")) == 4


async def test_the_blocking_client_too(tmp: Path) -> None:
    cfg = _config(tmp)
    async with Node(cfg):

        def calls() -> None:
            with Client.connect(str(cfg.server.socket)) as c:
                g = c.grant("acme", 5)
                assert g["ref"].startswith("c-")  # made up by the client, reused on retries
                assert c.debit("acme", 3)["balance_after"] == 2
                assert c.balance("acme")["available"] == 2
                assert [e["kind"] for e in c.ledger_entries("acme", 1)] == ["grant", "debit"]
                assert c.ledger_page("acme", limit=1)["cursor"] == 1

        await asyncio.to_thread(calls)


@pytest.mark.parametrize(
    ("method", "params", "field"),
    [
        ("grant", ["acme", 0], "amount"),
        ("grant", ["acme", -1], "amount"),
        ("grant", ["acme", 2**63], "amount"),
        ("grant", ["acme", "5"], "amount"),
        ("grant", ["acme", 1.5], "amount"),
        ("grant", ["", 5], "tenant"),
        ("grant", ["a b", 5], "tenant"),
        ("grant", ["acme", 5, {"ref": ""}], "ref"),
        ("grant", ["acme", 5, {"ref": "x" * 129}], "ref"),
        ("grant", ["acme", 5, {"ref": 5}], "ref"),
        ("grant", ["acme", 5, {"priority": "high"}], "priority"),
        ("grant", ["acme", 5, {"expires_at": -1}], "expires_at"),
        ("grant", ["acme", 5, {"expires_at": 1.5}], "expires_at"),
        ("grant", ["acme", 5, {"colour": 1}], "grant: unknown option"),
        ("grant", ["acme", 5, [1]], "grant: opts must be a map"),
        ("grant", ["acme"], "grant takes 2 to 3 params"),
        ("debit", ["acme", 0], "amount"),
        ("debit", ["acme", 5, {"priority": 1}], "debit: unknown option"),
        ("balance", [], "balance takes 1 params"),
        ("balance", [7], "tenant"),
        ("ledger", ["acme", {"after": -1}], "after"),
        ("ledger", ["acme", {"limit": 0}], "limit"),
        ("ledger", ["acme", {"limit": 1001}], "limit"),
        ("ledger", ["acme", {"limit": "9"}], "limit"),
        ("ledger_timeline", [{"from": -1}], "ledger_timeline: from"),
        ("ledger_timeline", [{"to": "now"}], "ledger_timeline: to"),
        ("ledger_timeline", [{"to": 10**12}], "ledger_timeline: to"),
        ("ledger_timeline", [{"from": 5, "to": 4}], "ledger_timeline: to"),
        ("ledger_timeline", [{"cursor": 5}], "ledger_timeline: cursor"),
        ("ledger_timeline", [{"cursor": "nope"}], "ledger_timeline: cursor"),
        ("ledger_timeline", [{"limit": 0}], "limit"),
        ("ledger_timeline", [{"tenant": "acme"}], "ledger_timeline: unknown option"),
        ("ledger_timeline", [{}, {}], "ledger_timeline takes 0 to 1 params"),
    ],
)
async def test_bad_inputs_are_invalid_arguments_naming_the_field(
    client: AsyncClient, method: str, params: list[Any], field: str
) -> None:
    with pytest.raises(InvalidArgument, match=f"^{field}"):
        await client.call(method, *params)


async def test_the_timeline_pages_every_tenants_entries_in_time_order(
    client: AsyncClient,
) -> None:
    """Every tenant's changes (grants, a credit pool's funding) in the order they were
    written (to the millisecond), each with its tenant, paged without loss or repeat; ``from``
    and ``to`` bound it by the entries' times."""
    await client.set_limit("gpu", "api", None, price=2)
    written = []
    for n in range(9):
        tenant = ["acme", "beta", "acme/bob"][n % 3]
        got = await client.grant(tenant, 100 + n)
        written.append((tenant, got["seq"], "grant"))
        if n == 4:
            middle = time.time()
            await asyncio.sleep(0.01)
    await client.grant("gpu", 50)
    await client.track("gpu", "api", 3)  # (the pool's funding: a metered debit of gpu's)
    entries = [e async for e in client.ledger_timeline(page_size=2)]
    # In time order, entries of one millisecond by tenant, then sequence.
    order = [(e["time"], e["tenant"], e["seq"]) for e in entries]
    assert order == sorted(order) and len(set(order)) == len(order)
    assert sorted((e["tenant"], e["seq"], e["kind"]) for e in entries[:9]) == sorted(written)
    assert [(e["tenant"], e["kind"]) for e in entries[9:]] == [("gpu", "grant"), ("gpu", "metered")]
    later = [e async for e in client.ledger_timeline(start=middle)]
    assert later == [e for e in entries if e["time"] >= middle] and 0 < len(later) < len(entries)
    page = await client.ledger_timeline_page(end=middle, limit=100)
    assert page == {"entries": [e for e in entries if e["time"] < middle], "cursor": None}


async def test_storage_down_is_unavailable_and_the_retry_lands_once() -> None:
    store = MemoryStorage()
    book = LedgerStore(store, backoff_cap=0)
    await book.apply("acme", ledger.credit(10, "g"))
    store.ledger_down = True
    with pytest.raises(Unavailable, match="storage unreachable, nothing changed"):
        await book.apply("acme", ledger.debit(3, "d"))
    with pytest.raises(Unavailable):
        await book.balance("acme")
    store.ledger_down = False
    assert store.ledgers["acme"][0] == 1
    # The answer of the write lost, then the retry: once.
    store.ledger_lose_next = 1
    first = await book.apply("acme", ledger.debit(3, "d"))
    assert await book.apply("acme", ledger.debit(3, "d")) == first
    assert (await book.balance("acme"))["available"] == 7
    assert len(store.ledger_entries_["acme"]) == 2


async def test_through_a_node_storage_down_is_unavailable_and_a_client_retry_lands_once(
    tmp: Path,
) -> None:
    store = MemoryStorage()
    cfg = _config(tmp)
    async with Node(cfg, storage=store):
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        patient = await AsyncClient.connect(cfg.server.socket, retry_timeout=10)
        try:
            await c.grant("acme", 10, ref="g")
            store.ledger_down = True
            with pytest.raises(Unavailable, match="nothing changed"):
                await c.debit("acme", 4, ref="d")
            with pytest.raises(Unavailable):
                await c.balance("acme")
            # The client retries unavailable answers with the same ref until storage is back.
            hits = store.ledger_down_hits
            call = asyncio.create_task(patient.debit("acme", 4))
            deadline = time.monotonic() + 5
            while store.ledger_down_hits < hits + 2:  # refused, and asked again
                assert time.monotonic() < deadline and not call.done()
                await asyncio.sleep(0.01)
            store.ledger_down = False
            store.ledger_lose_next = 1  # and the first write's answer is lost
            got = await call
            assert got["balance_after"] == 6
            assert (await c.balance("acme"))["available"] == 6
            assert [e["kind"] for e in await _entries(c, "acme")] == ["grant", "debit"]
        finally:
            await c.close()
            await patient.close()


def test_cli_commands(tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp)
    sock = ["--socket", str(cfg.server.socket)]

    async def run() -> None:
        async with Node(cfg):

            def cli(*args: str) -> tuple[int, str]:
                code = cli_main([*args, *sock])
                return code, capsys.readouterr().out

            def both() -> None:
                assert cli("grant", "acme", "50", "--ref", "g1", "--priority", "2")[0] == 0
                code, out = cli("debit", "acme", "20", "--ref", "d1", "--json")
                assert code == 0 and json.loads(out)["balance_after"] == 30
                code, out = cli("balance", "acme")
                assert code == 0 and "acme: 30 available" in out
                code, out = cli("ledger", "acme", "--limit", "1", "--json")
                page = json.loads(out)
                assert [e["seq"] for e in page["entries"]] == [1] and page["cursor"] == 1
                code, out = cli("ledger", "acme", "--after", "1")
                assert code == 0 and "debit" in out and "d1" in out
                code, out = cli("ledger", "--all", "--from", "0")
                lines = out.splitlines()
                assert code == 0 and lines[0].startswith("TIME") and len(lines) == 3, out
                assert "acme" in lines[1] and "grant" in lines[1] and "debit" in lines[2], out
                code, out = cli("ledger", "--all", "--json", "--to", "1")
                assert code == 0 and out == ""  # (nothing written before 1970-01-01T00:00:01)
                assert cli("ledger", "acme", "--all")[0] == 2
                assert cli("ledger", "--from", "5")[0] == 2
                assert cli("debit", "acme", "31")[0] == 1  # insufficient_balance
                assert cli("grant", "acme", "0")[0] == 1  # invalid_argument

            await asyncio.to_thread(both)

    asyncio.run(run())


# -- DynamoDB Local through the lossy proxy -----------------------------------------------------


@pytest.mark.dynamodb
@pytest.mark.slow
async def test_through_lost_answers_every_acknowledged_change_lands_once(
    dynamodb_local: str,
) -> None:
    """A quarter of DynamoDB's answers dropped after the write landed: 4 writers (each its
    own storage client, like 4 nodes) grant and debit one tenant concurrently, retrying each
    change with its ref until it is answered. The entries are exactly the acknowledged
    changes, once each, and sum to the balance."""
    from urllib.parse import urlsplit

    from storage.dynamodb import DynamoDBStorage
    from tests.support.fixtures_dynamodb import create_table
    from tests.support.lossy_proxy import LossyProxy

    table = await create_table(dynamodb_local)
    port = urlsplit(dynamodb_local).port
    assert port is not None
    acked: dict[str, int] = {}
    refused: set[str] = set()
    async with LossyProxy(port, loss=0.25, seed=7) as proxy:
        stores = [
            DynamoDBStorage(table, endpoint_url=proxy.endpoint, retries=0, max_attempts=1)
            for _ in range(4)
        ]
        for s in stores:
            await s.open()
        try:

            async def writer(w: int) -> None:
                book = LedgerStore(stores[w], backoff_cap=0.02)
                rng = random.Random(w)
                for i in range(25):
                    ref = f"w{w}-{i}"
                    amount = rng.randint(1, 20)
                    op = ledger.credit(amount, ref) if i % 2 == 0 else ledger.debit(amount, ref)
                    while True:
                        try:
                            got = await book.apply("acme", op)
                        except Unavailable:
                            continue  # retried with the same ref
                        except InsufficientBalance:
                            refused.add(ref)
                            break
                        acked[ref] = got["amount"]
                        break

            await asyncio.gather(*(writer(w) for w in range(4)))
        finally:
            for s in stores:
                await s.close()
        assert proxy.lost > 10, proxy.lost  # the answers were really lost
    fresh = DynamoDBStorage(table, endpoint_url=dynamodb_local)
    await fresh.open()
    try:
        _, body = await fresh.ledger_read("acme")
        rows = await fresh.ledger_entries("acme", 0, 1000)
    finally:
        await fresh.close()
    state = ledger.decode_state(body)
    entries = [ledger.decode_entry(b) for _, b in rows]
    ledger.check(state, entries)
    assert {e.ref: e.amount for e in entries} == acked  # each acknowledged change, once
    assert len(entries) == len(acked) and not refused & set(acked)
    assert state.balance == sum(acked.values()) >= 0
