"""Which build runs: the hot modules compiled by mypyc, or pure Python.

``setup.py`` compiles the modules it lists and records each one's source digest in
``meter/_compiled.json``. At import, :func:`choose` runs the compiled modules only if every one
is built and none of their sources changed since; otherwise, or when ``METER_PURE_PYTHON`` is
set, it makes Python import those modules from their ``.py`` files (all of them: compiled code
calls its siblings natively, so a mix would hold two copies of a class).
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
_PACKAGE = Path(__file__).resolve().parent
#: The folder holding ``meter/`` (and ``storage/``, ``cluster/``).
_ROOT = _PACKAGE.parent
_INFO = _PACKAGE / "_compiled.json"


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


def _source(module: str) -> Path:
    return _ROOT.joinpath(*module.split(".")).with_suffix(".py")


def _built(module: str) -> bool:
    source = _source(module)
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    return any(source.with_suffix(s).exists() for s in suffixes)


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _read_info() -> dict[str, Any] | None:
    try:
        info = json.loads(_INFO.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("modules"), dict):
        return None
    return info


class _SourceFirst:
    """A meta path finder that imports the listed modules from their ``.py`` files."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = frozenset(modules)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname, _source(fullname))


def choose() -> Build:
    """Decide the build for this process (once, from ``meter/__init__``)."""
    info = _read_info()
    if info is None:
        return Build(False, (), None, "not compiled at install")
    digests: dict[str, Any] = info["modules"]
    modules = tuple(digests)
    mypyc = str(info.get("mypy"))
    wanted = os.environ.get(PURE_ENV, "")
    if wanted not in ("", "0"):
        reason = f"{PURE_ENV}={wanted}"
    else:
        missing = [m for m in modules if not _built(m)]
        stale = [m for m in modules if _digest(_source(m)) != digests[m]]
        if not missing and not stale:
            return Build(True, modules, mypyc, "")
        if missing:
            reason = f"compiled modules missing: {', '.join(missing)}"
        else:
            reason = (
                f"source changed since the build: {', '.join(stale)}; "
                "pip install -e . compiles it again"
            )
        print(f"meter: running pure Python: {reason}", file=sys.stderr)
    sys.meta_path.insert(0, _SourceFirst(modules))
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
