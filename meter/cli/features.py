"""``meter feature set|show``: declared features (docs/dimensions.md)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from meter.cli.common import Common, client_parser, out

if TYPE_CHECKING:
    from meter.client import Client

COMMANDS = ("feature",)


def add_parsers(sub: Any, common: Common) -> None:
    """``meter feature set|show``."""
    feature = sub.add_parser("feature", help="declared features: aggregation, dimensions")
    fsub = feature.add_subparsers(dest="feature_command", required=True, metavar="ACTION")
    fset = client_parser(fsub, "set", "declare a feature fleet-wide (or change it)", common)
    fset.add_argument("feature")
    fset.add_argument(
        "--aggregation",
        help="sum (the default), a gauge: max or latest, or unique: distinct values "
        "(not given: as declared)",
    )
    fset.add_argument(
        "--dim",
        action="append",
        metavar="NAME",
        help="a dimension name calls may give (repeat, at most 4; not given: as declared)",
    )
    fset.add_argument("--no-dims", action="store_true", help="declare it without dimensions")
    fset.add_argument(
        "--max-combinations",
        type=int,
        metavar="N",
        help="most dimension counters per tenant and period (default 1000; not given: as declared)",
    )
    show = client_parser(fsub, "show", "how a feature is declared", common)
    show.add_argument("feature")


def run(args: argparse.Namespace, client: Client, as_json: bool) -> int:
    """Run one feature command; the exit code."""
    if args.feature_command == "set":
        # What is not given stays as declared (the method replaces the whole declaration).
        now = client.get_feature(args.feature)
        got = client.set_feature(
            args.feature,
            aggregation=args.aggregation or now["aggregation"],
            dimensions=[] if args.no_dims else now["dimensions"] if args.dim is None else args.dim,
            max_combinations=args.max_combinations or now["max_combinations"],
        )
        out(as_json, f"{args.feature}: {_described(got)} (limits version {got['version']})",
             **got)  # fmt: skip
    else:
        got = client.get_feature(args.feature)
        if as_json:
            print(json.dumps(got, sort_keys=True))
        else:
            state = "declared" if got.get("declared") else "not declared"
            print(f"{args.feature} ({state}): {_described(got)}")
    return 0


def _described(got: dict[str, Any]) -> str:
    names = got.get("dimensions") or []
    dims = f"dimensions {', '.join(names)}" if names else "no dimensions"
    return (
        f"{got.get('aggregation')}, {dims}, at most {got.get('max_combinations')} dimension "
        "counters a tenant and period"
    )
