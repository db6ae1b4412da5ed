"""The documentation stays true: every test docs/correctness.md cites exists, and every
guarantee id is named once."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INDEX = ROOT / "docs" / "correctness.md"


@functools.cache  # (hundreds of citations name a few dozen files)
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


def test_every_test_named_alone_exists_in_the_file_cited_before_it() -> None:
    """A name cited without its file (``test_x.py::test_a``, then ``test_b``) is a test of the
    last file its line cited."""
    missing = []
    for line in INDEX.read_text().splitlines():
        file = None
        for cited_file, name in re.findall(r"`(?:(test_\w+\.py)(?:::\w+)?|(test_\w+))`", line):
            if cited_file:
                file = cited_file
            elif file is None:
                missing.append(f"{name} (no file cited before it)")
            elif (ROOT / "tests" / file).exists() and name not in _defined(ROOT / "tests" / file):
                missing.append(f"{file}::{name}")
    assert not missing, f"docs/correctness.md cites tests that do not exist: {missing}"


def test_guarantee_ids_are_unique() -> None:
    ids = re.findall(r"^\| ([A-Z]\d\d) \|", INDEX.read_text(), flags=re.M)
    assert ids and len(ids) == len(set(ids)), ids


def _named_paths(text: str) -> set[str]:
    return set(re.findall(r"\b((?:meter|storage|cluster|tests|bench)/[\w/]+\.py)\b", text))


def test_every_source_path_the_docs_name_exists() -> None:
    """A path like ``meter/core/table.py`` in README.md or docs/ names a file that is there
    (the layout moved once; a doc left behind would send a reader nowhere)."""
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for path in sorted(_named_paths(doc.read_text())):
            if not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, missing


def test_the_architecture_map_names_every_module() -> None:
    """docs/architecture.md's tree lists every module of meter/ (by its name in its package)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text[text.index("## The tree") : text.index("## What each layer may import")]
    unnamed = []
    for path in sorted((ROOT / "meter").rglob("*.py")):
        rel = path.relative_to(ROOT / "meter")
        if path.name == "__init__.py":
            name = rel.parent.name + "/" if rel.parent.name else "__init__"
        else:
            name = path.stem
        if name and not re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", tree):
            unnamed.append(str(rel))
    assert not unnamed, unnamed
