"""The documentation stays true: every test docs/correctness.md cites exists, and every
guarantee id is named once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INDEX = ROOT / "docs" / "correctness.md"


def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):  # TestX = Machine.TestCase
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_every_cited_test_exists() -> None:
    text = INDEX.read_text()
    cited = re.findall(r"`(test_\w+\.py)(?:::(\w+))?", text)
    assert len(cited) > 30
    missing = []
    for file, name in cited:
        path = ROOT / "tests" / file
        if not path.exists():
            missing.append(file)
        elif name and name not in _defined(path):
            missing.append(f"{file}::{name}")
    assert not missing, f"docs/correctness.md cites tests that do not exist: {missing}"


def test_guarantee_ids_are_unique() -> None:
    ids = re.findall(r"^\| ([A-Z]\d\d) \|", INDEX.read_text(), flags=re.M)
    assert ids and len(ids) == len(set(ids)), ids
