"""Build: the hot modules compiled by mypyc when this machine can, else pure Python.

Everything else is in ``pyproject.toml``. ``METER_PURE_PYTHON=1`` at install time skips the
compiler. A build that cannot compile (no C compiler, no mypyc, a type error) installs pure
Python and says so in one line; ``meter --version`` says which build runs. See
docs/performance.md ("Compiled build") for how the modules were chosen.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
#: The request path, socket to table and log, chosen by profile (docs/performance.md).
HOT = [
    "meter/protocol.py",
    "meter/server.py",
    "meter/service.py",
    "meter/table.py",
    "meter/keys.py",
    "meter/idempotency.py",
    "meter/wal/log.py",
    "meter/wal/records.py",
]
#: The shared library holding the compiled code: ``meter/_hot__mypyc.*.so``.
GROUP = "meter._hot"
#: Written beside the compiled modules; ``meter.compiled`` reads it at import.
INFO = "meter/_compiled.json"
#: The build type-checks without the runtime dependencies (pip builds in an isolated env).
MYPY_ARGS = ["--ignore-missing-imports", "--no-warn-return-any", "--no-warn-unused-ignores"]


def say(message: str) -> None:
    print(f"meter build: {message}", file=sys.stderr, flush=True)


def module(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def remove_inplace_build() -> None:
    """An earlier compiled build in the source tree would shadow a pure one: remove it."""
    (HERE / INFO).unlink(missing_ok=True)
    for path in [*HOT, GROUP.replace(".", "/") + "__mypyc.py"]:
        for built in (HERE / path).parent.glob(Path(path).stem + ".*.so"):
            built.unlink()


def pure_wanted() -> str | None:
    value = os.environ.get("METER_PURE_PYTHON", "")
    return f"METER_PURE_PYTHON={value}" if value not in ("", "0") else None


#: The commands that build extensions; the others (metadata, requirements) need none, and
#: mypyc's type check and C generation take seconds.
BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


def extensions() -> list[Any]:
    if not BUILDS & set(sys.argv[1:]):
        return []
    reason = pure_wanted()
    if reason is None:
        try:
            from mypyc.build import mypycify
        except ImportError as exc:
            reason = f"mypyc is not installed ({exc})"
    if reason is not None:
        say(f"pure Python ({reason})")
        remove_inplace_build()
        return []
    try:
        built = list(mypycify([*MYPY_ARGS, *HOT], opt_level="3", group_name=GROUP, multi_file=True))
    except (SystemExit, Exception) as exc:  # mypy reports type errors by exiting
        say(f"pure Python (mypyc could not compile: {exc!r})")
        remove_inplace_build()
        return []
    for ext in built:  # multi_file puts the group's headers under the package's folder
        ext.include_dirs.append(os.path.join("build", *GROUP.split(".")[:-1]))
    return built


class BuildExt(build_ext):
    """All or nothing: a module compiled while another failed would not import, so any
    failure (no C compiler, say) removes what was built and leaves pure Python. The C files
    of one extension compile on every core (distutils would take them one at a time)."""

    def build_extensions(self) -> None:
        cc = self.compiler

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

            with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                list(pool.map(one, objects))
            return list(objects)

        cc.compile = compile_all
        super().build_extensions()

    def run(self) -> None:
        if not self.extensions:  # a pure build (said so already)
            return
        try:
            super().run()
        except Exception as exc:
            for built in self.get_outputs():
                Path(built).unlink(missing_ok=True)
            remove_inplace_build()
            say(f"pure Python (the C build failed: {exc})")
            return
        root = HERE if self.inplace else Path(self.build_lib)
        digests = {module(p): hashlib.sha256((HERE / p).read_bytes()).hexdigest() for p in HOT}
        from mypy.version import __version__ as mypy_version

        (root / INFO).write_text(json.dumps({"mypy": mypy_version, "modules": digests}))
        say(f"compiled {len(HOT)} modules with mypyc {mypy_version}")


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
