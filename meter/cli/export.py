"""``meter export``: every tenant's stored counters of a period, from storage (docs/operations.md,
"Exporting usage for invoicing")."""

from __future__ import annotations

import argparse
import sys
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
        "--period", required=True, help="a UTC month YYYY-MM (e.g. 2026-11) or day YYYY-MM-DD"
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

    async def go(stream: Any) -> int:
        storage = build_storage(cfg)
        try:
            await storage.open()
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
    return 0
