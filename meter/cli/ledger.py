"""``meter grant``, ``meter debit``, ``meter balance`` and ``meter ledger`` (docs/ledger.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meter.client import Client

COMMANDS = ("grant", "debit", "balance", "ledger")


def add_parsers(sub: Any, common: Any) -> None:
    """The ledger commands' parsers, under ``meter``'s subcommands."""

    def client(name: str, text: str, tenant: str | None = None) -> argparse.ArgumentParser:
        sp: argparse.ArgumentParser = sub.add_parser(name, help=text)
        common(sp)
        sp.add_argument("--json", action="store_true", help="print JSON, for scripts")
        if tenant is None:
            sp.add_argument("tenant")
        else:
            sp.add_argument("tenant", nargs="?", help=tenant)
        return sp

    grant = client("grant", "credit a tenant's ledger (opens a grant)")
    grant.add_argument("amount", type=int)
    grant.add_argument("--ref", help="idempotency ref (1..128 chars): a repeat lands once")
    grant.add_argument("--expires-at", type=int, help="epoch seconds the grant expires at")
    grant.add_argument("--priority", type=int, help="higher is spent first (default 0)")
    debit = client("debit", "spend from a tenant's ledger (exit 1 if the balance is short)")
    debit.add_argument("amount", type=int)
    debit.add_argument("--ref", help="idempotency ref (1..128 chars): a repeat lands once")
    client("balance", "show a tenant's available credits and open grants")
    page = client(
        "ledger",
        "list a tenant's ledger entries, a page at a time (or every tenant's: --all)",
        tenant="the tenant (none with --all)",
    )
    page.add_argument("--after", type=int, help="entries after this sequence (a cursor)")
    page.add_argument("--limit", type=int, help="entries per page (1..1000, default 100)")
    page.add_argument(
        "--all", action="store_true", help="every tenant's entries in time order (the timeline)"
    )
    page.add_argument("--from", dest="start", type=float, help="with --all: epoch seconds (0)")
    page.add_argument("--to", dest="end", type=float, help="with --all: epoch seconds (now)")


def run(args: argparse.Namespace, client: Client, as_json: bool) -> int:
    """Run one ledger command; the exit code."""
    got: dict[str, Any]
    if args.command == "grant":
        got = client.grant(
            args.tenant,
            args.amount,
            ref=args.ref,
            expires_at=args.expires_at,
            priority=args.priority,
        )
        text = _entry_text(got)
    elif args.command == "debit":
        got = client.debit(args.tenant, args.amount, ref=args.ref)
        text = _entry_text(got)
    elif args.command == "balance":
        got = client.balance(args.tenant)
        text = _balance_text(got)
    elif args.all:
        return _timeline(args, client, as_json)
    else:
        if args.tenant is None or args.start is not None or args.end is not None:
            return _usage("meter ledger: give a tenant, or --all (--from and --to go with it)")
        got = client.ledger_page(args.tenant, args.after, args.limit)
        text = _page_text(got)
    print(json.dumps(got, sort_keys=True) if as_json else text)
    return 0


def _timeline(args: argparse.Namespace, client: Client, as_json: bool) -> int:
    """``meter ledger --all``: every tenant's entries from ``--from`` until ``--to``, page by
    page, one line each (JSON lines with ``--json``)."""
    if args.tenant is not None or args.after is not None:
        return _usage("meter ledger --all: no tenant and no --after (it reads every tenant)")
    if not as_json:
        print(f"{'TIME':<24}  {'TENANT':<20}  {'SEQ':>6}  {'KIND':<8}  {'AMOUNT':>14}  REF")
    for e in client.ledger_timeline(
        args.start, args.end, 100 if args.limit is None else args.limit
    ):
        if as_json:
            print(json.dumps(e, sort_keys=True))
            continue
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(e["time"]))
        print(
            f"{when}.{round(e['time'] * 1000) % 1000:03d}Z  {e['tenant']:<20}  {e['seq']:>6}  "
            f"{e['kind']:<8}  {e['amount']:>+14d}  {e['ref'] or '-'}"
        )
    return 0


def _usage(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def _entry_text(e: dict[str, Any]) -> str:
    return (
        f"#{e['seq']} {e['kind']} {e['amount']:+d} (ref {e['ref']}): balance {e['balance_after']}"
    )


def _balance_text(b: dict[str, Any]) -> str:
    lines = [f"{b['tenant']}: {b['available']} available"]
    pool = b.get("pool") or {}
    if pool.get("funded"):
        lines[0] += (
            f" ({b['ledger_available']} in the ledger, {pool['unspent']} unspent in the pool)"
        )
    grants = b.get("grants") or []
    if grants:
        lines.append(
            f"{'GRANT':>8}  {'REMAINING':>20}  {'IN_POOL':>20}  {'PRIORITY':>8}  EXPIRES_AT"
        )
        for g in grants:
            exp = "-" if g["expires_at"] is None else str(g["expires_at"])
            lines.append(
                f"{g['seq']:>8}  {g['remaining']:>20}  {g.get('in_pool', 0):>20}  "
                f"{g['priority']:>8}  {exp}"
            )
    return "\n".join(lines)


def _page_text(p: dict[str, Any]) -> str:
    entries = p.get("entries") or []
    if not entries:
        return "(no entries)"
    lines = [f"{'SEQ':>8}  {'KIND':<8}  {'AMOUNT':>20}  {'BALANCE':>20}  REF"]
    for e in entries:
        lines.append(
            f"{e['seq']:>8}  {e['kind']:<8}  {e['amount']:>+20d}  "
            f"{e['balance_after']:>20}  {e['ref'] or '-'}"
        )
    if p.get("cursor") is not None:
        lines.append(f"(more: --after {p['cursor']})")
    return "\n".join(lines)
