"""``meter status``: a node's state, one screen for operators or the raw map (``--json``), and
``--check``, the probe (docs/operations.md)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from meter.cli.common import Common, client_parser

if TYPE_CHECKING:
    from meter.client import Client

COMMANDS = ("status",)
#: ``meter status --check``'s client: one try, a few seconds at most.
PROBE: dict[str, Any] = {"timeout": 5.0, "retry_timeout": 0}


def add_parsers(sub: Any, common: Common) -> None:
    """The status command's parser."""
    status = client_parser(
        sub, "status", "show a node's state (--json: the raw status map)", common
    )
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


def run(args: argparse.Namespace, client: Client, as_json: bool) -> int:
    """Run ``meter status``; the exit code."""
    status = client.status()
    print(json.dumps(status, indent=2, sort_keys=True) if as_json else fmt(status))
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


def fmt(s: dict[str, Any]) -> str:
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
    per = s.get("periods")
    if isinstance(per, dict):
        count = len(per.get("open") or [])
        oldest = f"{count} open, oldest {per.get('oldest_open')}" if count else "none open"
        line = f"periods      {oldest}, {per.get('closed')} closed here"
        if per.get("overdue_s"):
            line += f"; OVERDUE by {per['overdue_s']} s (its end plus the grace has passed)"
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
