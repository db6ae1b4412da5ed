"""``python -m bench --beside REV``: the node of another commit, measured beside this one.

:func:`prepare` turns a git revision into a :class:`Tree`: the commit's files are taken out
with ``git archive`` into a temp dir (the repository, its index and its working trees are not
touched), installed with ``pip install <checkout>`` into a venv of their own (compiled with
mypyc as the main install is, by the commit's own ``setup.py``), and the temp dir is removed.
The venv is kept in a cache folder by full commit hash (``$BENCH_BESIDE_CACHE`` or
``~/.cache/meter/bench-beside``), ``<cache>/<commit>/venv``; ``build.json`` beside it is written
last, so a run that finds it reuses the venv and one that does not (never built, or a build
cut short) builds again. A lock file makes two runs wait for one build.

The bench then runs ``<venv>/bin/python -m meter serve`` with the settings it gives its own
nodes (:class:`bench.harness.TreeNode`).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Written last in ``<cache>/<commit>/``: its presence means a complete, usable venv.
RECORD = "build.json"
#: What the build said (pip's output), kept beside the venv.
INSTALL_LOG = "install.log"
#: Seconds a build may take (venv, dependencies and the mypyc compile).
BUILD_TIMEOUT_S = 1800.0
#: Prints what the build does, one line at a time.
Say = Callable[[str], None]
#: Installs the checkout (first argument) into a new venv (second), writing to the log.
Install = Callable[[Path, Path, Path], None]
#: What a venv's ``meter`` says about its build (works on trees that have no ``BUILD``).
PROBE = (
    "import json, meter; b = getattr(meter, 'BUILD', None); print(json.dumps({"
    "'compiled': bool(getattr(b, 'compiled', False)), "
    "'modules': list(getattr(b, 'modules', ())), 'reason': getattr(b, 'reason', 'no BUILD')}))"
)


class BesideError(RuntimeError):
    """The revision cannot be resolved, taken out or built."""


@dataclass(frozen=True)
class Tree:
    """A commit installed into its own venv, ready to run nodes."""

    rev: str  # as asked for
    commit: str  # its full hash
    venv: Path
    #: ``build.json``: the build (compiled or not, modules), when and how long it took.
    record: dict[str, Any]
    #: Built by this run (else found in the cache).
    built_now: bool = False

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def label(self) -> str:
        """How the table names it: the short commit."""
        return self.commit[:7]

    def to_json(self) -> dict[str, Any]:
        return {
            "rev": self.rev,
            "commit": self.commit,
            "venv": str(self.venv),
            "built_now": self.built_now,
            **self.record,
        }


def cache_dir() -> Path:
    """Where the venvs are kept between runs."""
    env = os.environ.get("BENCH_BESIDE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "meter" / "bench-beside"


def clean_env() -> dict[str, str]:
    """This process's environment without what would make a child use this tree or venv."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("METER_")}


def resolve(rev: str, repo: Path) -> str:
    """The full hash of the commit ``rev`` names in ``repo``."""
    if shutil.which("git") is None:
        raise BesideError("--beside needs git")
    verify = ["rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}"]
    got = subprocess.run(
        ["git", "-C", str(repo), *verify],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if got.returncode != 0 or not got.stdout.strip():
        raise BesideError(f"{rev!r} names no commit in {repo}")
    return got.stdout.strip()


def checkout(repo: Path, commit: str, into: Path) -> None:
    """The files of ``commit`` under ``into`` (``git archive``: no index, no worktree)."""
    got = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", commit],
        capture_output=True,
        timeout=300,
    )
    if got.returncode != 0:
        raise BesideError(f"git archive {commit} failed: {got.stderr.decode()[-500:]}")
    with tarfile.open(fileobj=io.BytesIO(got.stdout)) as tar:
        tar.extractall(into, filter="data")


def pip_install(tree: Path, venv: Path, log: Path) -> None:
    """A venv at ``venv`` with ``tree`` installed into it (``pip install <tree>``)."""
    env = clean_env()
    with log.open("ab") as out:
        for cmd in (
            [sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", str(tree)],
        ):
            out.write(f"$ {' '.join(cmd)}\n".encode())
            out.flush()
            code = subprocess.run(
                cmd,
                cwd=tree,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=BUILD_TIMEOUT_S,
            ).returncode
            if code != 0:
                tail = log.read_text(errors="replace")[-1500:]
                raise BesideError(f"{cmd[0]} {' '.join(cmd[1:3])} exited {code}:\n{tail}")


def probe(python: Path) -> dict[str, Any]:
    """What ``meter`` in that interpreter says about its build."""
    got = subprocess.run(
        [str(python), "-c", PROBE],
        cwd=tempfile.gettempdir(),  # not a tree with a meter/ of its own
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if got.returncode != 0:
        raise BesideError(f"{python} cannot import meter: {got.stderr.strip()[-500:]}")
    build: dict[str, Any] = json.loads(got.stdout)
    return build


def prepare(
    rev: str,
    *,
    repo: Path,
    cache: Path | None = None,
    install: Install = pip_install,
    say: Say = print,
) -> Tree:
    """The venv of ``rev``'s commit: from the cache, or built now (see the module's doc)."""
    commit = resolve(rev, repo)
    home = (cache or cache_dir()) / commit
    venv = home / "venv"
    home.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f"{commit}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run may be building it right now
        found = _cached(rev, commit, venv)
        if found is not None:
            say(f"beside {rev}: {commit[:12]}, built before: {venv}")
            return found
        shutil.rmtree(venv, ignore_errors=True)  # a build cut short
        (home / INSTALL_LOG).unlink(missing_ok=True)
        say(f"beside {rev}: building {commit[:12]} into {venv} (pip install, mypyc)")
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="meter-beside-") as tmp:
            tree = Path(tmp) / "tree"
            checkout(repo, commit, tree)
            install(tree, venv, home / INSTALL_LOG)
        record: dict[str, Any] = {
            "build": probe(venv / "bin" / "python"),
            "build_seconds": round(time.monotonic() - t0, 1),
            "built_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        }
        (home / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    compiled = record["build"]["compiled"]
    say(f"beside {rev}: built in {record['build_seconds']} s (compiled: {compiled})")
    return Tree(rev, commit, venv, record, built_now=True)


def _cached(rev: str, commit: str, venv: Path) -> Tree | None:
    with contextlib.suppress(FileNotFoundError, ValueError):
        record = json.loads((venv.parent / RECORD).read_text())
        if (venv / "bin" / "python").exists():
            return Tree(rev, commit, venv, record)
    return None
