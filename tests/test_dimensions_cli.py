"""The dimension commands and flags of ``meter`` against a real node (docs/dimensions.md):
``feature set|show``, ``track --dim``, ``usage --group-by|--where``, ``limit set|clear
--where``, ``plan set 'feature{name=value}=N'``, ``history --where``, ``export`` and the
errors of bad flags."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from meter.cli.main import main
from meter.client import Client
from meter.core.keys import period_start
from tests.support.nodes import NodeProcess, wait_for


@pytest.fixture
def node(workdir: Path) -> Iterator[NodeProcess]:
    with NodeProcess(workdir, METER_FLUSH_INTERVAL_MS="50") as n:
        yield n


def run(node: NodeProcess, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main([*args, "--socket", str(node.socket)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_the_commands_declare_count_group_and_limit_by_dimension(
    node: NodeProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = run(node, capsys, "feature", "show", "tokens")
    assert code == 0 and "not declared" in text and "no dimensions" in text
    code, text = run(
        node, capsys, "feature", "set", "tokens", "--dim", "model", "--dim", "region",
        "--max-combinations", "50",
    )  # fmt: skip
    assert code == 0 and "dimensions model, region" in text and "at most 50" in text, text
    code, text = run(node, capsys, "feature", "show", "tokens", "--json")
    assert json.loads(text)["dimensions"] == ["model", "region"]

    assert run(node, capsys, "track", "acme", "tokens", "10", "--dim", "model=gpt-4",
               "--dim", "region=eu")[1].strip() == "10"  # fmt: skip
    assert run(node, capsys, "track", "acme", "tokens", "5", "--dim", "model=o=1")[1] == "15\n"
    assert run(node, capsys, "track", "acme", "tokens", "1")[1] == "16\n"
    code, text = run(node, capsys, "usage", "acme", "tokens", "--group-by", "model")
    assert code == 0
    assert text.splitlines() == [
        "MODEL  VALUE",
        "gpt-4  10",
        "o=1    5",
        "-      1",
        "total 16 ('-': calls that gave no value of it)",
    ]
    code, text = run(node, capsys, "usage", "acme", "tokens", "--group-by", "model",
                     "--group-by", "region", "--json")  # fmt: skip
    got = json.loads(text)
    assert got["total"] == 16 and sum(g["value"] for g in got["groups"]) == 16
    assert run(node, capsys, "usage", "acme", "tokens", "--where", "model=o=1")[1] == "5\n"

    code, text = run(node, capsys, "limit", "set", "acme", "tokens", "12", "--where",
                     "model=gpt-4")  # fmt: skip
    assert code == 0 and "acme tokens{model=gpt-4}: hard limit 12" in text, text
    code, text = run(node, capsys, "track", "acme", "tokens", "3", "--dim", "model=gpt-4")
    assert code == 1 and "limit_exceeded" in text and "tokens{model=gpt-4}" in text, text
    code, text = run(node, capsys, "limits", "acme")
    assert "tokens{model=gpt-4}" in text
    code, text = run(node, capsys, "limit", "clear", "acme", "tokens", "--where", "model=gpt-4")
    assert code == 0 and "override cleared" in text
    assert run(node, capsys, "track", "acme", "tokens", "3", "--dim", "model=gpt-4")[0] == 0

    code, text = run(node, capsys, "plan", "set", "pro", "tokens{model=o=1}=6", "tokens=100")
    assert code == 0, text
    run(node, capsys, "plan", "assign", "acme", "pro")
    code, text = run(node, capsys, "track", "acme", "tokens", "2", "--dim", "model=o=1")
    assert code == 1 and "limit_exceeded" in text, text

    code, text = run(node, capsys, "history", "acme", "tokens", "--where", "model=gpt-4",
                     "--days", "1", "--json")  # fmt: skip
    assert code == 0 and json.loads(text)["history"][-1][1] == 13

    # Stored (flushed every 50 ms), the export names each dimension counter's values.
    month = period_start("month")

    def exported() -> dict[tuple[tuple[str, str], ...], int]:
        with Client.connect(node.socket) as c:
            return {tuple(sorted(r.dims.items())): r.total for r in c.export(month)}

    want = {(): 19, (("model", "gpt-4"),): 13, (("model", "o=1"),): 5,
            (("region", "eu"),): 10, (("model", "gpt-4"), ("region", "eu")): 10}  # fmt: skip
    wait_for(lambda: exported() == want, 10, "the dimension counters stored")


def test_bad_dimension_flags_exit_2_and_send_nothing(
    node: NodeProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    run(node, capsys, "feature", "set", "tokens", "--dim", "model")
    for args in [
        ("track", "acme", "tokens", "1", "--dim", "model"),
        ("track", "acme", "tokens", "1", "--dim", "=x"),
        ("usage", "acme", "tokens", "--where", "model"),
        ("limit", "set", "acme", "tokens", "5", "--where", "nothing"),
        ("limit", "clear", "acme", "tokens", "--where", "nothing"),
    ]:
        code, text = run(node, capsys, *args)
        assert code == 2 and "NAME=VALUE" in text, (args, text)
    code, text = run(node, capsys, "usage", "acme", "tokens", "--where", "model=a",
                     "--group-by", "model")  # fmt: skip
    assert code == 2 and "not both" in text
    code, text = run(node, capsys, "track", "acme", "tokens", "1", "--dim", "model=a",
                     "--dim", "model=b")  # fmt: skip
    assert code == 2 and "'model' given twice" in text
    # What `feature set` is not given stays as declared; --no-dims drops the dimensions.
    run(node, capsys, "feature", "set", "tokens", "--max-combinations", "7")
    got = json.loads(run(node, capsys, "feature", "show", "tokens", "--json")[1])
    assert (got["dimensions"], got["max_combinations"]) == (["model"], 7)
    run(node, capsys, "feature", "set", "tokens", "--no-dims")
    got = json.loads(run(node, capsys, "feature", "show", "tokens", "--json")[1])
    assert (got["dimensions"], got["max_combinations"]) == ([], 7)
    code, text = run(node, capsys, "track", "acme", "tokens", "1", "--dim", "tier=x")
    assert code == 1 and "invalid_argument" in text and "declares no dimensions" in text
    code, text = run(node, capsys, "feature", "set", "tokens", "--aggregation", "median")
    assert code == 1 and "aggregation must be one of" in text
    assert run(node, capsys, "usage", "acme", "tokens")[1] == "0\n"


def test_a_gauge_is_declared_observed_and_read_from_the_command_line(
    node: NodeProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = run(node, capsys, "feature", "set", "peak_gb", "--aggregation", "max")
    assert code == 0 and "peak_gb: max, no dimensions" in text, text
    assert run(node, capsys, "track", "acme", "peak_gb", "40")[1] == "40\n"
    assert run(node, capsys, "track", "acme", "peak_gb", "25")[1] == "40\n"
    assert run(node, capsys, "usage", "acme", "peak_gb")[1] == "40\n"
    code, text = run(node, capsys, "feature", "set", "peak_gb", "--aggregation", "sum")
    assert code == 1 and "conflict" in text and "cannot change" in text
    code, text = run(node, capsys, "feature", "set", "peak_gb", "--dim", "region")
    assert code == 1 and "not supported yet" in text


def test_a_reservation_with_dimensions_from_the_command_line(
    node: NodeProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(node, capsys, "feature", "set", "calls", "--dim", "model")[0] == 0
    code, text = run(node, capsys, "reserve", "acme", "calls", "30", "--dim", "model=o1")
    assert code == 0, text
    lease = text.strip()
    assert run(node, capsys, "commit", lease, "12")[1] == "12\n"
    assert run(node, capsys, "usage", "acme", "calls", "--where", "model=o1")[1] == "12\n"
    code, text = run(node, capsys, "reserve", "acme", "calls", "1", "--dim", "model")
    assert code == 2 and "--dim" in text
    code, text = run(node, capsys, "reserve", "acme", "calls", "1", "--dim", "colour=red")
    assert code == 1 and "colour" in text
