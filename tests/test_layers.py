"""The layout's rules, checked on the source (docs/architecture.md, "Rules"; ADR 0012).

Every import counts: module level, inside functions, under ``TYPE_CHECKING``. An import is
resolved to the module it names (``from meter.core import params`` is ``meter.core.params``);
a package's ``__init__`` importing its own parts is its public face, not an edge of design.
The checks: no import cycle anywhere in ``meter/``, ``storage/`` and ``cluster/``; no import
that goes up a layer; nothing of ``meter`` in ``storage/`` or ``cluster/``; the write-ahead
log's own narrower rule; compiled modules only in the request-path folders; and the size
figures of the layout issue. Each checker is also run on a planted tree to show it can fail.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from meter import compiled

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("meter", "cluster", "storage")

#: Layers, lowest first: a module may import its own layer and the ones below. The longest
#: matching prefix decides a module's layer.
LAYERS: dict[str, int] = {
    "storage": 0,
    "cluster": 0,
    # the base every layer uses: errors, the build, names and keys, plain counters
    "meter": 1,
    "meter.errors": 1,
    "meter.compiled": 1,
    "meter.core.keys": 1,
    "meter.core.counts": 1,
    "meter.config": 2,
    # the request path and the write-ahead log
    "meter.core": 3,
    "meter.wal": 3,
    # the features
    "meter.persist": 4,
    "meter.quotas": 4,
    "meter.ledger": 4,
    "meter.history": 4,
    "meter.ops": 4,
    "meter.http": 4,
    "meter.catalog": 4,
    "meter.node": 5,
    "meter.client": 6,
    "meter.cli": 6,
    "meter.__main__": 6,
}
#: What the write-ahead log may import of meter (its package docstring says so).
WAL_MAY_IMPORT = ("meter.errors", "meter.core.keys", "meter.core.counts", "meter.wal")
#: Where compiled modules may live (ADR 0011): the request path.
COMPILED_FOLDERS = ("meter.core.", "meter.wal.")


def modules(root: Path) -> dict[str, Path]:
    """Every module of :data:`PACKAGES` under ``root``: dotted name -> file."""
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path, mods: dict[str, Path]) -> Iterator[str]:
    """The modules ``module`` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found = _resolve(alias.name, mods)
                if found:
                    yield found
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                if node.level > 1:
                    up = up[: len(up) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                found = full if full in mods else _resolve(base, mods)
                if found:
                    yield found


def graph(root: Path) -> dict[str, set[str]]:
    """Import edges between the modules under ``root`` (a package's own face excluded)."""
    mods = modules(root)
    out: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for target in imports(module, path, mods):
            own_face = path.name == "__init__.py" and target.startswith(module + ".")
            if target != module and not own_face:
                out[module].add(target)
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def layer(module: str) -> int:
    """The layer of ``module`` (the longest prefix of :data:`LAYERS` it falls under)."""
    best = ""
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    assert best, f"{module} is in no layer: add its package to LAYERS"
    return LAYERS[best]


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Imports that go up a layer."""
    return sorted(
        f"{m} ({layer(m)}) -> {t} ({layer(t)})"
        for m, targets in edges.items()
        for t in targets
        if layer(t) > layer(m)
    )


def wal_outside(edges: dict[str, set[str]]) -> list[str]:
    """Imports of the write-ahead log outside what it may import."""
    return sorted(
        f"{m} -> {t}"
        for m, targets in edges.items()
        if m.startswith("meter.wal")
        for t in targets
        if t.startswith("meter")
        and not any(t == p or t.startswith(p + ".") for p in WAL_MAY_IMPORT)
    )


# -- the rules on this tree -------------------------------------------------------------------

EDGES = graph(ROOT)


def test_no_import_cycle() -> None:
    assert cycles(EDGES) == []


def test_no_import_goes_up_a_layer() -> None:
    assert upward(EDGES) == []


def test_storage_and_cluster_import_nothing_of_meter() -> None:
    below = [
        f"{m} -> {t}"
        for m, targets in EDGES.items()
        if m.split(".")[0] in ("storage", "cluster")
        for t in targets
        if t.split(".")[0] == "meter"
    ]
    assert below == []


def test_the_write_ahead_log_imports_only_errors_keys_and_counts() -> None:
    assert wal_outside(EDGES) == []


def test_every_module_is_in_a_layer() -> None:
    for module in EDGES:
        layer(module)  # raises for a module of a package LAYERS does not name


def test_compiled_modules_live_in_the_request_path_folders() -> None:
    mods = modules(ROOT)
    assert compiled.HOT, "nothing compiled"
    for name in compiled.HOT:
        assert name in mods, f"{name} is compiled but has no source"
        assert name.startswith(COMPILED_FOLDERS), f"{name} is compiled outside meter/core, wal"
    assert len(set(compiled.HOT)) == len(compiled.HOT)


def _figures(root: Path) -> dict[str, int]:
    mods = modules(root)
    flat = [
        m
        for m, p in mods.items()
        if m.count(".") == 1 and m.startswith("meter.") and p.name != "__init__.py"
    ]
    subpackages = [
        m
        for m, p in mods.items()
        if m.count(".") == 1 and m.startswith("meter.") and p.name == "__init__.py"
    ]
    largest_module = max(
        len(p.read_text().splitlines()) for m, p in mods.items() if m.startswith("meter")
    )
    largest_class = 0
    for m, p in mods.items():
        if not m.startswith("meter"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in node.body)
                largest_class = max(largest_class, n)
    return {
        "flat": len([m for m in flat if m != "meter.__main__"]),
        "subpackages": len(subpackages),
        "largest_module": largest_module,
        "largest_class": largest_class,
    }


def test_the_layout_figures() -> None:
    """At most 8 modules directly in meter/, at least 5 subpackages, no module over 1,200
    lines and no class over 50 methods (the layout issue's figures)."""
    f = _figures(ROOT)
    assert f["flat"] <= 8 and f["subpackages"] >= 5, f
    assert f["largest_module"] <= 1200 and f["largest_class"] <= 50, f


def _why_one(root: Path) -> list[str]:
    """Modules over about 600 lines and classes over about 30 methods whose docstring does not
    say why they are one thing (a paragraph starting ``Why one module:`` / ``Why one class:``)."""
    out = []
    for m, p in modules(root).items():
        if not m.startswith("meter"):
            continue
        text = p.read_text()
        tree = ast.parse(text)
        if len(text.splitlines()) > 600 and "Why one module:" not in (
            ast.get_docstring(tree) or ""
        ):
            out.append(f"{p.relative_to(root)}: {len(text.splitlines())} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in node.body)
                if n > 30 and "Why one class:" not in (ast.get_docstring(node) or ""):
                    out.append(f"{p.relative_to(root)}: class {node.name}, {n} methods")
    return out


def test_large_modules_and_classes_say_why_they_are_one_thing() -> None:
    assert _why_one(ROOT) == []


# -- each checker fails on a planted tree -----------------------------------------------------


def _plant(root: Path, files: dict[str, str]) -> Path:
    for package in PACKAGES:
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            if str(parent) != "." and not (root / parent / "__init__.py").exists():
                (root / parent / "__init__.py").write_text("")
        path.write_text(text)
    return root


def test_a_planted_cycle_fails(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "meter/quotas/a.py": "from meter.quotas import b\n",
            # hidden in a function, under TYPE_CHECKING: counted all the same
            "meter/quotas/b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from meter.quotas.c import C\n"
            ),
            "meter/quotas/c.py": "def f():\n    import meter.quotas.a\n",
        },
    )
    assert cycles(graph(root)) == [["meter.quotas.a", "meter.quotas.b", "meter.quotas.c"]]


def test_a_package_face_re_exporting_its_parts_is_not_a_cycle(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "meter/client/__init__.py": "from meter.client.calls import x\n",
            "meter/client/calls.py": "from meter.client import other\nx = 1\n",
            "meter/client/other.py": "",
        },
    )
    assert cycles(graph(root)) == []


def test_planted_upward_and_outward_imports_fail(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "meter/core/table.py": "from meter.quotas.limits import Limit\n",  # core -> feature
            "meter/quotas/limits.py": "from ..node import lifecycle\n",  # relative, upward
            "meter/node/lifecycle.py": "",
            "meter/wal/log.py": "from meter.core.table import CounterTable\n",
            "storage/base.py": "import meter.errors\n",
            "meter/errors.py": "",
        },
    )
    edges = graph(root)
    assert upward(edges) == [
        "meter.core.table (3) -> meter.quotas.limits (4)",
        "meter.quotas.limits (4) -> meter.node.lifecycle (5)",
        "storage.base (0) -> meter.errors (1)",
    ]
    assert wal_outside(edges) == ["meter.wal.log -> meter.core.table"]


def test_a_planted_large_module_without_its_reason_fails(tmp_path: Path) -> None:
    body = "\n".join(f"x{i} = {i}" for i in range(601))
    methods = "".join(f"    def m{i}(self) -> None: ...\n" for i in range(31))
    root = _plant(
        tmp_path,
        {
            "meter/core/big.py": '"""Big."""\n' + body + "\n",
            "meter/core/ok.py": '"""Big.\n\nWhy one module: it is.\n"""\n' + body + "\n",
            "meter/core/cls.py": f'class K:\n    """K."""\n\n{methods}',
        },
    )
    assert _why_one(root) == [
        "meter/core/big.py: 602 lines",
        "meter/core/cls.py: class K, 31 methods",
    ]


def test_the_package_faces_name_their_public_parts() -> None:
    """``meter.cli``, ``meter.node`` and ``python -m meter.cli`` keep the names the flat
    modules had (``from meter.node import Node`` and so on)."""
    import subprocess
    import sys

    from meter.cli import main
    from meter.cli.main import main as cli_main
    from meter.node import Node, build_storage
    from meter.node.lifecycle import Node as LifecycleNode
    from meter.node.wiring import build_storage as wiring_build_storage

    assert main is cli_main
    assert Node is LifecycleNode
    assert build_storage is wiring_build_storage
    out = subprocess.run(
        [sys.executable, "-m", "meter.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("meter ")
