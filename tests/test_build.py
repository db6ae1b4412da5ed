"""The compiled build (setup.py, meter.compiled): what runs, what is reported, the fallbacks.

The suite itself runs on whatever ``pip install -e .`` built; where a C compiler is on the
PATH that must be the compiled build, and these tests say so if it is not.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import meter
from meter import compiled
from meter.client import Client
from tests.support.nodes import ROOT, NodeProcess

HOT = compiled.HOT
HAS_CC = shutil.which(os.environ.get("CC", "gcc")) is not None or shutil.which("cc") is not None
#: The quick subset of the suite that also runs on pure Python (see test_pure_subset).
PURE_SUBSET = (
    "tests/test_table_properties.py",
    "tests/test_table_batch.py",
    "tests/test_protocol.py",
    "tests/test_server.py",
    "tests/test_service.py",
    "tests/test_wal_records.py",
    "tests/test_wal_service.py",
    "tests/test_warm_tracks.py",
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METER_")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _python(code: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_this_install_runs_the_hot_modules_compiled() -> None:
    build = compiled.running(meter.BUILD)
    if not HAS_CC:  # an install without a C compiler is pure Python, and says why
        assert not build.compiled and build.reason
        return
    assert build.compiled, build.reason
    assert build.modules == HOT and len(HOT) == 18
    for name in HOT:
        __import__(name)
        assert sys.modules[name].__file__.endswith(".so"), name  # type: ignore[union-attr]
    assert build.describe().startswith("compiled by mypyc ")


def test_meter_pure_python_imports_every_compiled_module_from_source() -> None:
    code = (
        "import meter, meter.cli.main, meter.node.lifecycle, meter.core.service, meter.core.table\n"
        "import meter.wal.log\n"
        "from meter import compiled\n"
        "b = compiled.running(meter.BUILD)\n"
        "print(b.compiled, b.reason)\n"
        "print(*sorted({__import__('sys').modules[m].__file__[-3:] for m in b.modules}))\n"
    )
    res = _python(code, METER_PURE_PYTHON="1")
    assert res.returncode == 0, res.stderr
    first, suffixes = res.stdout.splitlines()
    assert first == "False METER_PURE_PYTHON=1"
    if meter.BUILD.modules:  # a compiled install: none of its extensions was loaded
        assert suffixes == ".py"
    out = subprocess.run(
        [sys.executable, "-m", "meter", "--version"],
        env=_env(METER_PURE_PYTHON="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "meter 0.1.0, pure Python (METER_PURE_PYTHON=1)"
    # 0 means "not set": the installed build runs.
    res = _python("import meter; print(meter.BUILD.compiled)", METER_PURE_PYTHON="0")
    assert res.stdout.strip() == str(meter.BUILD.compiled)


def test_status_and_version_say_which_build_runs(workdir: Path) -> None:
    version = subprocess.run(
        [sys.executable, "-m", "meter", "--version"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    assert version == f"meter 0.1.0, {meter.BUILD.describe()}"
    with (
        NodeProcess(workdir, "c") as node,
        NodeProcess(workdir, "p", METER_PURE_PYTHON="1") as pure,
    ):
        with Client.connect(node.socket) as c:
            build = c.status()["build"]
        assert build["compiled"] is meter.BUILD.compiled
        assert build["summary"] == meter.BUILD.describe()
        with Client.connect(pure.socket) as c:
            build = c.status()["build"]
        assert build["compiled"] is False and build["reason"] == "METER_PURE_PYTHON=1"
        text = subprocess.run(
            [sys.executable, "-m", "meter", "status", "--socket", str(pure.socket)],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "build        pure Python (METER_PURE_PYTHON=1)" in text
        assert node.stop() == 0
        assert meter.BUILD.describe() in node.log()  # the startup line names the build


def _copy_tree(dest: Path) -> Path:
    """The importable packages of this checkout, built files included."""
    for pkg in ("meter", "storage", "cluster"):
        shutil.copytree(ROOT / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_a_source_changed_since_the_build_runs_pure_python_and_says_why(tmp_path: Path) -> None:
    if not meter.BUILD.compiled:
        assert not HAS_CC, meter.BUILD.reason
        return
    tree = _copy_tree(tmp_path)
    code = "import meter, meter.core.service as s; print(meter.BUILD.compiled, s.__file__[-3:])"
    res = _python(code, cwd=tree, PYTHONPATH=str(tree))
    assert res.stdout.split() == ["True", ".so"], res.stderr  # the copy runs compiled
    table = tree / "meter" / "core" / "table.py"
    table.write_text(table.read_text() + "\n# changed\n")
    res = _python(code, cwd=tree, PYTHONPATH=str(tree))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", ".py"]  # every module, not only the changed one
    assert res.stderr.strip() == (
        "meter: running pure Python: source changed since the build: meter/core/table.py; "
        "pip install -e . compiles it again"
    )
    # A module the compiled code calls but which is not compiled counts too: the compiled
    # code assumes what its types were at the build.
    table.write_text(table.read_text().removesuffix("\n# changed\n"))
    assert _python(code, cwd=tree, PYTHONPATH=str(tree)).stdout.split() == ["True", ".so"]
    limits = tree / "meter" / "quotas" / "limits.py"
    limits.write_text(limits.read_text() + "\n# changed\n")
    res = _python(code, cwd=tree, PYTHONPATH=str(tree))
    assert res.stdout.split() == ["False", ".py"]
    assert "source changed since the build: meter/quotas/limits.py" in res.stderr


def _pure_run(tree: Path) -> tuple[list[str], str]:
    code = (
        "import meter, meter.core.service as s, meter.core.keys as k\n"
        "print(meter.BUILD.compiled, s.__file__[-3:], k.__file__[-3:])\n"
        "print(meter.BUILD.reason)"
    )
    res = _python(code, cwd=tree, PYTHONPATH=str(tree))
    assert res.returncode == 0, res.stderr
    first, reason = res.stdout.splitlines()
    return [*first.split(), reason], res.stderr


def test_a_missing_compiled_module_or_library_runs_every_module_from_source(
    tmp_path: Path,
) -> None:
    if not meter.BUILD.compiled:
        assert not HAS_CC, meter.BUILD.reason
        return
    for gone in ("core/keys", "_hot__mypyc"):
        tree = _copy_tree(tmp_path / gone.replace("/", "-"))
        for built in (tree / "meter").glob(f"{gone}.*.so"):
            built.unlink()
        out, err = _pure_run(tree)
        name = "meter._hot__mypyc" if gone.startswith("_") else f"meter.{gone.replace('/', '.')}"
        assert out == ["False", ".py", ".py", f"compiled modules missing: {name}"]
        assert err.strip() == f"meter: running pure Python: compiled modules missing: {name}"


def test_compiled_files_without_a_build_record_are_not_imported(tmp_path: Path) -> None:
    if not meter.BUILD.compiled:
        assert not HAS_CC, meter.BUILD.reason
        return
    tree = _copy_tree(tmp_path)
    (tree / "meter" / "_compiled.json").unlink()
    reason = "compiled files without a build record; pip install -e . builds again"
    assert _pure_run(tree) == (
        ["False", ".py", ".py", reason],
        f"meter: running pure Python: {reason}\n",
    )


def test_a_pure_build_record_says_why(tmp_path: Path) -> None:
    tree = _copy_tree(tmp_path)
    for built in (tree / "meter").rglob("*.so"):
        built.unlink()
    (tree / "meter" / "_compiled.json").write_text(
        '{"compiled": false, "reason": "the C build failed: no cc"}'
    )
    assert _pure_run(tree) == (["False", ".py", ".py", "the C build failed: no cc"], "")
    res = _python("import meter; print(meter.BUILD.describe())", cwd=tree, PYTHONPATH=str(tree))
    assert res.stdout.strip() == "pure Python (the C build failed: no cc)"


def _source_copy(dest: Path) -> Path:
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for pkg in ("meter", "storage", "cluster"):
        shutil.copytree(
            ROOT / pkg,
            dest / pkg,
            ignore=shutil.ignore_patterns("__pycache__", "*.so", "_compiled.json"),
        )
    return dest


def _setup(src: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "setup.py", "-q", *args],
        cwd=src,
        env={**_env(**env), "PYTHONPATH": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _says(res: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.startswith("meter build:")]


def test_a_build_without_a_c_compiler_installs_pure_python_in_one_line(tmp_path: Path) -> None:
    src = _source_copy(tmp_path)
    res = _setup(src, "build_ext", "--build-lib", "out", CC="/bin/false")
    assert res.returncode == 0, res.stderr[-2000:]
    (line,) = _says(res)
    assert line.startswith("meter build: pure Python (the C build failed: ")
    assert not list((src / "out").rglob("*.so")) and not list(src.rglob("*.so"))
    # The reason is recorded where the build went, for meter --version to say.
    record = json.loads((src / "out" / "meter" / "_compiled.json").read_text())
    assert (
        record["compiled"] is False
        and record["reason"] == line[len("meter build: pure Python (") : -1]
    )
    assert not (src / "meter" / "_compiled.json").exists()  # not an in-place build


def test_meter_pure_python_at_build_time_removes_an_earlier_compiled_build(
    tmp_path: Path,
) -> None:
    src = _source_copy(tmp_path)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    stale = [src / "meter" / "core" / f"table{suffix}", src / "meter" / "_compiled.json"]
    for path in stale:
        path.write_text("an earlier build")
    res = _setup(src, "build_ext", "--inplace", METER_PURE_PYTHON="1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert _says(res) == ["meter build: pure Python (METER_PURE_PYTHON=1 at install)"]
    assert not stale[0].exists()
    record = json.loads(stale[1].read_text())
    assert record == {"compiled": False, "reason": "METER_PURE_PYTHON=1 at install"}
    # A build that is not in place (a wheel) leaves the source tree's build alone.
    stale[0].write_text("an earlier build")
    res = _setup(src, "build_ext", "--build-lib", "out", METER_PURE_PYTHON="1")
    assert res.returncode == 0 and stale[0].exists()


def test_pure_subset() -> None:
    """The quick subset of the suite, on pure Python: the code must stay correct without
    the compiler, not only with it."""
    res = subprocess.run(
        # -n 0: in one process, as before the suite ran on xdist workers (it runs in one).
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", *PURE_SUBSET],
        cwd=ROOT,
        env=_env(METER_PURE_PYTHON="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = res.stdout[-3000:]
    assert res.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail and "skipped" not in tail
    assert "meter build: pure Python (METER_PURE_PYTHON=1)" in res.stdout  # the header


def test_pip_install_of_a_wheel_runs_compiled(tmp_path: Path) -> None:
    """``pip install .`` (a wheel, not the editable install the suite runs on) carries the
    compiled modules, their sources and the build record, and runs compiled."""
    if not HAS_CC:
        return  # test_a_build_without_a_c_compiler_... covers this machine
    (tmp_path / "src").mkdir()
    src = _source_copy(tmp_path / "src")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run(
        [*pip, "wheel", str(src), "--no-deps", "-w", str(tmp_path / "wheels")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("meter-*.whl")
    target = tmp_path / "site"
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert (target / "meter" / "_compiled.json").exists() and (
        target / "meter/core/table.py"
    ).exists()
    code = "import meter, meter.core.service as s; print(meter.BUILD.describe(), s.__file__[-3:])"
    res = _python(code, cwd=tmp_path, PYTHONPATH=str(target))
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.split() == [*meter.BUILD.describe().split(), ".so"]


def test_every_error_class_keeps_the_code_its_source_declares() -> None:
    """A compiled subclass of an interpreted exception loses its class attribute ``code``
    (mypyc), so a node would answer ``internal`` where the source says otherwise: every
    error class, compiled module or not, must answer the code it declares."""
    import ast
    import importlib

    checked = 0
    for path in sorted((ROOT / "meter").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if (
                    isinstance(item, ast.Assign)
                    and [getattr(t, "id", None) for t in item.targets] == ["code"]
                    and isinstance(item.value, ast.Constant)
                ):
                    cls = getattr(importlib.import_module(module), node.name)
                    assert cls.code == item.value.value, f"{module}.{node.name}"
                    checked += 1
    assert checked >= 12  # errors.py's classes and the log's


def test_no_compiled_coroutine_awaits_inside_an_except_block() -> None:
    """Compiled by mypyc, a coroutine suspended inside an ``except`` block leaves the caught
    exception as the thread's current one: every later exception on that thread chains onto
    it (test_credits.py::test_making_room_leaves_no_exception_behind). Await after it."""
    import ast

    found = []
    for module in HOT:
        path = compiled.source_path(module, ROOT)
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                handlers = [node.body] if isinstance(node, ast.ExceptHandler) else []
                if isinstance(node, ast.Try) and node.finalbody:
                    handlers.append(node.finalbody)
                for body in handlers:
                    for stmt in body:
                        for sub in ast.walk(stmt):
                            if isinstance(sub, ast.Await | ast.AsyncFor | ast.AsyncWith):
                                found.append(f"{module}:{sub.lineno} {fn.name}")
    assert found == []
