"""``meter plan set|assign|unassign``, ``meter limit set|clear``, ``meter limits`` and
``meter check`` (docs/quotas.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from meter.cli.common import Common, client_parser, out

if TYPE_CHECKING:
    from meter.client import Client

COMMANDS = ("plan", "limit", "limits", "check")


def add_parsers(sub: Any, common: Common) -> None:
    """``meter plan set|assign|unassign``, ``meter limit set|clear``, ``meter limits`` and
    ``meter check`` (docs/quotas.md)."""

    def client(parent: Any, name: str, text: str) -> argparse.ArgumentParser:
        return client_parser(parent, name, text, common)

    plan = sub.add_parser("plan", help="plans: set one, put a tenant on one")
    psub = plan.add_subparsers(dest="plan_command", required=True, metavar="ACTION")
    pset = client(psub, "set", "create or replace a plan")
    pset.add_argument("name")
    pset.add_argument(
        "limits",
        nargs="*",
        metavar="FEATURE=LIMIT[:soft|:strict][@PCT,...]",
        help="e.g. api_calls=100000@80,100 gpu=60:soft credits=500:strict (@: alerts, "
        "percent); 'tokens{model=gpt-4}=5000' limits one dimension value",
    )
    pset.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="FEATURE=CREDITS",
        help="the feature costs CREDITS credits a unit (repeat for several; a limit is then "
        "optional; docs/ledger.md)",
    )
    assign = client(psub, "assign", "put a tenant on a plan")
    assign.add_argument("tenant")
    assign.add_argument("plan")
    assign.add_argument(
        "--anchor-day",
        type=int,
        metavar="D",
        help="billing cycle: periods start on day D (1..31) of each month",
    )
    assign.add_argument(
        "--anchor-time",
        metavar="HH:MM",
        help="billing cycle: periods start at this local time of the anchor day (default 00:00)",
    )
    assign.add_argument(
        "--tz", metavar="ZONE", help="billing cycle: in this IANA time zone (default UTC)"
    )
    assign.add_argument(
        "--now",
        action="store_true",
        help="the new cycle takes effect now (a minute from now), not at the "
        "end of the tenant's current period",
    )
    unassign = client(psub, "unassign", "take a tenant off its plan")
    unassign.add_argument("tenant")

    limit = sub.add_parser("limit", help="per-tenant overrides of a plan's limits")
    lsub = limit.add_subparsers(dest="limit_command", required=True, metavar="ACTION")
    lset = client(lsub, "set", "set a tenant's limit on a feature")
    lset.add_argument("tenant")
    lset.add_argument("feature")
    lset.add_argument("limit", type=int, nargs="?", help="units (optional with --price)")
    lset.add_argument(
        "--price", type=int, metavar="CREDITS", help="the feature costs CREDITS credits a unit"
    )
    lset.add_argument("--soft", action="store_true", help="count past it and report (no refusal)")
    lset.add_argument("--strict", action="store_true", help="zero overshoot, fleet-wide")
    lset.add_argument("--where", metavar="NAME=VALUE", help=WHERE_LIMIT)
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
    lclear.add_argument("--where", metavar="NAME=VALUE", help=WHERE_LIMIT)

    limits = client(sub, "limits", "show a tenant's effective limits and where each comes from")
    limits.add_argument("tenant")

    check = client(sub, "check", "would QTY more units be counted? (exit 1 if not)")
    check.add_argument("tenant")
    check.add_argument("feature")
    check.add_argument("qty", nargs="?", type=int, default=1)


WHERE_LIMIT = "limit one dimension value's counter, e.g. model=gpt-4 (docs/dimensions.md)"


def _where(text: str | None) -> dict[str, str] | None:
    """``--where NAME=VALUE``; ValueError if it is not that."""
    if text is None:
        return None
    name, eq, value = text.partition("=")
    if not eq or not name:
        raise ValueError(f"--where {text!r}: expected NAME=VALUE")
    return {name: value}


def _feature_word(word: str) -> tuple[str, str, str]:
    """``FEATURE=VALUE`` split as ``str.partition`` does, ``feature{name=value}=VALUE`` (one
    dimension value's) at the ``=`` after its ``}``."""
    if "{" in word and "}=" in word:
        cut = word.index("}=") + 1
        return word[:cut], "=", word[cut + 1 :]
    return word.partition("=")


def _add_prices(features: dict[str, dict[str, Any]], words: list[str]) -> None:
    """``--price FEATURE=CREDITS`` words into a plan's ``features``; ValueError names a bad
    one (the node checks the price's range); a plan with no feature at all is one too."""
    priced: set[str] = set()
    for word in words:
        feature, eq, credits = _feature_word(word)
        if not eq or not feature:
            raise ValueError(f"--price {word!r}: expected FEATURE=CREDITS")
        if feature in priced:
            raise ValueError(f"--price: {feature!r} given twice")
        priced.add(feature)
        try:
            features.setdefault(feature, {})["price"] = int(credits)
        except ValueError:
            raise ValueError(f"--price {word!r}: CREDITS must be an integer") from None
    if not features:
        raise ValueError("give at least one FEATURE=LIMIT or --price FEATURE=CREDITS")


def _parse_plan_limits(words: list[str]) -> dict[str, dict[str, Any]]:
    """``FEATURE=LIMIT[:soft|:hard|:strict][@PCT,PCT...]`` words as a plan's features
    (``strict``: a hard limit enforced strictly); ValueError names a bad one (the node checks
    the percentages' range)."""
    out: dict[str, dict[str, Any]] = {}
    for word in words:
        feature, eq, rest = _feature_word(word)
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


def run(args: argparse.Namespace, client: Client, as_json: bool) -> int:
    """Run one limits command; the exit code."""
    if args.command == "plan":
        if args.plan_command == "set":
            try:
                features = _parse_plan_limits(args.limits)
                _add_prices(features, args.price)
            except ValueError as exc:
                print(f"meter: plan set: {exc}", file=sys.stderr)
                return 2
            version = client.set_plan(args.name, features)
            out(as_json, f"plan {args.name} set (limits version {version})",
                 plan=args.name, version=version)  # fmt: skip
        else:
            plan = args.plan if args.plan_command == "assign" else None
            opts: dict[str, Any] = {}
            cycle_given = plan is not None and any(
                v is not None for v in (args.anchor_day, args.anchor_time, args.tz)
            )
            if cycle_given:
                opts = {
                    "anchor_day": 1 if args.anchor_day is None else args.anchor_day,
                    "anchor_time": "00:00" if args.anchor_time is None else args.anchor_time,
                    "tz": "UTC" if args.tz is None else args.tz,
                    "effective": "now" if args.now else "next_period",
                }
            elif plan is not None and args.now:
                print(
                    "meter: plan assign: --now needs --anchor-day, --anchor-time or --tz",
                    file=sys.stderr,
                )
                return 2
            version = client.assign_plan(args.tenant, plan, opts)
            text = f"{args.tenant} on plan {plan}" if plan else f"{args.tenant} on no plan"
            out(as_json, f"{text} (limits version {version})",
                 tenant=args.tenant, plan=plan, version=version)  # fmt: skip
    elif args.command == "limit":
        if args.limit_command == "set":
            kind = "soft" if args.soft else "hard"
            enforcement = "strict" if args.strict else "fast"
            alerts = args.alert or None
            try:
                where = _where(args.where)
            except ValueError as exc:
                print(f"meter: limit set: {exc}", file=sys.stderr)
                return 2
            if args.limit is None and args.price is None:
                print("meter: limit set: give a LIMIT, a --price, or both", file=sys.stderr)
                return 2
            version = client.set_limit(args.tenant, args.feature, args.limit, kind, enforcement,
                                       alerts, where=where, price=args.price)  # fmt: skip
            shown = args.feature + (f"{{{args.where}}}" if where else "")
            what = [] if args.limit is None else [f"{kind} limit {args.limit}"]
            what += [] if args.price is None else [f"price {args.price} credits a unit"]
            priced: dict[str, Any] = {} if args.price is None else {"price": args.price}
            # (a price alone sets no unit limit: no kind nor enforcement to show)
            shown_kind = None if args.limit is None else kind
            shown_enforcement = None if args.limit is None else enforcement
            out(as_json, f"{args.tenant} {shown}: {', '.join(what)} "
                 f"(limits version {version})", tenant=args.tenant, feature=args.feature,
                 limit=args.limit, kind=shown_kind, enforcement=shown_enforcement,
                 alerts=alerts or [], version=version, **priced,
                 **({"where": where} if where else {}))  # fmt: skip
        else:
            try:
                where = _where(args.where)
            except ValueError as exc:
                print(f"meter: limit clear: {exc}", file=sys.stderr)
                return 2
            version = client.clear_limit(args.tenant, args.feature, where=where)
            shown = args.feature + (f"{{{args.where}}}" if where else "")
            out(as_json, f"{args.tenant} {shown}: override cleared "
                 f"(limits version {version})", tenant=args.tenant, feature=args.feature,
                 version=version, **({"where": where} if where else {}))  # fmt: skip
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
    cycle = got.get("cycle") or []
    if cycle:  # (its billing cycle: the change in force or the next one, docs/periods.md)
        c = cycle[-1]
        head += f", billing cycle day {c['anchor_day']} {c.get('anchor_time', '00:00')} {c['tz']}"
        head += f" from {_utc(c['from'])}"
    limits: dict[str, dict[str, Any]] = got.get("limits") or {}
    if not limits:
        return head + "\n(no limits)"
    width = max(len("FEATURE"), *(len(f) for f in limits))
    rows = [head, f"{'FEATURE':<{width}}  {'LIMIT':>20}  KIND  SOURCE"]
    rows += [
        f"{f:<{width}}  {_limit_shown(lim):>20}  {lim.get('kind'):<4}  {lim.get('source')}"
        + (f"  alerts at {','.join(map(str, lim['alerts']))} %" if lim.get("alerts") else "")
        + (f"  price {lim['price']} credits a unit" if lim.get("price") else "")
        for f, lim in sorted(limits.items())
    ]
    return "\n".join(rows)


def _limit_shown(lim: dict[str, Any]) -> str:
    """A limit as the table shows it: ``-`` for a priced feature's (no unit limit)."""
    return "-" if lim.get("price") and lim.get("limit") == 2**63 - 1 else str(lim.get("limit"))


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def _check_text(got: dict[str, Any], qty: int) -> str:
    verdict = "allowed" if got.get("allowed") else "REFUSED"
    if got.get("limit") is None:
        return f"{verdict}: {got.get('value')} now, no limit"
    return (
        f"{verdict}: {got.get('value')} + {qty} of {got.get('kind')} limit {got.get('limit')} "
        f"({got.get('remaining')} remaining, from {got.get('source')})"
    )
