"""``usage_children`` (docs/protocol.md): an account's users' counters of one feature in one
period from one storage read per page, merged with what the node holds warm and has not
stored. A real node on SQLite (the storage side is in test_storage_contract.py on every
backend); the CLI's ``meter usage ACCOUNT FEATURE --children``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import AsyncIterator
from inspect import isawaitable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meter.cli.main import main
from meter.client import AsyncClient
from meter.config import CounterConfig, FlushConfig, NodeConfig, ServerConfig
from meter.core.table import CounterTable
from meter.errors import InvalidArgument
from meter.node.lifecycle import Node
from meter.node.wiring import build_service
from storage import periods
from storage.base import Applied, Delta
from storage.sqlite import SQLiteStorage
from tests.support.nodes import NodeProcess, short_tmpdir
from tests.support.stores import DownStorage

F = "calls"


def _config(d: Path, hierarchy: bool = True) -> NodeConfig:
    return NodeConfig(
        data_dir=d / "data",
        node_id="n1",
        server=ServerConfig(socket=d / "m.sock"),
        # Nothing is flushed while the test reads: the node's own units are in memory only.
        flush=FlushConfig(interval_ms=600_000),
        counters=CounterConfig(tenant_hierarchy=hierarchy),
    )


@pytest.fixture
async def workdir(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Path]:
    for name in list(os.environ):
        if name.startswith("METER_"):
            monkeypatch.delenv(name)
    d = short_tmpdir("mch")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def _store_before(cfg: NodeConfig, values: dict[str, int]) -> None:
    """Counters another node stored in this month, before this node starts."""
    cfg.data_dir.mkdir(parents=True)
    store = SQLiteStorage(cfg.data_dir / cfg.storage.sqlite_file)
    await store.open()
    try:
        month = periods.name(None, "month", time.time())
        got = await store.apply("old", [Delta((t, F, month), 1, v) for t, v in values.items()])
        assert all(isinstance(r, Applied) for r in got.values())
    finally:
        await store.close()


async def _all(c: AsyncClient, account: str, size: int) -> tuple[int, list[dict[str, Any]]]:
    """Every page of ``account``'s children, with ``size`` a page; the first page's total."""
    total: int | None = None
    out: list[dict[str, Any]] = []
    cursor = None
    at = time.time()
    while True:
        page = await c.usage_children_page(account, F, at, cursor, size)
        assert set(page) == {"total", "children", "cursor"}
        assert len(page["children"]) <= size and (page["children"] or page["cursor"] is None)
        total = page["total"] if total is None else total
        out += page["children"]
        cursor = page["cursor"]
        if cursor is None:
            assert total is not None
            return total, out


async def test_stored_and_warm_unstored_users_merge_in_tenant_order(workdir: Path) -> None:
    """Users only stored, stored with units on top the node has not stored, and only in the
    node's memory come in one list, whatever the page size; the account's total is its own
    counter (equal here to the sum of its users); a restart that stored everything answers
    the same from storage alone."""
    cfg = _config(workdir)
    stored = {"acme/u1": 10, "acme/u2": 20, "acme/u4": 40, "acme/team": 5, "acme/team/x": 5}
    await _store_before(cfg, {**stored, "acme": 75, "beta/u1": 9})
    want = [
        {"tenant": "acme/team", "value": 6},
        {"tenant": "acme/u1", "value": 10},
        {"tenant": "acme/u2", "value": 22},
        {"tenant": "acme/u3", "value": 3},
        {"tenant": "acme/u4", "value": 40},
    ]
    async with Node(cfg):
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        assert await c.track("acme/u2", F, 2) == 22
        assert await c.track("acme/u3", F, 3) == 3
        assert await c.track("acme/team/x", F, 1) == 6
        await c.track("acme/u9", F, 0)  # a user that counted nothing is not listed
        for size in (1, 2, 3, 100):
            assert await _all(c, "acme", size) == (81, want), size
        assert await _all(c, "acme/team", 10) == (6, [{"tenant": "acme/team/x", "value": 6}])
        assert await _all(c, "acme/u1", 10) == (10, [])
        assert await _all(c, "nobody", 10) == (0, [])
        last_month = periods.bounds(periods.name(None, "month", time.time()))[0] - 1
        page = await c.usage_children_page("acme", F, at=last_month)
        assert page == {"total": 0, "children": [], "cursor": None}
        await c.close()
    async with Node(cfg):  # (the drain stored every unit: each counter is read from storage)
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        assert await _all(c, "acme", 2) == (81, want)
        await c.close()


async def test_bad_calls_are_refused_and_change_nothing(workdir: Path) -> None:
    cfg = _config(workdir)
    async with Node(cfg):
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        await c.track("acme/a", F, 1)
        await c.set_feature("peak", aggregation="max")
        bad: list[tuple[list[Any], str]] = [
            (["acme", F, {"limit": 0}], "limit"),
            (["acme", F, {"limit": 1001}], "limit"),
            (["acme", F, {"limit": True}], "limit"),
            (["acme", F, {"limit": "5"}], "limit"),
            (["acme", F, {"cursor": "beta/x"}], "cursor"),
            (["acme", F, {"cursor": "acme/a/b"}], "cursor"),
            (["acme", F, {"cursor": 7}], "cursor"),
            (["acme", F, {"bogus": 1}], "bogus"),
            (["acme", F, {"at": "now"}], "at"),
            (["ac me", F], "tenant"),
            (["acme", "no such"], "feature"),
            (["acme", "peak"], "gauge"),
            (["acme"], "usage_children"),
        ]
        for params, word in bad:
            with pytest.raises(InvalidArgument, match=word):
                await c.call("usage_children", *params)
        assert await c.usage_children_page("acme", F) == {
            "total": 1,
            "children": [{"tenant": "acme/a", "value": 1}],
            "cursor": None,
        }
        await c.close()


async def test_without_the_hierarchy_it_is_refused(workdir: Path) -> None:
    cfg = _config(workdir, hierarchy=False)
    async with Node(cfg):
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        with pytest.raises(InvalidArgument, match="tenant_hierarchy"):
            await c.usage_children_page("acme", F)
        await c.close()


async def test_the_cli_lists_an_accounts_users(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _config(workdir)
    sock = str(cfg.server.socket)

    async def meter(*args: str) -> int:
        return await asyncio.to_thread(main, ["usage", "--socket", sock, *args])

    async with Node(cfg):
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        for n in range(1, 1_203):  # (more than one of the CLI's pages)
            await c.track(f"acme/u{n:04d}", F, n % 7)
        await c.close()
        capsys.readouterr()
        assert await meter("acme", F, "--children") == 0
        lines = capsys.readouterr().out.splitlines()
        listed = [(n, n % 7) for n in range(1, 1_203) if n % 7]
        assert lines[0] == f"acme {F}: {sum(v for _, v in listed)}"
        assert lines[1].split() == ["TENANT", "VALUE"]
        assert [line.split() for line in lines[2:]] == [[f"acme/u{n:04d}", str(v)]
                                                         for n, v in listed]  # fmt: skip
        assert await meter("acme", F, "--children", "--json") == 0
        got = json.loads(capsys.readouterr().out)
        assert got["total"] == sum(v for _, v in listed) and len(got["children"]) == len(listed)
        assert await meter("beta", F, "--children") == 0
        assert capsys.readouterr().out.splitlines() == [f"beta {F}: 0", "(no users in this period)"]
        assert await meter("acme", "--children") == 2
        assert "--children takes a feature" in capsys.readouterr().err


@pytest.mark.dynamodb
def test_nodes_on_dynamodb_keep_and_read_the_children_index(
    dynamodb_local: str, dynamodb_table: str
) -> None:
    """A node with the hierarchy on writes its users' counters to the index as it flushes;
    another node, holding none of them, reads them from it (and its own, warm)."""
    env = {
        "METER_STORAGE": "dynamodb",
        "METER_DYNAMODB_ENDPOINT": dynamodb_local,
        "METER_DYNAMODB_TABLE": dynamodb_table,
        "METER_TENANT_HIERARCHY": "true",
    }
    d = short_tmpdir("mchd")
    try:
        with NodeProcess(d, "a", METER_NODE_ID="a", **env) as a:
            a.call("track", "acme/b", F, 4)
            a.call("track", "acme/a", F, 3)
        with NodeProcess(d, "b", METER_NODE_ID="b", **env) as b:
            b.call("track", "acme/c", F, 5)
            want = [("acme/a", 3), ("acme/b", 4), ("acme/c", 5)]
            page = b.call("usage_children", "acme", F, {"limit": 2})
            assert page["total"] == 12, page
            assert [(c["tenant"], c["value"]) for c in page["children"]] == want[:2]
            rest = b.call("usage_children", "acme", F, {"cursor": page["cursor"]})
            assert [(c["tenant"], c["value"]) for c in rest["children"]] == want[2:]
            assert rest["cursor"] is None
    finally:
        shutil.rmtree(d, ignore_errors=True)


_USERS = [f"acme/u{n}" for n in range(8)]


@settings(max_examples=60, deadline=None)
@given(
    stored=st.dictionaries(st.sampled_from(_USERS), st.integers(-3, 9), max_size=8),
    tracks=st.lists(
        st.tuples(st.sampled_from(_USERS), st.integers(-3, 5), st.booleans()), max_size=20
    ),
    size=st.integers(1, 4),
)
def test_pages_hold_every_user_once_whatever_is_stored_warm_or_unseeded(
    stored: dict[str, int], tracks: list[tuple[str, int, bool]], size: int
) -> None:
    """A model: users stored by another node, tracked here with storage up (warm, seeded) or
    down (warm, unseeded: read at the page), to 0 too; every page size lists each user that
    is stored or not at 0 once, in order, with stored + tracked, and the account's total."""

    async def run() -> tuple[int, list[tuple[str, int]]]:
        store = DownStorage()
        month = periods.name(None, "month", time.time())
        got = await store.apply(
            "old",
            [Delta((t, F, month), 1, v) for t, v in stored.items()]
            + [Delta(("acme", F, month), 1, sum(stored.values()))],
        )
        assert all(isinstance(r, Applied) for r in got.values())
        svc = build_service(CounterTable("n1"), store, CounterConfig(tenant_hierarchy=True))
        for user, qty, down in tracks:
            store.down = down
            result = svc.dispatch("track", [user, F, qty])
            if isawaitable(result):
                await result
        store.down = False
        total: int | None = None
        out: list[tuple[str, int]] = []
        cursor = None
        while True:
            opts: dict[str, Any] = {"limit": size}
            if cursor is not None:
                opts["cursor"] = cursor
            page = svc.dispatch("usage_children", ["acme", F, opts])
            page = await page if isawaitable(page) else page
            total = page["total"] if total is None else total
            assert total == page["total"]
            out += [(c["tenant"], c["value"]) for c in page["children"]]
            cursor = page["cursor"]
            if cursor is None:
                assert total is not None
                return total, out

    total, listed = asyncio.run(run())
    tracked: dict[str, int] = {}
    for user, qty, _ in tracks:
        tracked[user] = tracked.get(user, 0) + qty
    want = sorted(
        (u, stored.get(u, 0) + tracked.get(u, 0))
        for u in set(stored) | set(tracked)
        if u in stored or tracked.get(u, 0) != 0
    )
    assert listed == want
    assert total == sum(stored.values()) + sum(tracked.values())
