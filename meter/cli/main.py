"""The ``meter`` command: run a node, talk to one, prepare storage.

Exit codes: 0 success, 1 a failed operation (node unreachable, error answer, drain incomplete),
2 bad usage or configuration (one line naming the setting).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from meter import BUILD, __version__, compiled
from meter.cli import ledger as ledger_cli
from meter.config import NodeConfig, load
from meter.errors import ConfigError, MeterError

if TYPE_CHECKING:
    from meter.client import Client

# Flags shared by every subcommand that reads the configuration: dest is the setting name.
_NODE_FLAGS: list[tuple[str, str]] = [
    ("--data-dir", "data directory (METER_DATA_DIR, default ./.meter)"),
    ("--storage", "sqlite (default), memory or dynamodb (METER_STORAGE)"),
    ("--node-id", "stable node id (METER_NODE_ID; default generated once, kept in data dir)"),
    ("--flush-interval-ms", "flush period (METER_FLUSH_INTERVAL_MS, default 1000)"),
    ("--gossip-interval-ms", "gossip period (METER_GOSSIP_INTERVAL_MS, default 100)"),
    ("--redis-url", "Redis for gossip (METER_REDIS_URL; unset: run alone)"),
    ("--dynamodb-table", "DynamoDB table (METER_DYNAMODB_TABLE, default meter_counters)"),
    ("--dynamodb-endpoint", "DynamoDB endpoint URL (METER_DYNAMODB_ENDPOINT)"),
    ("--socket-group", "make the socket 0660 for this group (METER_SOCKET_GROUP)"),
    ("--log-level", "DEBUG, INFO, WARNING or ERROR (METER_LOG_LEVEL, default INFO)"),
    (
        "--metrics-address",
        "host:port for /metrics, /healthz, /readyz over HTTP (METER_METRICS_ADDRESS; "
        "port 0: any free port; unset: no listener)",
    ),
]


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

    def client(name: str, text: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=text)
        common(sp)
        sp.add_argument("--json", action="store_true", help="print JSON, for scripts")
        return sp

    serve = sub.add_parser("serve", help="run a node until SIGTERM")
    common(serve)
    for flag, text in _NODE_FLAGS:
        serve.add_argument(flag, help=text)

    id_help = (
        "request id, 1-128 UTF-8 bytes (default: a fresh random one); the call sent again "
        "with the same id within the node's idempotency window is counted once"
    )

    track = client("track", "count units")
    track.add_argument("tenant")
    track.add_argument("feature")
    track.add_argument("qty", nargs="?", type=int, default=1)
    track.add_argument("--at", type=float, help="epoch seconds choosing the period")
    track.add_argument("--id", help=id_help)

    reserve = client("reserve", "hold units against a limit; prints the reservation id")
    reserve.add_argument("tenant")
    reserve.add_argument("feature")
    reserve.add_argument("qty", type=int)
    reserve.add_argument("--limit", type=int, help="fail (limit_exceeded) past this total")
    reserve.add_argument("--ttl-ms", type=int, help="lifetime in ms (default: the node's)")
    reserve.add_argument("--at", type=float, help="epoch seconds choosing the period")
    reserve.add_argument("--id", help=id_help)

    commit = client("commit", "turn a reservation into usage; prints the new total")
    commit.add_argument("reservation_id")
    commit.add_argument("actual", nargs="?", type=int, help="units to count (default: reserved)")
    commit.add_argument("--id", help=id_help)

    release = client("release", "drop a reservation without counting it")
    release.add_argument("reservation_id")
    release.add_argument("--id", help=id_help)

    many = client(
        "track-many",
        "count lines 'TENANT FEATURE [QTY [ID]]' from FILE or standard input, 10,000 to a "
        "call; every line's syntax is checked before any is sent (the node checks the names); "
        "give lines an ID to make running the file again safe",
    )
    many.add_argument("file", nargs="?", default="-", help="file of items (default: stdin)")

    usage = client("usage", "read a counter, or every counter of a tenant")
    usage.add_argument("tenant")
    usage.add_argument("feature", nargs="?")
    usage.add_argument("--at", type=float, help="epoch seconds choosing the period")

    history = client(
        "history", "a counter's units per UTC day (or month), with a bar chart (docs/history.md)"
    )
    history.add_argument("tenant")
    history.add_argument("feature")
    span = history.add_mutually_exclusive_group()
    span.add_argument("--days", type=int, help="the last N days, today included (default 30)")
    span.add_argument("--months", type=int, help="the last N months, this one included")

    client("ping", "ask a node whether it answers (prints pong)")

    watch = client(
        "watch", "print a tenant's counters as they change (live usage push) until Ctrl-C"
    )
    watch.add_argument("tenant")
    watch.add_argument("features", nargs="*", metavar="FEATURE", help="default: every feature")

    client("alerts", "print threshold alerts as the node delivers them until Ctrl-C")

    status = client("status", "show a node's state (--json: the raw status map)")
    status.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when the node cannot take counting calls (a probe); reasons on stderr",
    )
    status.add_argument(
        "--strict",
        action="store_true",
        help="with --check: exit 1 also when storage or the bus is not answering",
    )

    export = sub.add_parser(
        "export",
        help="write every tenant's stored counters of a period (csv or jsonl), from storage",
    )
    common(export)
    for flag, text in _NODE_FLAGS:
        export.add_argument(flag, help=text)
    export.add_argument(
        "--period", required=True, help="a UTC month YYYY-MM (e.g. 2026-11) or day YYYY-MM-DD"
    )
    export.add_argument("--format", choices=("csv", "jsonl"), default="csv", help="default csv")
    export.add_argument(
        "--out", help="write to this file (appears only once complete; default stdout)"
    )
    _limit_parsers(sub, common)
    ledger_cli.add_parsers(sub, common)

    storage = sub.add_parser("storage", help="storage administration")
    ssub = storage.add_subparsers(dest="storage_command", required=True, metavar="ACTION")
    init = ssub.add_parser("init", help="create the backend's schema (idempotent)")
    common(init)
    for flag, text in _NODE_FLAGS:
        init.add_argument(flag, help=text)
    return p


def _limit_parsers(sub: Any, common: Any) -> None:
    """``meter plan set|assign|unassign``, ``meter limit set|clear``, ``meter limits`` and
    ``meter check`` (docs/quotas.md)."""

    def client(parent: Any, name: str, text: str) -> argparse.ArgumentParser:
        sp: argparse.ArgumentParser = parent.add_parser(name, help=text)
        common(sp)
        sp.add_argument("--json", action="store_true", help="print JSON, for scripts")
        return sp

    plan = sub.add_parser("plan", help="plans: set one, put a tenant on one")
    psub = plan.add_subparsers(dest="plan_command", required=True, metavar="ACTION")
    pset = client(psub, "set", "create or replace a plan")
    pset.add_argument("name")
    pset.add_argument(
        "limits",
        nargs="+",
        metavar="FEATURE=LIMIT[:soft|:strict][@PCT,...]",
        help="e.g. api_calls=100000@80,100 gpu=60:soft credits=500:strict (@: alerts, percent)",
    )
    assign = client(psub, "assign", "put a tenant on a plan")
    assign.add_argument("tenant")
    assign.add_argument("plan")
    unassign = client(psub, "unassign", "take a tenant off its plan")
    unassign.add_argument("tenant")

    limit = sub.add_parser("limit", help="per-tenant overrides of a plan's limits")
    lsub = limit.add_subparsers(dest="limit_command", required=True, metavar="ACTION")
    lset = client(lsub, "set", "set a tenant's limit on a feature")
    lset.add_argument("tenant")
    lset.add_argument("feature")
    lset.add_argument("limit", type=int)
    lset.add_argument("--soft", action="store_true", help="count past it and report (no refusal)")
    lset.add_argument("--strict", action="store_true", help="zero overshoot, fleet-wide")
    lset.add_argument(
        "--alert",
        type=int,
        action="append",
        metavar="PCT",
        help="alert when usage reaches PCT percent of the limit (repeat for several)",
    )
    lclear = client(lsub, "clear", "remove a tenant's override (its plan's limit applies again)")
    lclear.add_argument("tenant")
    lclear.add_argument("feature")

    limits = client(sub, "limits", "show a tenant's effective limits and where each comes from")
    limits.add_argument("tenant")

    check = client(sub, "check", "would QTY more units be counted? (exit 1 if not)")
    check.add_argument("tenant")
    check.add_argument("feature")
    check.add_argument("qty", nargs="?", type=int, default=1)


def _parse_plan_limits(words: list[str]) -> dict[str, dict[str, Any]]:
    """``FEATURE=LIMIT[:soft|:hard|:strict][@PCT,PCT...]`` words as a plan's features
    (``strict``: a hard limit enforced strictly); ValueError names a bad one (the node checks
    the percentages' range)."""
    out: dict[str, dict[str, Any]] = {}
    for word in words:
        feature, eq, rest = word.partition("=")
        rest, at, pcts = rest.partition("@")
        number, _, kind = rest.partition(":")
        if not eq or not feature or kind not in ("", "soft", "hard", "strict"):
            raise ValueError(
                f"{word!r}: expected FEATURE=LIMIT, FEATURE=LIMIT:soft, :hard or :strict, "
                "optionally followed by @PCT,PCT (alert thresholds)"
            )
        try:
            n = int(number)
        except ValueError:
            raise ValueError(f"{word!r}: LIMIT must be an integer") from None
        if feature in out:
            raise ValueError(f"{word!r}: feature {feature!r} given twice")
        if kind == "strict":
            out[feature] = {"limit": n, "kind": "hard", "enforcement": "strict"}
        else:
            out[feature] = {"limit": n, "kind": kind or "hard"}
        if at:
            try:
                out[feature]["alerts"] = [int(p) for p in pcts.split(",")]
            except ValueError:
                raise ValueError(
                    f"{word!r}: alerts after @ must be integer percentages, e.g. @80,100"
                ) from None
    return out


def _limits_command(args: argparse.Namespace, client: Client, as_json: bool) -> int:
    """The limits commands; the exit code."""
    if args.command == "plan":
        if args.plan_command == "set":
            try:
                features = _parse_plan_limits(args.limits)
            except ValueError as exc:
                print(f"meter: plan set: {exc}", file=sys.stderr)
                return 2
            version = client.set_plan(args.name, features)
            _out(as_json, f"plan {args.name} set (limits version {version})",
                 plan=args.name, version=version)  # fmt: skip
        else:
            plan = args.plan if args.plan_command == "assign" else None
            version = client.assign_plan(args.tenant, plan)
            text = f"{args.tenant} on plan {plan}" if plan else f"{args.tenant} on no plan"
            _out(as_json, f"{text} (limits version {version})",
                 tenant=args.tenant, plan=plan, version=version)  # fmt: skip
    elif args.command == "limit":
        if args.limit_command == "set":
            kind = "soft" if args.soft else "hard"
            enforcement = "strict" if args.strict else "fast"
            alerts = args.alert or None
            version = client.set_limit(
                args.tenant, args.feature, args.limit, kind, enforcement, alerts
            )
            _out(as_json, f"{args.tenant} {args.feature}: {kind} limit {args.limit} "
                 f"(limits version {version})", tenant=args.tenant, feature=args.feature,
                 limit=args.limit, kind=kind, enforcement=enforcement, alerts=alerts or [],
                 version=version)  # fmt: skip
        else:
            version = client.clear_limit(args.tenant, args.feature)
            _out(as_json, f"{args.tenant} {args.feature}: override cleared "
                 f"(limits version {version})", tenant=args.tenant, feature=args.feature,
                 version=version)  # fmt: skip
    elif args.command == "limits":
        got = client.limits(args.tenant)
        print(json.dumps(got, sort_keys=True) if as_json else _limits_table(got))
    else:  # check
        got = client.check(args.tenant, args.feature, args.qty)
        print(json.dumps(got, sort_keys=True) if as_json else _check_text(got, args.qty))
        return 0 if got.get("allowed") else 1
    return 0


def _limits_table(got: dict[str, Any]) -> str:
    head = f"tenant {got.get('tenant')}, plan {got.get('plan') or '(none)'}, "
    head += f"limits version {got.get('version')}"
    limits: dict[str, dict[str, Any]] = got.get("limits") or {}
    if not limits:
        return head + "\n(no limits)"
    width = max(len("FEATURE"), *(len(f) for f in limits))
    rows = [head, f"{'FEATURE':<{width}}  {'LIMIT':>20}  KIND  SOURCE"]
    rows += [
        f"{f:<{width}}  {lim.get('limit'):>20}  {lim.get('kind'):<4}  {lim.get('source')}"
        + (f"  alerts at {','.join(map(str, lim['alerts']))} %" if lim.get("alerts") else "")
        for f, lim in sorted(limits.items())
    ]
    return "\n".join(rows)


def _check_text(got: dict[str, Any], qty: int) -> str:
    verdict = "allowed" if got.get("allowed") else "REFUSED"
    if got.get("limit") is None:
        return f"{verdict}: {got.get('value')} now, no limit"
    return (
        f"{verdict}: {got.get('value')} + {qty} of {got.get('kind')} limit {got.get('limit')} "
        f"({got.get('remaining')} remaining, from {got.get('source')})"
    )


def _config(args: argparse.Namespace) -> NodeConfig:
    flags: dict[str, Any] = {"socket": args.socket}
    for flag, _ in _NODE_FLAGS:
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
            return _run(_storage_init(cfg))
        if args.command == "export":
            return _export(args, cfg)
        return _client_command(args, cfg)
    except ConfigError as exc:
        print(f"meter: configuration error: {exc.message}", file=sys.stderr)
        return 2
    except MeterError as exc:
        print(f"meter: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _run(coro: Any) -> int:
    import uvloop

    code: int = uvloop.run(coro)
    return code


def _serve(cfg: NodeConfig) -> int:
    from meter.node.lifecycle import Node
    from meter.ops.logs import setup_logging

    setup_logging(cfg.log_level, cfg.log_format)

    async def go() -> int:
        node = Node(cfg, own_process=True)  # it may tune the process's collector (ADR 0007)
        await node.start()
        return await node.run()

    return _run(go())


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


def _export(args: argparse.Namespace, cfg: NodeConfig) -> int:
    """``meter export``: bad input exits 2 before storage is touched; a storage or write
    failure exits 1 with one line, leaving no ``--out`` file behind."""
    from pathlib import Path

    from meter.core.keys import check_period
    from meter.node.wiring import build_storage
    from meter.ops.export import RowWriter, atomic_file, export_to
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
            return await export_to(
                storage, period, RowWriter(stream, args.format), progress if tty else None
            )
        finally:
            await storage.close()

    try:
        if out is None:
            rows = _run(go(sys.stdout))
            sys.stdout.flush()
        else:
            with atomic_file(out) as stream:
                rows = _run(go(stream))
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


_NOT_KNOWN = "counted (total not known yet: storage unreachable)"


#: ``meter status --check``'s client: one try, a few seconds at most.
_PROBE: dict[str, Any] = {"timeout": 5.0, "retry_timeout": 0}


def _client_command(args: argparse.Namespace, cfg: NodeConfig) -> int:
    from meter.client import Client, check_request_id

    rid: str | None = getattr(args, "id", None)
    if rid is not None:
        try:
            check_request_id(rid)
        except MeterError as exc:
            print(f"meter: --id: {exc.message}", file=sys.stderr)
            return 2
    items: list[_Item] = []
    if args.command == "track-many":
        # All of the input is read and checked before anything is sent: a typo on line 90,000
        # must not leave the first 80,000 counted.
        try:
            items = _read_items(args.file)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            print(f"meter: track-many: {exc}", file=sys.stderr)
            return 2
    opts: dict[str, Any] = {}
    if getattr(args, "at", None) is not None:
        opts["at"] = args.at
    # A probe must answer fast: no waiting for a node that is not there (or stopping).
    probe = getattr(args, "check", False)
    as_json: bool = args.json
    with Client.connect(str(cfg.server.socket), **_PROBE if probe else {}) as client:
        if args.command in ("plan", "limit", "limits", "check"):
            return _limits_command(args, client, as_json)
        if args.command in ledger_cli.COMMANDS:
            return ledger_cli.run(args, client, as_json)
        if args.command == "track":
            value = client.track(args.tenant, args.feature, args.qty, id=rid, **opts)
            text = _NOT_KNOWN if value is None else str(value)
            _out(as_json, text, tenant=args.tenant, feature=args.feature, value=value)
        elif args.command == "reserve":
            res = client.reserve(
                args.tenant, args.feature, args.qty, args.limit, args.ttl_ms, id=rid, **opts
            )
            _out(as_json, res, reservation_id=res)
        elif args.command == "commit":
            total: int | None = client.commit(args.reservation_id, args.actual, id=rid)
            text = _NOT_KNOWN if total is None else str(total)
            _out(as_json, text, reservation_id=args.reservation_id, value=total)
        elif args.command == "release":
            client.release(args.reservation_id, id=rid)
            _out(as_json, "released", reservation_id=args.reservation_id, released=True)
        elif args.command == "track-many":
            return _track_many(client, items, as_json)
        elif args.command == "usage":
            if args.feature is None:
                counters = client.usage_all(args.tenant, **opts)
                _out(as_json, _table(counters), tenant=args.tenant, usage=counters)
            else:
                value = client.usage(args.tenant, args.feature, **opts)
                _out(as_json, str(value), tenant=args.tenant, feature=args.feature, value=value)
        elif args.command == "history":
            from meter.history.days import history_args, render

            first, granularity = history_args(args.days, args.months)
            points = client.history(args.tenant, args.feature, first, None, granularity)
            _out(
                as_json,
                render(points),
                tenant=args.tenant,
                feature=args.feature,
                granularity=granularity,
                history=[list(p) for p in points],
            )
        elif args.command == "ping":
            _out(as_json, client.ping(), ping="pong")
        elif args.command == "watch":
            for u in client.subscribe(args.tenant, args.features):
                if as_json:
                    line = json.dumps(u._asdict(), sort_keys=True)
                else:
                    line = f"{u.tenant}\t{u.feature}\t{u.value}\t{u.period}"
                print(line, flush=True)
        elif args.command == "alerts":
            for a in client.subscribe_alerts():
                print(json.dumps(a, sort_keys=True) if as_json else _alert_line(a), flush=True)
        elif args.command == "status":
            status = client.status()
            print(json.dumps(status, indent=2, sort_keys=True) if as_json else _fmt(status))
            if args.check:
                reasons = list(status.get("not_ready") or [])
                if status.get("ready") is not True and not reasons:
                    reasons = ["the node does not say it is ready"]
                if args.strict:
                    reasons += status.get("degraded") or []
                for reason in reasons:
                    print(f"meter: not ready: {reason}", file=sys.stderr)
                if reasons:
                    return 1
    return 0


def _alert_line(a: dict[str, Any]) -> str:
    """One alert for people."""
    at = a.get("at")
    when = (
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
        if isinstance(at, int | float)
        else str(at)
    )
    return (
        f"{when}  {a.get('tenant')}/{a.get('feature')} ({a.get('period')}) reached "
        f"{a.get('threshold')}% of {a.get('limit')}: {a.get('value')} >= "
        f"{a.get('threshold_units')}  id {a.get('id')} (node {a.get('node')})"
    )


def _out(as_json: bool, text: str, **fields: Any) -> None:
    """Print ``text`` for people, or ``fields`` as one JSON object for scripts."""
    print(json.dumps(fields, sort_keys=True) if as_json else text)


def _table(counters: dict[str, int]) -> str:
    if not counters:
        return "(no counters in this period)"
    width = max(len("FEATURE"), *(len(f) for f in counters))
    rows = [f"{'FEATURE':<{width}}  VALUE"]
    rows += [f"{f:<{width}}  {v}" for f, v in sorted(counters.items())]
    return "\n".join(rows)


#: One ``track-many`` input line: its number and the item sent for it.
_Item = tuple[int, tuple[str, str, int] | tuple[str, str, int, str | None]]

#: Items per ``track_many`` call (the protocol's maximum).
_BATCH = 10_000


def _read_items(file: str) -> list[_Item]:
    """Parse ``TENANT FEATURE [QTY [ID]]`` lines (blank lines and ``#`` comments skipped);
    ValueError names the first bad line."""
    from meter.client import check_request_id

    items: list[_Item] = []
    with open(file, encoding="utf-8") if file != "-" else contextlib.nullcontext(sys.stdin) as src:
        for n, line in enumerate(src, 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if not 2 <= len(words) <= 4:
                raise ValueError(
                    f"line {n}: expected 'TENANT FEATURE [QTY [ID]]', got {len(words)} words"
                )
            try:
                qty = int(words[2]) if len(words) > 2 else 1
            except ValueError:
                raise ValueError(f"line {n}: QTY must be an integer, got {words[2]!r}") from None
            if len(words) == 4:
                try:
                    check_request_id(words[3])
                except MeterError as exc:
                    raise ValueError(f"line {n}: ID: {exc.message}") from None
                items.append((n, (words[0], words[1], qty, words[3])))
            else:
                items.append((n, (words[0], words[1], qty)))
    return items


def _track_many(client: Client, items: list[_Item], as_json: bool) -> int:
    """Send ``items`` in calls of at most ``_BATCH``; print each item's answer (JSON) or the
    failed ones and a summary (people). Exit 1 if any item failed."""
    failed = 0
    for start in range(0, len(items), _BATCH):
        batch = items[start : start + _BATCH]
        try:
            answers = client.track_many([item for _, item in batch])
        except MeterError as exc:
            # Each call counts all or nothing, but a call that got no answer may have been
            # counted: say exactly which lines are settled, so nobody re-sends the counted ones.
            done = f"lines before {batch[0][0]} were sent and answered; " if start else ""
            print(
                f"meter: track-many: {done}lines {batch[0][0]} to {batch[-1][0]} failed as a "
                f"whole ({exc.code}: {exc.message}): if no answer came they may have been "
                f"counted, so re-send them only with the same IDs; later lines were not sent",
                file=sys.stderr,
            )
            return 1
        for (n, item), answer in zip(batch, answers, strict=True):
            row: dict[str, Any] = {"line": n, "tenant": item[0], "feature": item[1]}
            if isinstance(answer, MeterError):
                failed += 1
                row["error"] = {"code": answer.code, "message": answer.message}
                if not as_json:
                    print(f"meter: line {n}: {answer.code}: {answer.message}", file=sys.stderr)
            else:
                row["value"] = answer
            if as_json:
                print(json.dumps(row, sort_keys=True))
    if not as_json:
        print(f"{len(items) - failed} counted, {failed} failed")
    return 1 if failed else 0


def _fmt(s: dict[str, Any]) -> str:
    """A one-screen summary of ``status`` for operators (``--json`` has everything)."""
    keys = s.get("keys", {})
    flush = s.get("flush", {})
    server = s.get("server", {})
    res = s.get("reservations", {})
    seed = s.get("seeding", {})
    lines = [
        f"node         {s.get('node_id')}  (meter {s.get('version')}, up {s.get('uptime_s')} s)",
        f"build        {(s.get('build') or {}).get('summary')}",
        "ready        "
        + ("yes" if s.get("ready") is True else "NO: " + "; ".join(s.get("not_ready") or ["?"]))
        + ("".join(f"; degraded: {r}" for r in s.get("degraded") or [])),
        f"storage      {s.get('storage')}   socket {s.get('socket')}   data {s.get('data_dir')}",
        f"keys         warm {keys.get('warm')}  dirty {keys.get('dirty')}  "
        f"unseeded {keys.get('unseeded')}  in flight {keys.get('inflight')}",
        f"seeding      {seed.get('on_demand')} on demand, {seed.get('prefetched')} read ahead, "
        f"{seed.get('reads')} reads ({seed.get('failed_reads')} failed), "
        f"{seed.get('queued')} queued",
        f"flush        last {flush.get('last_result')} {flush.get('last_age_s')} s ago, "
        f"every {flush.get('interval_ms')} ms, {flush.get('keys_written')} keys written, "
        f"{flush.get('failures')} failures",
        f"backlog      {flush.get('backlog_keys')} keys, {flush.get('backlog_units')} units, "
        f"age {flush.get('backlog_age_s')} s",
        f"reservations open {res.get('open')}  expired {res.get('expired_total')}",
        f"connections  {server.get('connections')} open, {server.get('requests')} requests, "
        f"{server.get('protocol_errors')} protocol errors, "
        f"{server.get('internal_errors')} internal errors",
    ]
    dur = s.get("durability")
    if isinstance(dur, dict):
        wal = dur.get("wal")
        if isinstance(wal, dict):
            health = "ok" if not wal.get("broken") else f"BROKEN ({wal['broken']})"
            lines.append(
                f"log          {dur.get('mode')} {health}  {wal.get('segments')} segments, "
                f"{wal.get('size_bytes')} bytes, oldest segment "
                f"{wal.get('oldest_segment_age_s')} s, "
                f"{wal.get('fsyncs')} fsyncs"
            )
        else:
            lines.append("log          off (a crash loses what is not flushed)")
    ids = s.get("request_ids")
    if isinstance(ids, dict):
        lines.append(
            f"request ids  {ids.get('remembered')} remembered (max {ids.get('max')}), "
            f"{ids.get('dropped_early')} dropped early"
        )
    owner = s.get("owner")
    if isinstance(owner, dict):
        state = owner.get("state")
        if state == "owned":
            line = f"node id      owned, lease {owner.get('lease_left_s')} s left"
            if not owner.get("counting", True):
                line += " (just claimed: re-reading before counting)"
        else:
            line = f"node id      {str(state).upper()}: {owner.get('last_error')}"
        lines.append(line)
    metrics = s.get("metrics")
    if isinstance(metrics, dict) and metrics.get("address"):
        lines.append(f"metrics      http://{metrics['address']}/metrics  (/healthz, /readyz)")
    lim = s.get("limits")
    if isinstance(lim, dict):
        line = (
            f"limits       version {lim.get('version')}, {lim.get('limited_pairs')} limited, "
            f"{lim.get('refused')} refused, {lim.get('soft_crossings')} soft crossings"
        )
        if lim.get("last_error"):
            line += f"; cannot read them: {lim['last_error']}"
        lines.append(line)
    al = s.get("alerts")
    if isinstance(al, dict):
        line = (
            f"alerts       {al.get('fired')} fired here, {al.get('delivered')} delivered, "
            f"{al.get('pending')} pending, {al.get('dropped')} dropped, "
            f"{al.get('subscribers')} subscribers"
        )
        if al.get("last_error"):
            line += f"; cannot claim: {al['last_error']}"
        lines.append(line)
    if flush.get("last_error"):
        lines.append(f"last error   {flush['last_error']}")
    for p in flush.get("poisoned") or []:
        lines.append(f"PARKED       {'/'.join(map(str, p['key']))}: {p['error']}")
    cluster = s.get("cluster")
    if isinstance(cluster, dict):
        bus = cluster.get("bus") or {}
        state = "up" if bus.get("connected") else f"DOWN ({bus.get('last_error')})"
        rejected = {k: v for k, v in (cluster.get("rejected") or {}).items() if v}
        lines.append(
            f"cluster      {cluster.get('cluster')}  bus {state}  "
            f"live peers {len(cluster.get('live_peers') or [])}  gaps {cluster.get('gaps')}  "
            f"rejected {sum(rejected.values()) if rejected else 0} {rejected or ''}".rstrip()
        )
        for peer, p in sorted((cluster.get("peers") or {}).items()):
            lines.append(
                f"  peer {peer}  {'alive' if p.get('alive') else 'DEAD'}  "
                f"seen {p.get('last_seen_age_s')} s ago  lag {p.get('lag_ms')} ms "
                f"(p99 {p.get('lag_p99_ms')} ms)"
            )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
