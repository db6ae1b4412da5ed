"""The ``meter`` command: run a node, talk to one, prepare storage.

Exit codes: 0 success, 1 a failed operation (node unreachable, error answer, drain incomplete),
2 bad usage or configuration (one line naming the setting). Each group of commands is a module
of this package with the same shape (``COMMANDS``, ``add_parsers``, ``run``): counting and
reads (:mod:`~meter.cli.counting`), ``status`` (:mod:`~meter.cli.status`), ``export``
(:mod:`~meter.cli.export`), limits (:mod:`~meter.cli.limits`) and the ledger
(:mod:`~meter.cli.ledger`); running a node and preparing storage are here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from meter import BUILD, __version__, compiled
from meter.cli import counting, export, features, limits, periods, status
from meter.cli import ledger as ledger_cli
from meter.cli.common import NODE_FLAGS, run_async
from meter.config import NodeConfig, load
from meter.errors import ConfigError, MeterError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meter", description="An in-memory usage-counter node.")
    p.add_argument(
        "--version",
        action="version",
        version=f"meter {__version__}, {compiled.running(BUILD).describe()}",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", help="TOML file of settings (METER_CONFIG)")
        sp.add_argument("--socket", help="Unix socket path (METER_SOCKET, default ./meter.sock)")

    serve = sub.add_parser("serve", help="run a node until SIGTERM")
    common(serve)
    for flag, text in NODE_FLAGS:
        serve.add_argument(flag, help=text)
    counting.add_parsers(sub, common)
    status.add_parsers(sub, common)
    export.add_parsers(sub, common)
    limits.add_parsers(sub, common)
    features.add_parsers(sub, common)
    periods.add_parsers(sub, common)
    ledger_cli.add_parsers(sub, common)

    storage = sub.add_parser("storage", help="storage administration")
    ssub = storage.add_subparsers(dest="storage_command", required=True, metavar="ACTION")
    init = ssub.add_parser("init", help="create the backend's schema (idempotent)")
    common(init)
    for flag, text in NODE_FLAGS:
        init.add_argument(flag, help=text)
    return p


def _config(args: argparse.Namespace) -> NodeConfig:
    flags: dict[str, Any] = {"socket": args.socket}
    for flag, _ in NODE_FLAGS:
        dest = flag[2:].replace("-", "_")
        if hasattr(args, dest):
            flags[dest] = getattr(args, dest)
    return load(file=args.config, flags=flags)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meter`` console script."""
    args = _parser().parse_args(argv)
    try:
        cfg = _config(args)
    except ConfigError as exc:
        print(f"meter: configuration error: {exc.message}", file=sys.stderr)
        return 2
    try:
        if args.command == "serve":
            return _serve(cfg)
        if args.command == "storage":
            return run_async(_storage_init(cfg))
        if args.command in export.COMMANDS:
            return export.run(args, cfg)
        return _client_command(args, cfg)
    except ConfigError as exc:
        print(f"meter: configuration error: {exc.message}", file=sys.stderr)
        return 2
    except MeterError as exc:
        print(f"meter: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _serve(cfg: NodeConfig) -> int:
    from meter.node.lifecycle import Node
    from meter.ops.logs import setup_logging

    setup_logging(cfg.log_level, cfg.log_format)

    async def go() -> int:
        node = Node(cfg, own_process=True)  # it may tune the process's collector (ADR 0007)
        await node.start()
        return await node.run()

    return run_async(go())


async def _storage_init(cfg: NodeConfig) -> int:
    from meter.node.wiring import build_storage
    from storage.base import StorageError

    storage = build_storage(cfg)
    try:
        await storage.open()
        report = await storage.init_schema()
    except StorageError as exc:
        print(f"meter: storage init failed: {exc}", file=sys.stderr)
        return 1
    finally:
        await storage.close()
    print(report)
    return 0


def _client_command(args: argparse.Namespace, cfg: NodeConfig) -> int:
    """A command that talks to the node on ``cfg``'s socket; the exit code."""
    from meter.client import Client

    prepared = counting.prepare(args)  # (checked before connecting; the others check nothing)
    if isinstance(prepared, int):
        return prepared
    # A probe must answer fast: no waiting for a node that is not there (or stopping).
    probe = getattr(args, "check", False)
    as_json: bool = args.json
    with Client.connect(str(cfg.server.socket), **status.PROBE if probe else {}) as client:
        if args.command in limits.COMMANDS:
            return limits.run(args, client, as_json)
        if args.command in features.COMMANDS:
            return features.run(args, client, as_json)
        if args.command in periods.COMMANDS:
            return periods.run(args, client, as_json)
        if args.command in ledger_cli.COMMANDS:
            return ledger_cli.run(args, client, as_json)
        if args.command in status.COMMANDS:
            return status.run(args, client, as_json)
        return counting.run(args, client, as_json, prepared)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
