"""The ``ledger`` bench scenario runs and reports its one judged row (smoke sizes)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from bench.cli import run
from bench.harness import SMOKE
from bench.ledger_cost import LEDGER

pytestmark = [pytest.mark.dynamodb, pytest.mark.slow]


def test_the_ledger_scenario_runs(tmp_path: Path) -> None:
    out = io.StringIO()
    doc = run(SMOKE, ["ledger"], results_dir=tmp_path, out=out)
    assert not doc["failures"], doc["failures"]
    (row,) = [r for r in doc["rows"] if r["scenario"] == LEDGER]
    assert row["target"] == ">= 0.9x"
    assert row["ours"] > 0 and row["reference"] > 0
    assert row["detail"]["errors"] == 0 and row["detail"]["bare_errors"] == 0
