"""The counting and reading commands: ``meter track``, ``reserve``, ``commit``, ``release``,
``track-many``, ``usage``, ``history``, ``ping``, ``watch`` and ``alerts`` (docs/protocol.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meter.cli.common import NOT_KNOWN, Common, client_parser, out
from meter.errors import MeterError

if TYPE_CHECKING:
    from meter.client import Client

COMMANDS = (
    "track",
    "reserve",
    "commit",
    "release",
    "void",
    "track-many",
    "usage",
    "history",
    "ping",
    "watch",
    "alerts",
)


DIM_HELP = "a dimension value of the call, e.g. model=gpt-4 (repeat for several)"
WHERE_HELP = "read one dimension value's counter, e.g. model=gpt-4"


def pair(text: str, flag: str) -> tuple[str, str]:
    """``NAME=VALUE`` split at its first ``=``; ValueError names ``flag``."""
    name, eq, value = text.partition("=")
    if not eq or not name:
        raise ValueError(f"{flag} {text!r}: expected NAME=VALUE")
    return name, value


def add_parsers(sub: Any, common: Common) -> None:
    """The counting and reading commands' parsers."""

    def client(name: str, text: str) -> argparse.ArgumentParser:
        return client_parser(sub, name, text, common)

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
    track.add_argument("--dim", action="append", metavar="NAME=VALUE", help=DIM_HELP)
    track.add_argument("--value", help="the value a unique feature counts once (qty 1)")

    reserve = client("reserve", "hold units against a limit; prints the reservation id")
    reserve.add_argument("tenant")
    reserve.add_argument("feature")
    reserve.add_argument("qty", type=int)
    reserve.add_argument("--limit", type=int, help="fail (limit_exceeded) past this total")
    reserve.add_argument("--ttl-ms", type=int, help="lifetime in ms (default: the node's)")
    reserve.add_argument("--at", type=float, help="epoch seconds choosing the period")
    reserve.add_argument("--id", help=id_help)
    reserve.add_argument("--dim", action="append", metavar="NAME=VALUE", help=DIM_HELP)

    commit = client("commit", "turn a reservation into usage; prints the new total")
    commit.add_argument("reservation_id")
    commit.add_argument("actual", nargs="?", type=int, help="units to count (default: reserved)")
    commit.add_argument("--id", help=id_help)

    release = client("release", "drop a reservation without counting it")
    release.add_argument("reservation_id")
    release.add_argument("--id", help=id_help)

    void = client(
        "void",
        "take back a call counted under request id CALL_ID (a track, a track-many item, a "
        "commit) on every counter it counted on, once; prints the units taken back now (0: "
        "taken back before) and the total after",
    )
    void.add_argument("call_id")
    void.add_argument("--id", help=id_help)

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
    usage.add_argument(
        "--group-by",
        action="append",
        metavar="NAME",
        help="sum the feature by the values of this dimension (repeat for several)",
    )
    usage.add_argument("--where", metavar="NAME=VALUE", help=WHERE_HELP)
    usage.add_argument(
        "--children",
        action="store_true",
        help="every user of the account with its value, and the account's total "
        "(tenant_hierarchy; give the feature)",
    )

    history = client(
        "history", "a counter's units per UTC day (or month), with a bar chart (docs/history.md)"
    )
    history.add_argument("tenant")
    history.add_argument("feature")
    span = history.add_mutually_exclusive_group()
    span.add_argument("--days", type=int, help="the last N days, today included (default 30)")
    span.add_argument("--months", type=int, help="the last N months, this one included")
    history.add_argument("--where", metavar="NAME=VALUE", help=WHERE_HELP)

    client("ping", "ask a node whether it answers (prints pong)")

    watch = client(
        "watch", "print a tenant's counters as they change (live usage push) until Ctrl-C"
    )
    watch.add_argument("tenant")
    watch.add_argument("features", nargs="*", metavar="FEATURE", help="default: every feature")

    client("alerts", "print threshold alerts as the node delivers them until Ctrl-C")


@dataclass(frozen=True)
class Prepared:
    """What a counting command checked before connecting: its request id and, for
    ``track-many``, every item of its input."""

    rid: str | None
    items: list[_Item] = field(default_factory=list)


def prepare(args: argparse.Namespace) -> Prepared | int:
    """Check what can be checked before connecting (``--id``, ``track-many``'s input);
    the exit code 2 with one line on stderr if it is bad."""
    from meter.client import check_request_id

    rid: str | None = getattr(args, "id", None)
    if rid is not None:
        try:
            check_request_id(rid)
        except MeterError as exc:
            print(f"meter: --id: {exc.message}", file=sys.stderr)
            return 2
    try:
        if args.command in ("track", "reserve"):
            names = [pair(given, "--dim")[0] for given in args.dim or ()]
            twice = {n for n in names if names.count(n) > 1}
            if twice:
                raise ValueError(f"--dim {sorted(twice)[0]!r} given twice")
        if args.command in ("usage", "history") and args.where is not None:
            pair(args.where, "--where")
    except ValueError as exc:
        print(f"meter: {exc}", file=sys.stderr)
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
    return Prepared(rid, items)


def run(args: argparse.Namespace, client: Client, as_json: bool, prepared: Prepared) -> int:
    """Run one counting or reading command; the exit code."""
    rid = prepared.rid
    opts: dict[str, Any] = {}
    if getattr(args, "at", None) is not None:
        opts["at"] = args.at
    if args.command == "track":
        if args.dim:
            opts["dims"] = dict(pair(d, "--dim") for d in args.dim)
        if args.value is not None:
            opts["value"] = args.value
        value = client.track(args.tenant, args.feature, args.qty, id=rid, **opts)
        text = NOT_KNOWN if value is None else str(value)
        out(as_json, text, tenant=args.tenant, feature=args.feature, value=value)
    elif args.command == "reserve":
        if args.dim:
            opts["dims"] = dict(pair(d, "--dim") for d in args.dim)
        res = client.reserve(
            args.tenant, args.feature, args.qty, args.limit, args.ttl_ms, id=rid, **opts
        )
        out(as_json, res, reservation_id=res)
    elif args.command == "commit":
        total: int | None = client.commit(args.reservation_id, args.actual, id=rid)
        text = NOT_KNOWN if total is None else str(total)
        out(as_json, text, reservation_id=args.reservation_id, value=total)
    elif args.command == "release":
        client.release(args.reservation_id, id=rid)
        out(as_json, "released", reservation_id=args.reservation_id, released=True)
    elif args.command == "void":
        got = client.void(args.call_id, id=rid)
        total = got["value"]
        text = f"voided {got['voided']}, total {NOT_KNOWN if total is None else total}"
        if "credits" in got:
            text += f", {got['credits']} credits given back"
        out(as_json, text, call_id=args.call_id, **got)
    elif args.command == "track-many":
        return _track_many(client, prepared.items, as_json)
    elif args.command == "usage":
        if args.children:
            if args.feature is None or args.where is not None or args.group_by:
                print("meter: usage: --children takes a feature, and no --where or --group-by",
                      file=sys.stderr)  # fmt: skip
                return 2
            return _children(client, args.tenant, args.feature, args.at, as_json)
        if args.feature is None:
            counters = client.usage_all(args.tenant, **opts)
            out(as_json, _table(counters), tenant=args.tenant, usage=counters)
        elif args.group_by:
            if args.where is not None:
                print("meter: usage: give --where or --group-by, not both", file=sys.stderr)
                return 2
            got = client.usage_by(args.tenant, args.feature, args.group_by, **opts)
            out(as_json, _groups(got, args.group_by), tenant=args.tenant, feature=args.feature,
                **got)  # fmt: skip
        else:
            if args.where is not None:
                opts["where"] = dict([pair(args.where, "--where")])
            value = client.usage(args.tenant, args.feature, **opts)
            out(as_json, str(value), tenant=args.tenant, feature=args.feature, value=value)
    elif args.command == "history":
        from meter.history.days import history_args, render

        first, granularity = history_args(args.days, args.months)
        where = None if args.where is None else dict([pair(args.where, "--where")])
        points = client.history(args.tenant, args.feature, first, None, granularity, where=where)
        out(
            as_json,
            render(points),
            tenant=args.tenant,
            feature=args.feature,
            granularity=granularity,
            history=[list(p) for p in points],
        )
    elif args.command == "ping":
        out(as_json, client.ping(), ping="pong")
    elif args.command == "watch":
        for u in client.subscribe(args.tenant, args.features):
            if as_json:
                fields = {"tenant": u.tenant, "feature": u.feature, "value": u.value,
                          "period": u.period}  # fmt: skip
                if u.dims:  # (a dimension counter's)
                    fields["dims"] = dict(u.dims)
                line = json.dumps(fields, sort_keys=True)
            else:
                line = f"{u.tenant}\t{_shown(u.feature, u.dims)}\t{u.value}\t{u.period}"
            print(line, flush=True)
    elif args.command == "alerts":
        for a in client.subscribe_alerts():
            print(json.dumps(a, sort_keys=True) if as_json else _alert_line(a), flush=True)
    return 0


def _alert_line(a: dict[str, Any]) -> str:
    """One alert for people."""
    at = a.get("at")
    when = (
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
        if isinstance(at, int | float)
        else str(at)
    )
    feature = _shown(str(a.get("feature")), tuple((a.get("dims") or {}).items()))
    return (
        f"{when}  {a.get('tenant')}/{feature} ({a.get('period')}) reached "
        f"{a.get('threshold')}% of {a.get('limit')}: {a.get('value')} >= "
        f"{a.get('threshold_units')}  id {a.get('id')} (node {a.get('node')})"
    )


def _shown(feature: str, dims: tuple[tuple[str, str], ...]) -> str:
    """A counter as people read it: ``tokens``, ``tokens{model=gpt-4}``."""
    return feature + "{" + ",".join(f"{n}={v}" for n, v in dims) + "}" if dims else feature


def _groups(got: dict[str, Any], names: list[str]) -> str:
    """A group-by answer as a table: one column per dimension, then the value."""
    groups: list[dict[str, Any]] = got.get("groups") or []
    cells = [[("-" if g["dims"].get(n) is None else str(g["dims"][n])) for n in names]
             + [str(g["value"])] for g in groups]  # fmt: skip
    head = [n.upper() for n in names] + ["VALUE"]
    widths = [max(len(r[i]) for r in [head, *cells]) for i in range(len(head))]
    rows = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in [head, *cells]]  # fmt: skip
    rows.append(f"total {got.get('total')} ('-': calls that gave no value of it)")
    return "\n".join(rows)


def _children(client: Client, account: str, feature: str, at: float | None, as_json: bool) -> int:
    """``usage --children``: every page, the users printed as they come (``--json`` holds
    them all, for one object)."""
    at = time.time() if at is None else at  # (every page of the same period)
    cursor: str | None = None
    children: list[dict[str, Any]] = []
    total: int | None = None
    while True:
        page = client.usage_children_page(account, feature, at, cursor, 1000)
        if total is None:
            total = page["total"]
            if not as_json:
                print(f"{account} {feature}: {total}")
                print(f"{'TENANT':<24}  VALUE" if page["children"] else "(no users in this period)")
        if as_json:
            children += page["children"]
        else:
            for child in page["children"]:
                print(f"{child['tenant']:<24}  {child['value']}")
        cursor = page["cursor"]
        if cursor is None:
            break
    if as_json:
        out(True, "", tenant=account, feature=feature, total=total, children=children)
    return 0


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
