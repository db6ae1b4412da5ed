"""``meter plan / limit / limits / check`` against a real node (SQLite) on its socket.

``main()`` runs in a worker thread (its client is blocking) while the node runs on the test's
event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from meter.cli.main import main
from meter.client import AsyncClient
from meter.config import NodeConfig, ServerConfig
from meter.errors import LimitExceeded
from meter.node.lifecycle import Node
from storage import periods
from tests.support.nodes import short_tmpdir


@pytest.fixture
async def sock(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    for name in list(os.environ):
        if name.startswith("METER_"):
            monkeypatch.delenv(name)
    d = short_tmpdir("mcl")
    cfg = NodeConfig(data_dir=d / "data", node_id="n1", server=ServerConfig(socket=d / "m.sock"))
    try:
        async with Node(cfg):
            yield str(cfg.server.socket)
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def meter(sock: str, *args: str) -> int:
    where = 2 if args[0] in ("plan", "limit") else 1  # after the (sub)command
    argv = [*args[:where], "--socket", sock, *args[where:]]
    return await asyncio.to_thread(main, argv)


async def test_plans_and_limits_from_the_shell(
    sock: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await meter(sock, "plan", "set", "pro", "api=100", "gpu=60:soft") == 0
    assert await meter(sock, "plan", "assign", "acme", "pro") == 0
    assert await meter(sock, "limit", "set", "acme", "api", "5") == 0
    capsys.readouterr()
    assert await meter(sock, "limits", "acme") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "tenant acme, plan pro, limits version 3"
    assert out[1].split() == ["FEATURE", "LIMIT", "KIND", "SOURCE"]
    assert out[2].split() == ["api", "5", "hard", "override"]
    assert out[3].split() == ["gpu", "60", "soft", "plan:pro"]
    # The node enforces what the shell set.
    c = await AsyncClient.connect(sock, retry_timeout=0)
    try:
        await c.track("acme", "api", 5)
        with pytest.raises(LimitExceeded):
            await c.track("acme", "api", 1)
    finally:
        await c.close()
    assert await meter(sock, "check", "acme", "api") == 1  # refused: exit 1
    assert capsys.readouterr().out.startswith("REFUSED: 5 + 1 of hard limit 5 (0 remaining")
    assert await meter(sock, "check", "acme", "api", "0", "--json") == 0
    assert json.loads(capsys.readouterr().out)["allowed"] is True
    assert await meter(sock, "limit", "clear", "acme", "api", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {
        "tenant": "acme",
        "feature": "api",
        "version": 4,
    }
    assert await meter(sock, "limit", "set", "acme", "gpu", "9", "--soft") == 0
    assert await meter(sock, "plan", "unassign", "acme") == 0
    capsys.readouterr()
    assert await meter(sock, "limits", "acme", "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["plan"] is None
    assert got["limits"] == {
        "gpu": {"limit": 9, "kind": "soft", "enforcement": "fast", "source": "override"}
    }


async def test_prices_from_the_shell(sock: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``meter plan set --price`` and ``meter limit set --price`` set a feature's price in
    credits a unit, with or without a limit; the node then charges it (no credits:
    ``insufficient_balance``, exit 1); ``meter limits`` shows it."""
    assert await meter(sock, "plan", "set", "pro", "api=100", "--price", "gpu=5") == 0
    assert await meter(sock, "plan", "assign", "acme", "pro") == 0
    assert await meter(sock, "limit", "set", "acme", "api", "50", "--price", "2") == 0
    assert await meter(sock, "limit", "set", "acme", "tokens", "--price", "3", "--json") == 0
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[-1])["price"] == 3 and json.loads(out[-1])["kind"] is None
    words = ["tokens{model=gpt-4}=5000", "--price", "tokens{model=gpt-4}=7", "--price", "gpu=1"]
    assert await meter(sock, "plan", "set", "dims", *words) == 0
    capsys.readouterr()
    assert await meter(sock, "limits", "acme", "--json") == 0
    got = json.loads(capsys.readouterr().out)["limits"]
    assert (got["gpu"]["price"], got["api"]["price"], got["tokens"]["price"]) == (5, 2, 3)
    assert got["api"]["limit"] == 50 and got["gpu"]["source"] == "plan:pro"
    assert await meter(sock, "limits", "acme") == 0
    table = capsys.readouterr().out
    assert "price 5 credits a unit" in table
    assert [line.split()[1] for line in table.splitlines() if line.startswith("tokens")] == ["-"]
    assert await meter(sock, "track", "acme", "gpu", "1") == 1
    assert "insufficient_balance" in capsys.readouterr().err


async def test_a_billing_cycle_from_the_shell(
    sock: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``meter plan assign --anchor-day --tz`` stores the tenant's cycle (shown by
    ``meter limits --json``), from the end of its current period; ``--now`` a minute on."""
    assert await meter(sock, "plan", "set", "pro", "api=100") == 0
    args = ["plan", "assign", "acme", "pro", "--anchor-day", "15", "--tz", "America/New_York"]
    assert await meter(sock, *args) == 0
    assert await meter(sock, "plan", "assign", "bob", "pro", "--tz", "Asia/Tokyo", "--now") == 0
    capsys.readouterr()
    assert await meter(sock, "limits", "acme", "--json") == 0
    (change,) = json.loads(capsys.readouterr().out)["cycle"]
    assert (change["anchor_day"], change["tz"]) == (15, "America/New_York")
    assert change["from"] == periods.bounds(periods.name(None, "month", time.time() + 60))[1]
    assert await meter(sock, "limits", "bob", "--json") == 0
    (change,) = json.loads(capsys.readouterr().out)["cycle"]
    assert (change["anchor_day"], change["tz"]) == (1, "Asia/Tokyo")
    assert time.time() + 58 <= change["from"] <= time.time() + 61
    assert await meter(sock, "limits", "acme") == 0
    assert ", billing cycle day 15 00:00 America/New_York from " in capsys.readouterr().out
    args = ["plan", "assign", "carol", "pro", "--anchor-time", "09:30", "--tz", "Europe/Paris"]
    assert await meter(sock, *args) == 0
    capsys.readouterr()
    assert await meter(sock, "limits", "carol", "--json") == 0
    (change,) = json.loads(capsys.readouterr().out)["cycle"]
    assert (change["anchor_day"], change["anchor_time"], change["tz"]) == (
        1,
        "09:30",
        "Europe/Paris",
    )


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["plan", "set", "pro", "api"], 2, "expected FEATURE=LIMIT"),
        (["plan", "set", "pro", "api=ten"], 2, "LIMIT must be an integer"),
        (["plan", "set", "pro", "api=1:medium"], 2, "expected FEATURE=LIMIT"),
        (["plan", "set", "pro", "api=1", "api=2"], 2, "given twice"),
        (["plan", "set", "pro", "api=-1"], 1, "invalid_argument"),
        (["plan", "assign", "acme", "nope"], 1, "not_found"),
        (["limit", "set", "acme", "api", "10", "--strict", "--soft"], 1, "cannot be strict"),
        (["plan", "set", "pro", "api=1:lax"], 2, "expected FEATURE=LIMIT"),
        (["limit", "set", "bad tenant", "api", "10"], 1, "invalid_argument"),
        (["plan", "set", "pro", "api=10@80,x"], 2, "alerts after @ must be integer"),
        (["plan", "set", "pro", "api=10@"], 2, "alerts after @ must be integer"),
        (["plan", "set", "pro", "api=10:soft@80,80"], 1, "alerts lists 80 twice"),
        (["limit", "set", "acme", "api", "10", "--alert", "0"], 1, "alerts must be 1..1000"),
        (["plan", "assign", "acme", "pro", "--anchor-day", "32"], 1, "anchor day must be"),
        (["plan", "assign", "acme", "pro", "--tz", "Mars/Base"], 1, "not a known IANA zone"),
        (
            ["plan", "assign", "acme", "pro", "--now"],
            2,
            "--now needs --anchor-day, --anchor-time or --tz",
        ),
        (["plan", "assign", "acme", "pro", "--anchor-time", "9:30"], 1, "HH:MM"),
        (["plan", "set", "pro", "--price", "gpu"], 2, "expected FEATURE=CREDITS"),
        (["plan", "set", "pro", "--price", "gpu=x"], 2, "CREDITS must be an integer"),
        (["plan", "set", "pro", "--price", "gpu=1", "--price", "gpu=2"], 2, "given twice"),
        (["plan", "set", "pro"], 2, "at least one FEATURE=LIMIT or --price"),
        (["plan", "set", "pro", "--price", "gpu=0"], 1, "price must be 1.."),
        (["limit", "set", "acme", "api"], 2, "give a LIMIT, a --price, or both"),
        (["limit", "set", "acme", "api", "--price", "-1"], 1, "price must be 1.."),
    ],
)
async def test_bad_input_from_the_shell_says_what_is_wrong(
    sock: str, capsys: pytest.CaptureFixture[str], args: list[str], code: int, message: str
) -> None:
    assert await meter(sock, *args) == code
    assert message in capsys.readouterr().err


async def test_alert_thresholds_from_the_shell(
    sock: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await meter(sock, "plan", "set", "pro", "api=1000:soft@80,100", "gpu=6@50") == 0
    assert await meter(sock, "plan", "assign", "acme", "pro") == 0
    assert await meter(sock, "limit", "set", "acme", "seats", "9", "--alert", "90",
                       "--alert", "50", "--json") == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["alerts"] == [90, 50]
    assert await meter(sock, "limits", "acme", "--json") == 0
    got = json.loads(capsys.readouterr().out)["limits"]
    assert got["api"]["alerts"] == [80, 100] and got["api"]["kind"] == "soft"
    assert got["gpu"]["alerts"] == [50] and got["seats"]["alerts"] == [50, 90]
    assert await meter(sock, "limits", "acme") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].split()[-4:] == ["alerts", "at", "80,100", "%"]


def test_meter_alerts_prints_one_line_per_alert() -> None:
    from meter.cli.counting import _alert_line

    line = _alert_line({"id": "ab", "tenant": "acme", "feature": "api", "period": "2026-11",
                        "threshold": 80, "threshold_units": 800, "limit": 1000, "value": 801,
                        "node": "n1", "at": 0.0})  # fmt: skip
    assert line == (
        "1970-01-01T00:00:00Z  acme/api (2026-11) reached 80% of 1000: 801 >= 800  id ab (node n1)"
    )


def test_a_limit_that_is_not_a_number_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["limit", "set", "acme", "api", "lots"])
    assert info.value.code == 2
    assert "invalid int value" in capsys.readouterr().err


def test_the_docs_name_every_limits_command() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "quotas.md").read_text()
    commands = ["plan set", "plan assign", "plan unassign", "limit set", "limit clear"]
    for command in [*commands, "limits", "check", "alerts"]:
        assert f"`meter {command}" in text, command
