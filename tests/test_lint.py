"""The project's own lint and type checks run as part of the one test command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_ruff_clean() -> None:
    res = _run("ruff", "check", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_format_clean() -> None:
    res = _run("ruff", "format", "--check", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_clean() -> None:
    res = _run("mypy")
    assert res.returncode == 0, res.stdout + res.stderr
