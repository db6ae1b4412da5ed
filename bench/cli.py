"""``python -m bench [--quick | --smoke] [--only SCENARIO ...] [--beside REV]``: run, print,
save, draw."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import report
from bench.beside import BesideError, Tree, prepare
from bench.harness import FULL, QUICK, ROOT, SMOKE, Row, Services, Sizes
from bench.scenarios import BESIDE_SCENARIOS, SCENARIOS


def run(
    sizes: Sizes,
    only: Sequence[str] | None = None,
    *,
    results_dir: Path | None = None,
    chart_path: Path | None = None,
    out: Any = None,
    beside: Tree | None = None,
) -> dict[str, Any]:
    """Run the chosen scenarios; write the JSON (and chart); return the JSON document.

    ``beside``: another commit's tree, whose node scenarios 1, 2 and 7 run in the same
    rounds as this one's (:func:`bench.beside.prepare`)."""
    out = out or sys.stdout
    names = list(only) if only else list(SCENARIOS)
    t0 = time.monotonic()

    def progress(step: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f}s] {step}", file=out, flush=True)

    doc: dict[str, Any] = {
        "mode": sizes.name,
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": report.machine(),
        "scenarios": names,
        "rows": [],
        "failures": {},
    }
    if beside is not None:
        doc["beside"] = beside.to_json()
    rows: list[Row] = []
    with Services(beside) as svc:
        for name in names:
            progress(f"== scenario {name}")
            try:
                got = SCENARIOS[name](svc, sizes, progress)
            except Exception as exc:  # one broken scenario must not lose the others' numbers
                progress(f"scenario {name} FAILED: {type(exc).__name__}: {exc}")
                doc["failures"][name] = f"{type(exc).__name__}: {exc}"[:500]
                continue
            rows.extend(got)
    doc["rows"] = [r.to_json() for r in rows]
    doc["seconds"] = round(time.monotonic() - t0, 1)
    print(file=out)
    print(report.table(rows, beside.label if beside else "beside"), file=out)
    if results_dir is not None:
        path, latest = report.write_json(doc, results_dir)
        print(f"\nresults: {path} (and {latest.name})", file=out)
    if chart_path is not None and rows:
        title = (
            f"meter bench ({sizes.name}) {doc['started_utc']} UTC - "
            f"{doc['machine']['nproc']} x {doc['machine']['cpu']}, "
            f"Python {doc['machine']['python']}"
        )
        print(f"chart: {report.chart(rows, chart_path, title)}", file=out)
    return doc


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench``."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="about a minute: fewer, shorter rounds")
    mode.add_argument("--smoke", action="store_true", help="a few seconds: checks that it runs")
    p.add_argument(
        "--only",
        action="append",
        choices=list(SCENARIOS),
        metavar="SCENARIO",
        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}",
    )
    p.add_argument(
        "--beside",
        metavar="REV",
        help=(
            "also run the node of git revision REV in the same rounds as this tree's, in "
            f"scenarios {', '.join(BESIDE_SCENARIOS)}: extra columns give its figure, its "
            "ratio to the reference and ours against it. REV is taken out with git archive "
            "into a temp dir (removed after) and pip-installed (compiled, as the main install) "
            "into a venv kept by commit in $BENCH_BESIDE_CACHE or ~/.cache/meter/bench-beside, "
            "so only the first run with a commit builds it"
        ),
    )
    p.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--chart", type=Path, default=ROOT / "docs" / "bench.png")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sizes = SMOKE if args.smoke else QUICK if args.quick else FULL
    tree = None
    if args.beside is not None:
        if args.only and not set(args.only) & set(BESIDE_SCENARIOS):
            p.error(f"--beside measures only scenarios {', '.join(BESIDE_SCENARIOS)}")
        try:
            tree = prepare(args.beside, repo=ROOT, say=lambda line: print(line, flush=True))
        except BesideError as exc:
            p.error(f"--beside {args.beside}: {exc}")
    doc = run(sizes, args.only, results_dir=args.results_dir, chart_path=args.chart, beside=tree)
    return 1 if doc["failures"] else 0
