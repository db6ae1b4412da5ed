"""Build: the hot modules compiled by mypyc when this machine can, else pure Python.

Everything else is in ``pyproject.toml``. ``METER_PURE_PYTHON=1`` at install time skips the
compiler. A build that cannot compile (no C compiler, no mypyc, a type error) installs pure
Python, says so in one line and records why in ``meter/_compiled.json``, which
``meter --version`` reads. See ADR 0011 and docs/performance.md ("Compiled build").
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _load_compiled() -> Any:
    """``meter/compiled.py`` alone (importing the package would run its ``__init__``)."""
    spec = importlib.util.spec_from_file_location("_meter_compiled", HERE / "meter/compiled.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


compiled = _load_compiled()
HOT_FILES = [str(compiled.source_path(m, Path())) for m in compiled.HOT]
INFO = Path("meter") / compiled.INFO_NAME
#: The build type-checks without the runtime dependencies (pip builds in an isolated env).
MYPY_ARGS = ["--ignore-missing-imports", "--no-warn-return-any", "--no-warn-unused-ignores"]
#: The commands that build extensions; the others (metadata, requirements) need none, and
#: mypyc's type check and C generation take seconds.
BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}
#: Commands that build into the source tree (an editable install).
INPLACE = {"editable_wheel", "develop", "--inplace", "-i"}
#: The digests of the sources as mypyc reads them (taken before it does).
SOURCES: dict[str, str] = {}
#: Why this build is pure Python, once known.
PURE: list[str] = []


def say(message: str) -> None:
    print(f"meter build: {message}", file=sys.stderr, flush=True)


def write_record(root: Path, record: dict[str, Any]) -> None:
    (root / INFO).parent.mkdir(parents=True, exist_ok=True)
    (root / INFO).write_text(json.dumps(record))


def remove_inplace_build() -> None:
    """An earlier compiled build in the source tree would shadow a pure one: remove it."""
    for module in [*compiled.HOT, compiled.GROUP_LIBRARY]:
        source = compiled.source_path(module, HERE)
        for built in source.parent.glob(source.stem + ".*.so"):
            built.unlink()


def go_pure(reason: str, root: Path | None) -> None:
    """Say why this build is pure; record it in ``root`` (the source tree when in place)."""
    say(f"pure Python ({reason})")
    PURE.append(reason)
    if root is not None:
        if root == HERE:
            remove_inplace_build()
        write_record(root, {"compiled": False, "reason": reason})


def extensions() -> list[Any]:
    args = set(sys.argv[1:])
    if not BUILDS & args:
        return []
    inplace = HERE if INPLACE & args else None
    value = os.environ.get(compiled.PURE_ENV, "")
    if value not in ("", "0"):
        go_pure(f"{compiled.PURE_ENV}={value} at install", inplace)
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        go_pure(f"mypyc is not installed: {exc}", inplace)
        return []
    SOURCES.update(compiled.source_digests(HERE))
    try:
        built = list(
            mypycify(
                [*MYPY_ARGS, *HOT_FILES], opt_level="3", group_name=compiled.GROUP, multi_file=True
            )
        )
    except (SystemExit, Exception) as exc:  # mypy reports type errors by exiting
        go_pure(f"mypyc could not compile: {exc!r}", inplace)
        return []
    for ext in built:  # multi_file puts the group's headers under the package's folder
        ext.include_dirs.append(os.path.join("build", *compiled.GROUP.split(".")[:-1]))
    return built


class BuildPy(build_py):
    """A wheel of a pure build carries the record of why it is pure."""

    def run(self) -> None:
        super().run()
        if PURE:
            write_record(Path(self.build_lib), {"compiled": False, "reason": PURE[0]})


class BuildExt(build_ext):
    """All or nothing: a module compiled while another failed would not import, so any
    failure (no C compiler, say) removes what was built and leaves pure Python. The C files
    of one extension compile on a few cores (distutils would take them one at a time)."""

    def build_extensions(self) -> None:
        cc = self.compiler
        workers = min(4, len(os.sched_getaffinity(0)))

        def compile_all(
            sources: list[str],
            output_dir: str | None = None,
            macros: Any = None,
            include_dirs: Any = None,
            debug: bool = False,
            extra_preargs: Any = None,
            extra_postargs: Any = None,
            depends: Any = None,
        ) -> list[str]:
            macros, objects, extra_postargs, pp_opts, build = cc._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs
            )
            cc_args = cc._get_cc_args(pp_opts, debug, extra_preargs)

            def one(obj: str) -> None:
                src, ext = build[obj]
                cc._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(one, objects))
            return list(objects)

        cc.compile = compile_all
        super().build_extensions()

    def run(self) -> None:
        if not self.extensions:  # a pure build (said and recorded already)
            return
        root = HERE if self.inplace else Path(self.build_lib)
        try:
            super().run()
        except Exception as exc:
            for built in self.get_outputs():
                Path(built).unlink(missing_ok=True)
            go_pure(f"the C build failed: {exc}", root)
            return
        from mypy.version import __version__ as mypy_version

        write_record(root, {"compiled": True, "mypy": mypy_version, "sources": SOURCES})
        say(f"compiled {len(HOT_FILES)} modules with mypyc {mypy_version}")


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt, "build_py": BuildPy})
