"""``meter period close PERIOD --node ID``: an operator closes a period for a node that will
never come back (docs/invoicing.md)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from meter.cli.common import Common, client_parser, out

if TYPE_CHECKING:
    from meter.client import Client

COMMANDS = ("period",)


def add_parsers(sub: Any, common: Common) -> None:
    """``meter period close``."""
    period = sub.add_parser("period", help="counting periods: close one for a node by hand")
    psub = period.add_subparsers(dest="period_command", required=True, metavar="ACTION")
    close = client_parser(
        psub,
        "close",
        "close PERIOD for node ID, which will never come back (units it did not store are "
        "not in the period; the export records the close as an operator's)",
        common,
    )
    close.add_argument("period", help="a period name (as meter export takes), ended plus grace")
    close.add_argument("--node", required=True, help="the node id to close it for")


def run(args: argparse.Namespace, client: Client, as_json: bool) -> int:
    """Run one period command; the exit code."""
    got = client.close_period(args.period, args.node)
    out(as_json, f"{got['period']}: node {got['node']} {got['state']} (by {got['by']})", **got)
    return 0
