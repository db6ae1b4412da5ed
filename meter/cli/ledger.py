"""``meter grant``, ``meter debit``, ``meter balance`` and ``meter ledger`` (docs/ledger.md)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meter.client import Client

COMMANDS = ("grant", "debit", "balance", "ledger")


def add_parsers(sub: Any, common: Any) -> None:
    """The ledger commands' parsers, under ``meter``'s subcommands."""

    def client(name: str, text: str) -> argparse.ArgumentParser:
        sp: argparse.ArgumentParser = sub.add_parser(name, help=text)
        common(sp)
        sp.add_argument("--json", action="store_true", help="print JSON, for scripts")
        sp.add_argument("tenant")
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
    page = client("ledger", "list a tenant's ledger entries, a page at a time")
    page.add_argument("--after", type=int, help="entries after this sequence (a cursor)")
    page.add_argument("--limit", type=int, help="entries per page (1..1000, default 100)")


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
    else:
        got = client.ledger_page(args.tenant, args.after, args.limit)
        text = _page_text(got)
    print(json.dumps(got, sort_keys=True) if as_json else text)
    return 0


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
