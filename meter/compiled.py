"""Which build runs: the hot modules compiled by mypyc, or pure Python.

``setup.py`` compiles :data:`HOT` and writes ``meter/_compiled.json``: whether it compiled (or
why not) and the digest of every source the build type-checked. At import, :func:`choose`
runs the compiled modules only if all of them and their shared library are there and no
source changed since the build. Otherwise, or when ``METER_PURE_PYTHON`` is set, it makes
Python import all of :data:`HOT` from their ``.py`` files: compiled code calls its siblings
natively, so a mix would hold two copies of a class. This module is read by ``setup.py`` too:
it imports nothing but the standard library.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

#: Set (to anything but ``0``) to run pure Python even where a compiled build is installed.
PURE_ENV = "METER_PURE_PYTHON"
#: The request path, socket to table and log, chosen by profile (docs/performance.md).
HOT = (
    "meter.core.protocol",
    "meter.core.server",
    "meter.core.service",
    "meter.core.tracking",
    "meter.core.gate",
    "meter.core.reserving",
    "meter.core.journal",
    "meter.core.fence",
    "meter.core.keycache",
    "meter.core.dims",
    "meter.core.groups",
    "meter.core.missed",
    "meter.core.params",
    "meter.core.table",
    "meter.core.keys",
    "meter.core.idempotency",
    "meter.wal.log",
    "meter.wal.records",
)
#: The shared library holding the compiled code (``meter/_hot__mypyc.*.so``).
GROUP = "meter._hot"
GROUP_LIBRARY = GROUP + "__mypyc"
#: The packages whose sources the build type-checks: a change in any of them can break what
#: the compiled code assumes of the modules it calls.
PACKAGES = ("meter", "storage", "cluster")
INFO_NAME = "_compiled.json"
_PACKAGE = Path(__file__).resolve().parent
#: The folder holding ``meter/`` (and ``storage/``, ``cluster/``).
_ROOT = _PACKAGE.parent


@dataclass(frozen=True)
class Build:
    """What runs: ``compiled`` or not, the modules the install compiled, and why pure."""

    compiled: bool
    modules: tuple[str, ...]
    mypyc: str | None
    reason: str

    def describe(self) -> str:
        """One line for ``meter --version`` and the startup log."""
        if self.compiled:
            return f"compiled by mypyc {self.mypyc} ({len(self.modules)} modules)"
        return f"pure Python ({self.reason})"

    def to_json(self) -> dict[str, Any]:
        return {
            "compiled": self.compiled,
            "modules": list(self.modules),
            "mypyc": self.mypyc,
            "reason": self.reason or None,
            "summary": self.describe(),
        }


def source_path(module: str, root: Path = _ROOT) -> Path:
    """The ``.py`` file of ``module`` under ``root``."""
    return root.joinpath(*module.split(".")).with_suffix(".py")


def source_digests(root: Path = _ROOT) -> dict[str, str]:
    """``{relative path: sha256}`` of every source of :data:`PACKAGES` under ``root``."""
    out: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            out[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _built(module: str) -> bool:
    source = source_path(module)
    return any(source.with_suffix(s).exists() for s in importlib.machinery.EXTENSION_SUFFIXES)


def _read_info() -> dict[str, Any] | None:
    try:
        info = json.loads((_PACKAGE / INFO_NAME).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


class _SourceFirst:
    """A meta path finder that imports the listed modules from their ``.py`` files."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = frozenset(modules)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


def _compiled_reason(info: dict[str, Any]) -> str:
    """Why the compiled modules of a compiled install cannot run, or ``""``."""
    missing = [m for m in (*HOT, GROUP_LIBRARY) if not _built(m)]
    if missing:
        return f"compiled modules missing: {', '.join(missing)}"
    recorded = info.get("sources")
    if not isinstance(recorded, dict):
        return "the build record lists no sources"
    now = source_digests()
    changed = sorted(p for p in recorded.keys() | now.keys() if recorded.get(p) != now.get(p))
    if changed:
        return (
            f"source changed since the build: {', '.join(changed[:5])}"
            f"{' ...' if len(changed) > 5 else ''}; pip install -e . compiles it again"
        )
    return ""


def choose() -> Build:
    """Decide the build for this process (once, from ``meter/__init__``)."""
    info = _read_info()
    compiled_install = info is not None and info.get("compiled") is True
    modules = HOT if compiled_install else ()
    mypyc = str(info.get("mypy")) if compiled_install and info is not None else None
    wanted = os.environ.get(PURE_ENV, "")
    if wanted not in ("", "0"):
        reason = f"{PURE_ENV}={wanted}"
    elif info is None:
        reason = "not compiled at install"
        if any(_built(m) for m in (*HOT, GROUP_LIBRARY)):
            reason = "compiled files without a build record; pip install -e . builds again"
            print(f"meter: running pure Python: {reason}", file=sys.stderr)
    elif not compiled_install:
        reason = str(info.get("reason") or "not compiled at install")
    else:
        reason = _compiled_reason(info)
        if not reason:
            return Build(True, modules, mypyc, "")
        print(f"meter: running pure Python: {reason}", file=sys.stderr)
    # Whatever is on disk, none of it is imported (a stale or partial build included).
    sys.meta_path.insert(0, _SourceFirst(HOT))
    return Build(False, modules, mypyc, reason)


def running(build: Build) -> Build:
    """``build`` as the imported modules show it (a compiled module is an extension)."""
    if not build.compiled:
        return build
    loaded = [sys.modules.get(m) for m in build.modules]
    pure = [
        m
        for m, mod in zip(build.modules, loaded, strict=True)
        if mod is not None and not str(getattr(mod, "__file__", "")).endswith(".so")
    ]
    if pure:
        return Build(False, build.modules, build.mypyc, f"imported from source: {', '.join(pure)}")
    return build
