"""``python -m bench --beside REV``: the option, the checkout and its cache (on a real git
repository in a temp dir, the install replaced by a stand-in), and a short run with a node of
another tree beside this one's (this venv stands in for the other tree: no build).

No timing assertion: only what is run and reported is checked.
"""

from __future__ import annotations

import dataclasses
import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import meter
from bench import cli, scenarios
from bench.beside import RECORD, BesideError, Tree, prepare, resolve
from bench.harness import ROOT, SMOKE
from bench.scenarios import BATCH, RPC

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def test_the_option_is_parsed() -> None:
    args = cli.parser().parse_args(["--quick", "--only", "rpc", "--beside", "6582a1a"])
    assert args.beside == "6582a1a" and args.quick and args.only == ["rpc"]
    assert cli.parser().parse_args([]).beside is None
    assert "--beside REV" in cli.parser().format_help()


def test_beside_without_a_scenario_that_runs_it_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--smoke", "--only", "memory", "--beside", "HEAD"])
    assert exc.value.code == 2
    assert "--beside measures only scenarios rpc, batch, durable" in capsys.readouterr().err


@needs_git
def test_a_revision_that_names_no_commit_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--smoke", "--only", "rpc", "--beside", "no-such-revision-anywhere"])
    assert exc.value.code == 2
    assert "names no commit" in capsys.readouterr().err


class StandIn:
    """Installs nothing: writes a ``bin/python`` that prints a build record, and notes the
    checkout it was given and what its ``VERSION`` file said."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[Path, str]] = []

    def __call__(self, tree: Path, venv: Path, log: Path) -> None:
        self.calls.append((tree, (tree / "VERSION").read_text()))
        (venv / "bin").mkdir(parents=True)
        python = venv / "bin" / "python"
        python.write_text(
            '#!/bin/sh\necho \'{"compiled": false, "modules": [], "reason": "stand-in"}\'\n'
        )
        python.chmod(0o755)
        log.write_text("installed\n")
        if self.fail:
            raise BesideError("the build was cut short")


@needs_git
def test_checkout_is_of_the_commit_built_once_and_cached(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    for version in ("one", "two"):
        (repo / "VERSION").write_text(version)
        git(repo, "add", "VERSION")
        git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", version)
    (repo / "VERSION").write_text("dirty")  # the working tree is not what gets built
    first, second = git(repo, "rev-parse", "HEAD~1"), git(repo, "rev-parse", "HEAD")
    status, worktrees = git(repo, "status", "--porcelain"), git(repo, "worktree", "list")
    cache = tmp_path / "cache"
    install = StandIn()
    said: list[str] = []

    tree = prepare("HEAD~1", repo=repo, cache=cache, install=install, say=said.append)
    assert tree.commit == first and tree.built_now and tree.label == first[:7]
    assert tree.venv == cache / first / "venv" and tree.python.exists()
    assert tree.record["build"] == {"compiled": False, "modules": [], "reason": "stand-in"}
    assert tree.record["build_seconds"] >= 0 and (cache / first / RECORD).exists()
    assert tree.to_json()["commit"] == first and tree.to_json()["rev"] == "HEAD~1"
    ((checkout, version),) = install.calls
    assert version == "one" and not checkout.exists()  # the temp checkout is removed
    assert any("building" in line for line in said)

    again = prepare(first[:10], repo=repo, cache=cache, install=install, say=said.append)
    assert again.commit == first and not again.built_now and len(install.calls) == 1
    assert again.record == tree.record

    other = prepare("HEAD", repo=repo, cache=cache, install=install, say=said.append)
    assert other.commit == second and other.venv != tree.venv and install.calls[-1][1] == "two"

    # The repository and its working tree are as they were.
    assert git(repo, "status", "--porcelain") == status
    assert git(repo, "worktree", "list") == worktrees
    assert (repo / "VERSION").read_text() == "dirty"

    with pytest.raises(BesideError, match="names no commit"):
        prepare("no-such-rev", repo=repo, cache=cache, install=install, say=said.append)
    with pytest.raises(BesideError, match="names no commit"):
        resolve("--all", repo)  # not taken for an option
    with pytest.raises(BesideError, match="names no commit"):
        resolve("HEAD", tmp_path)  # not a repository


@needs_git
def test_a_build_cut_short_is_built_again(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "VERSION").write_text("one")
    git(repo, "add", "VERSION")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    cache = tmp_path / "cache"
    with pytest.raises(BesideError, match="cut short"):
        prepare("HEAD", repo=repo, cache=cache, install=StandIn(fail=True), say=print)
    commit = git(repo, "rev-parse", "HEAD")
    assert not (cache / commit / RECORD).exists()  # no record: not taken as built
    install = StandIn()
    tree = prepare("HEAD", repo=repo, cache=cache, install=install, say=print)
    assert tree.built_now and len(install.calls) == 1


@pytest.mark.redis
@needs_git
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_a_node_of_another_tree_runs_in_the_same_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scenarios 1, 2 and 7 with a fourth side: this venv's interpreter stands in for the
    other tree's (run as one, without ``PYTHONPATH``), so nothing is built."""
    tree = Tree("HEAD", resolve("HEAD", ROOT), Path(sys.prefix), {"build": {"stand_in": True}})
    monkeypatch.setattr(scenarios, "DURABLE_PAIRS", (("interval", "everysec"),))
    sizes = dataclasses.replace(SMOKE, rpc_configs=((2, 4),))
    out = io.StringIO()
    doc = cli.run(sizes, ["rpc", "batch", "durable"], results_dir=tmp_path, out=out, beside=tree)
    assert doc["failures"] == {}
    assert doc["beside"]["commit"] == tree.commit and doc["beside"]["build"] == {"stand_in": True}
    rows = doc["rows"]
    assert {r["scenario"] for r in rows} == {RPC, BATCH, "7 durable vs Redis AOF"}
    assert len(rows) == 2 + 1 + 2
    for r in rows:
        assert r["beside"] > 0 and r["beside_ratio"] > 0 and r["vs_beside"] > 0, r["metric"]
        assert r["pure"] > 0 and r["pure_ratio"] > 0, r["metric"]
        assert (f"({tree.label} node NOT compiled)" in r["metric"]) is not meter.BUILD.compiled
    for r in [r for r in rows if r["unit"] != "us"]:  # throughput: four sides, each first as often
        d = r["detail"]
        rounds = d.get("rounds_beside_ops") or d["rounds_beside"]
        assert len(rounds) == 4 and d["order"].startswith(f"rotating: compiled, pure, {tree.label}")
        assert d["errors"] == 0
    durable = rows[3]["detail"]
    assert durable["beside_reported_durability"] == "interval"
    assert durable["beside_wal"]["records"] > 0 and "no log" not in rows[3]["metric"]
    head = next(line for line in out.getvalue().splitlines() if line.startswith("| scenario"))
    assert f"| {tree.label} " in head and f"ours/{tree.label}" in head
