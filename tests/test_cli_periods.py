"""``meter period close`` and ``meter export``'s line on a period's close, from the shell,
against a real node (SQLite) on its socket (docs/invoicing.md; correctness F02)."""

from __future__ import annotations

import asyncio
import calendar
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from meter.cli.main import main
from meter.config import NodeConfig, ServerConfig
from meter.core.keys import period_start
from meter.node.lifecycle import Node
from storage.sqlite import SQLiteStorage
from tests.support.nodes import short_tmpdir

PAST = "2020-01"


@pytest.fixture
async def sock(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[str, str]]:
    """A node whose storage says node ``gone`` marked January 2020 open, and never closed it."""
    for name in list(os.environ):
        if name.startswith("METER_"):
            monkeypatch.delenv(name)
    d = short_tmpdir("mcp")
    cfg = NodeConfig(data_dir=d / "data", node_id="n1", server=ServerConfig(socket=d / "m.sock"))
    cfg.data_dir.mkdir(parents=True)
    storage = SQLiteStorage(cfg.data_dir / cfg.storage.sqlite_file)
    await storage.open()
    await storage.mark_period_open(PAST, "gone", calendar.timegm((2020, 1, 5, 0, 0, 0)))
    await storage.close()
    try:
        async with Node(cfg):
            yield str(cfg.server.socket), str(cfg.data_dir)
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def meter(node: tuple[str, str], *args: str) -> int:
    """``meter ARGS`` on the node's socket (``export``: on its data dir's storage)."""
    if args[0] == "export":
        argv = [*args, "--data-dir", node[1]]
    else:
        argv = [*args[:2], "--socket", node[0], *args[2:]]
    return await asyncio.to_thread(main, argv)


async def test_an_operator_closes_a_period_for_a_node_that_never_comes_back(
    sock: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The export names the node still open; ``meter period close`` closes it for that node
    (refusing a running node, a period that may still count and a bad name, changing
    nothing); the export is then final and says who closed it by hand."""
    out = str(tmp_path / "jan.csv")
    assert await meter(sock, "export", "--period", PAST, "--out", out) == 0
    err = capsys.readouterr().err
    assert f"meter: export: {PAST} is NOT final: nodes still open: gone (open since " in err
    refused = [
        (("period", "close", PAST, "--node", "n1"), "is running"),
        (("period", "close", period_start("month"), "--node", "gone"), "may still count"),
        (("period", "close", "2020-13", "--node", "gone"), "invalid_argument"),
    ]
    for args, why in refused:
        assert await meter(sock, *args) == 1
        assert why in capsys.readouterr().err
    assert await meter(sock, "export", "--period", PAST, "--out", out) == 0
    assert "is NOT final: nodes still open: gone" in capsys.readouterr().err
    assert await meter(sock, "period", "close", PAST, "--node", "gone") == 0
    assert capsys.readouterr().out.strip() == f"{PAST}: node gone closed (by operator)"
    assert await meter(sock, "export", "--period", PAST, "--out", out) == 0
    assert (
        f"meter: export: {PAST} is final: every node that counted in it closed it; closed by "
        "an operator for gone"
    ) in capsys.readouterr().err
