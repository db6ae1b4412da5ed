"""``meter export``: every tenant's stored counters of a period, from storage (docs/operations.md,
"Exporting usage for invoicing")."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from meter.cli.common import NODE_FLAGS, Common, run_async
from meter.config import NodeConfig
from meter.errors import MeterError

COMMANDS = ("export",)


def add_parsers(sub: Any, common: Common) -> None:
    """The export command's parser."""
    export = sub.add_parser(
        "export",
        help="write every tenant's stored counters of a period (csv or jsonl), from storage",
    )
    common(export)
    for flag, text in NODE_FLAGS:
        export.add_argument(flag, help=text)
    export.add_argument(
        "--period",
        required=True,
        help="a period: a UTC month YYYY-MM (e.g. 2026-11) or day YYYY-MM-DD, a billing "
        "cycle's month YYYY-MM@D:Zone (e.g. 2026-11@15:America/New_York; YYYY-MM@DTHH:MM:Zone "
        "anchored off midnight) or a zone's day YYYY-MM-DD@Zone",
    )
    export.add_argument("--format", choices=("csv", "jsonl"), default="csv", help="default csv")
    export.add_argument(
        "--out", help="write to this file (appears only once complete; default stdout)"
    )
    export.add_argument(
        "--values",
        action="store_true",
        help="write the values unique features counted instead (tenant, feature, period, value)",
    )


def run(args: argparse.Namespace, cfg: NodeConfig) -> int:
    """``meter export``: bad input exits 2 before storage is touched; a storage or write
    failure exits 1 with one line, leaving no ``--out`` file behind."""
    from pathlib import Path

    from meter.core.keys import check_period
    from meter.node.wiring import build_storage
    from meter.ops.export import RowWriter, ValueWriter, atomic_file, export_to, export_values_to
    from meter.persist.closing import close_state
    from meter.quotas.limits import LimitBook
    from storage.base import ExportPage, StorageError

    try:
        period = check_period(args.period)
    except MeterError as exc:
        print(f"meter: --period: {exc.message}", file=sys.stderr)
        return 2
    if cfg.storage.kind == "memory":
        print("meter: export: memory storage keeps nothing to export", file=sys.stderr)
        return 2
    out = None if args.out is None else Path(args.out)
    if out is not None and not out.parent.is_dir():
        print(f"meter: --out: no such directory: {out.parent}", file=sys.stderr)
        return 2
    if out is not None and out.is_dir():
        print(f"meter: --out: {out} is a directory", file=sys.stderr)
        return 2
    if cfg.storage.kind == "sqlite":
        db = cfg.data_dir / cfg.storage.sqlite_file
        if not db.is_file():  # opening it would create an empty database, and export nothing
            print(f"meter: export failed: no sqlite database at {db}", file=sys.stderr)
            return 1
    tty = sys.stderr.isatty()

    def progress(rows: int, page: ExportPage) -> None:
        parts = f", segments {page.parts_done}/{page.parts}" if page.parts > 1 else ""
        sys.stderr.write(f"\rexported {rows} rows{parts}")
        sys.stderr.flush()

    state: dict[str, Any] = {}

    async def go(stream: Any) -> int:
        storage = build_storage(cfg)
        try:
            await storage.open()
            # Read before the rows: a period final then holds, in the rows, all it will.
            grace = cfg.counters.period_grace_s
            state.update(await close_state(storage, period, grace, time.time()))
            if not args.values:
                return await export_to(
                    storage, period, RowWriter(stream, args.format), progress if tty else None
                )
            version, records = await storage.read_limits()
            specs = LimitBook.from_records(version, records).features
            uniques = {f for f, spec in specs.items() if spec.aggregation == "unique"}
            writer = ValueWriter(stream, args.format)
            return await export_values_to(
                storage, storage, period, uniques, writer, progress if tty else None
            )
        finally:
            await storage.close()

    try:
        if out is None:
            rows = run_async(go(sys.stdout))
            sys.stdout.flush()
        else:
            with atomic_file(out) as stream:
                rows = run_async(go(stream))
    except StorageError as exc:
        if tty:
            sys.stderr.write("\n")
        print(f"meter: export failed: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if tty:
            sys.stderr.write("\n")
        print(f"meter: export failed: {exc}", file=sys.stderr)
        return 1
    if tty:
        sys.stderr.write(f"\rexported {rows} rows of {period}, done\n")
    print(final_line(period, state), file=sys.stderr)
    return 0


def final_line(period: str, state: dict[str, Any]) -> str:
    """What ``meter export`` says of a period's close, on standard error (docs/invoicing.md)."""
    by_hand = state["closed_by_operator"]
    closed = f"; closed by an operator for {', '.join(by_hand)}" if by_hand else ""
    if state["final"]:
        if not state["nodes"]:
            return (f"meter: export: {period} is final: no node marked it (none counted there, "
                    "or only builds before period marks)")  # fmt: skip
        return (f"meter: export: {period} is final: every node that counted in it closed it"
                f"{closed}{units_note(state.get('closed_nodes', []))}")  # fmt: skip
    if state["read_at"] < state["closes_at"]:
        return (f"meter: export: {period} is NOT final: calls may still count in it until "
                f"{_when(state['closes_at'])} (its end plus period_grace_s){closed}")  # fmt: skip
    now = state["read_at"]
    nodes = "; ".join(
        f"{n['node']} (open since {_when(n['opened_at'])}, {_running(n['lease_ends'], now)}"
        f"{_backlog(n.get('backlog'), n.get('seen_at'))})"
        for n in state["open_nodes"]
    )
    return f"meter: export: {period} is NOT final: nodes still open: {nodes}{closed}"


def units_note(closed_nodes: list[dict[str, Any]]) -> str:
    """What the nodes' closes say they counted, summed by feature (docs/invoicing.md): to
    hold against the export's totals."""
    if not closed_nodes:
        return ""
    said: dict[str, int] = {}
    unsaid = []
    for n in closed_nodes:
        if n.get("units") is None:
            unsaid.append(n["node"])
            continue
        for feature, units in n["units"].items():
            said[feature] = said.get(feature, 0) + units
    shown = ", ".join(f"{f}={u}" for f, u in sorted(said.items())) or "none"
    missing = f" (not said by {', '.join(unsaid)})" if unsaid else ""
    return f"; units the nodes counted: {shown}{missing}"


def _running(lease_ends: float | None, now: float) -> str:
    return "running" if lease_ends is not None and lease_ends >= now else "not running"


def _backlog(backlog: dict[str, int] | None, seen_at: float | None) -> str:
    """A node's last known backlog of the period (docs/invoicing.md), or nothing if unknown."""
    if backlog is None or seen_at is None:
        return ""
    return (f", {backlog['units']} units in {backlog['keys']} keys not stored as of "
            f"{_when(seen_at)}")  # fmt: skip


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
