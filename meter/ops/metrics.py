"""Prometheus metrics of one node: a registry of its own and a collector reading the node.

The collector reads the numbers the node keeps anyway (``status``'s sources, and the plain
counters of :mod:`meter.core.counts`) when Prometheus scrapes, so the request path pays for
no prometheus object. The counts that walk the table (keys by state, the flush backlog) are
taken at most once per :data:`TABLE_COUNTS_MAX_AGE_S`: at a million keys a walk is a pause of
the event loop, and a flood of scrapes must not repeat it. Each node has its own
:class:`CollectorRegistry`, never the global one (tests run several nodes in one process).
Labels are bounded: methods the node has, error codes, fixed states and reasons, and features
only up to ``metrics_feature_labels``. No label ever holds a tenant.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from meter import __version__
from meter.core.counts import Buckets, FeatureUnits, RequestStats
from meter.core.table import TableStats
from meter.errors import BY_CODE
from meter.ops.health import NodeView, can_count, health_checks
from meter.persist.closing import overdue_s, period_closes_at

# Every family, by its full name (counters with ``_total``), as the docs name them.
REQUESTS = "meter_requests_total"
REQUEST_DURATION = "meter_request_duration_seconds"
REFUSALS = "meter_refusals_total"
CONNECTIONS = "meter_connections"
CONNECTIONS_ACCEPTED = "meter_connections_accepted_total"
PROTOCOL_ERRORS = "meter_protocol_errors_total"
KEYS = "meter_keys"
FLUSH_ROUNDS = "meter_flush_rounds_total"
FLUSH_FAILURES = "meter_flush_failures_total"
FLUSH_DURATION = "meter_flush_duration_seconds"
FLUSH_KEYS_WRITTEN = "meter_flush_keys_written_total"
FLUSH_WRITES = "meter_flush_writes_total"
FLUSH_WRITE_UNITS = "meter_flush_write_units_total"
FLUSH_CPU = "meter_flush_cpu_seconds_total"
FLUSH_BACKLOG_KEYS = "meter_flush_backlog_keys"
FLUSH_BACKLOG_UNITS = "meter_flush_backlog_units"
FLUSH_BACKLOG_AGE = "meter_flush_backlog_age_seconds"
FLUSH_PARKED_KEYS = "meter_flush_parked_keys"
UNITS_STORED = "meter_units_stored_total"
UNITS_REMOVED = "meter_units_removed_total"
SEEDING_READS = "meter_seeding_reads_total"
SEEDING_FAILED_READS = "meter_seeding_failed_reads_total"
WAL_SIZE = "meter_wal_size_bytes"
WAL_SEGMENTS = "meter_wal_segments"
WAL_OLDEST_AGE = "meter_wal_oldest_segment_age_seconds"
WAL_COMMITS = "meter_wal_commits_total"
WAL_FSYNCS = "meter_wal_fsyncs_total"
WAL_FSYNC_DURATION = "meter_wal_fsync_duration_seconds"
WAL_FAILURES = "meter_wal_failures_total"
WAL_WRITABLE = "meter_wal_writable"
GOSSIP_BUS_CONNECTED = "meter_gossip_bus_connected"
GOSSIP_PEERS = "meter_gossip_peers"
GOSSIP_LAG = "meter_gossip_lag_seconds"
GOSSIP_MESSAGES = "meter_gossip_messages_received_total"
GOSSIP_REJECTED = "meter_gossip_rejected_total"
GOSSIP_GAPS = "meter_gossip_gaps_total"
RESERVATIONS_OPEN = "meter_reservations_open"
RESERVATIONS_EXPIRED = "meter_reservations_expired_total"
STRICT_SHARES = "meter_strict_shares"
STRICT_WRITES = "meter_strict_budget_writes_total"
ALERTS = "meter_alerts_total"
ALERTS_PENDING = "meter_alerts_pending"
WEBHOOKS = "meter_webhooks_total"
WEBHOOKS_PENDING = "meter_webhooks_pending"
WEBHOOKS_OLDEST = "meter_webhooks_oldest_pending_seconds"
UNIQUE_CLAIMS = "meter_unique_claims_total"
UNIQUE_UNRESOLVED = "meter_unique_claims_unresolved"
VOIDS = "meter_voids_total"
PERIOD_OVERDUE = "meter_period_close_overdue_seconds"
PERIOD_OLDEST_OPEN = "meter_period_oldest_open"
READY = "meter_ready"
DEGRADED = "meter_degraded"
BUILD_INFO = "meter_build_info"

#: Every metric family the node exports (full names: counters end in ``_total``).
METRIC_NAMES: tuple[str, ...] = (
    REQUESTS, REQUEST_DURATION, REFUSALS, CONNECTIONS, CONNECTIONS_ACCEPTED, PROTOCOL_ERRORS,
    KEYS, FLUSH_ROUNDS, FLUSH_FAILURES, FLUSH_DURATION, FLUSH_KEYS_WRITTEN, FLUSH_WRITES,
    FLUSH_WRITE_UNITS, FLUSH_CPU, FLUSH_BACKLOG_KEYS,
    FLUSH_BACKLOG_UNITS, FLUSH_BACKLOG_AGE, FLUSH_PARKED_KEYS, UNITS_STORED, UNITS_REMOVED,
    SEEDING_READS, SEEDING_FAILED_READS, WAL_SIZE, WAL_SEGMENTS, WAL_OLDEST_AGE, WAL_COMMITS,
    WAL_FSYNCS, WAL_FSYNC_DURATION, WAL_FAILURES, WAL_WRITABLE, GOSSIP_BUS_CONNECTED,
    GOSSIP_PEERS, GOSSIP_LAG, GOSSIP_MESSAGES, GOSSIP_REJECTED, GOSSIP_GAPS, RESERVATIONS_OPEN,
    RESERVATIONS_EXPIRED, STRICT_SHARES, STRICT_WRITES, READY, DEGRADED, BUILD_INFO,
    ALERTS, ALERTS_PENDING, UNIQUE_CLAIMS, UNIQUE_UNRESOLVED, VOIDS, PERIOD_OVERDUE,
    PERIOD_OLDEST_OPEN, WEBHOOKS, WEBHOOKS_PENDING, WEBHOOKS_OLDEST,
)  # fmt: skip


#: The table's counts (``meter_keys``, ``meter_flush_backlog_keys`` and ``_units``) are
#: reused for this many seconds after they were taken.
TABLE_COUNTS_MAX_AGE_S = 1.0


@dataclass(frozen=True)
class TableCounts:
    """What a scrape reads by walking the table, and when it was taken (``time.monotonic()``)."""

    taken: float
    keys: TableStats
    backlog_keys: int | None
    backlog_units: int | None


def _counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)  # (it drops the ``_total`` itself)


def _histogram(name: str, doc: str, labels: list[str], series: dict[str, Buckets]) -> Metric:
    fam = HistogramMetricFamily(name, doc, labels=labels)
    for value, hist in sorted(series.items()):
        fam.add_metric([value] if labels else [], hist.cumulative(), hist.sum)
    return fam


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class NodeCollector(Collector):
    """Reads one node at scrape time."""

    def __init__(self, node: NodeView, requests: RequestStats, units: FeatureUnits) -> None:
        self.node = node
        self.requests = requests
        self.units = units
        self._counts: TableCounts | None = None

    def table_counts(self) -> TableCounts | None:
        """The table's counts, taken again only when the last are over
        :data:`TABLE_COUNTS_MAX_AGE_S` old (``None`` before the table exists)."""
        node = self.node
        if node.table is None:
            return None
        now = time.monotonic()
        counts = self._counts
        if counts is None or now - counts.taken > TABLE_COUNTS_MAX_AGE_S:
            backlog = None if node.flusher is None else node.flusher.backlog()
            counts = self._counts = TableCounts(
                taken=now,
                keys=node.table.stats(),
                backlog_keys=None if backlog is None else len(backlog[0]),
                backlog_units=None if backlog is None else backlog[1],
            )
        return counts

    def collect(self) -> Iterator[Metric]:
        node = self.node
        yield from self._requests()
        yield from self._units()
        counts = self.table_counts()
        if counts is not None:
            st = counts.keys
            keys = GaugeMetricFamily(KEYS, "Keys in memory, by state.", labels=["state"])
            for state, n in (
                ("warm", st.warm),
                ("dirty", st.dirty),
                ("unseeded", st.unseeded),
                ("inflight", st.inflight),
                ("reserved", st.reserved_keys),
            ):
                keys.add_metric([state], n)
            yield keys
        if node.flusher is not None and counts is not None:
            yield from self._flush(counts)
        if node.service is not None:
            svc = node.service
            yield _gauge(RESERVATIONS_OPEN, "Reservations open.", len(svc.reservations))
            expired = _counter(RESERVATIONS_EXPIRED, "Reservations released at their deadline.")
            expired.add_metric([], svc.reservations.expired_total)
            yield expired
            seeding = svc.seeder.stats
            reads = _counter(SEEDING_READS, "Storage reads that seeded cold keys.")
            reads.add_metric([], seeding.reads)
            yield reads
            failed = _counter(SEEDING_FAILED_READS, "Seeding reads that failed.")
            failed.add_metric([], seeding.failed_reads)
            yield failed
            voids = _counter(
                VOIDS,
                "Calls taken back by void (each once), by outcome: voided, undone (the "
                "void's log write failed: its units counted again).",
                ["outcome"],
            )
            voids.add_metric(["voided"], svc.ids.voided_total)
            voids.add_metric(["undone"], svc.ids.voids_undone)
            yield voids
            uq = svc.uniques
            claims = _counter(
                UNIQUE_CLAIMS,
                "Outcomes of claims of unique values: won (counted here), lost (counted "
                "already), refused (storage cannot keep the value), undone (its log write "
                "failed: decided again).",
                ["outcome"],
            )
            for outcome, n in (("won", uq.won), ("lost", uq.lost), ("refused", uq.refused),
                               ("undone", uq.undone)):  # fmt: skip
                claims.add_metric([outcome], n)
            yield claims
            open_ = "Claims of unique values without an outcome: in flight or waiting for "
            yield _gauge(UNIQUE_UNRESOLVED, open_ + "storage to answer (each counted at most "
                         "once).", len(uq.pending) + len(uq.flying))  # fmt: skip
        closer = node.closer
        if closer is not None:
            grace, oldest = node.config.counters.period_grace_s, closer.oldest_open()
            yield _gauge(
                PERIOD_OVERDUE,
                "Seconds since this node's oldest period not closed should have closed (its "
                "end plus period_grace_s; 0: none overdue).",
                overdue_s(oldest, grace, time.time()),
            )
            named = GaugeMetricFamily(
                PERIOD_OLDEST_OPEN,
                "This node's oldest period not closed (label period; no series: none), valued "
                "at when it may close: its end plus period_grace_s, Unix seconds.",
                labels=["period"],
            )
            if oldest is not None:
                named.add_metric([oldest], period_closes_at(oldest, grace))
            yield named
        shares = node.shares
        if shares is not None:
            yield _gauge(STRICT_SHARES, "Strict budgets this node holds a share of.",
                         len(shares.local))  # fmt: skip
            writes = _counter(
                STRICT_WRITES,
                "Strict budget writes (compare-and-swap), by outcome: written, conflict (a "
                "race lost, decided again), failed (storage refused or unreachable).",
                ["outcome"],
            )
            writes.add_metric(["written"], shares.writes - shares.conflicts)
            writes.add_metric(["conflict"], shares.conflicts)
            writes.add_metric(["failed"], shares.errors)
            yield writes
        al = node.alerts
        if al is not None:
            alerts = _counter(
                ALERTS,
                "Threshold alerts: fired (claims this node won), delivered (to this node's "
                "subscribers), dropped (crossings left unclaimed, too many pending).",
                ["event"],
            )
            for event, n in (("fired", al.fired), ("delivered", al.delivered),
                             ("dropped", al.dropped)):  # fmt: skip
                alerts.add_metric([event], n)
            yield alerts
            yield _gauge(ALERTS_PENDING, "Threshold crossings waiting for their claim.",
                         len(al.pending))  # fmt: skip
        if node.webhooks is not None:
            wh = node.webhooks.status()
            hooks = _counter(
                WEBHOOKS, "Webhook deliveries: delivered (2xx), failed (given up).", ["result"]
            )
            hooks.add_metric(["delivered"], wh["delivered"])
            hooks.add_metric(["failed"], wh["failed"])
            yield hooks
            yield _gauge(WEBHOOKS_PENDING, "Webhook deliveries waiting.", wh["pending"])
            yield _gauge(WEBHOOKS_OLDEST, "Age of the oldest waiting webhook delivery.",
                         wh["oldest_pending_s"])  # fmt: skip
        if node.wal is not None:
            yield from self._wal()
        if node.gossip is not None:
            yield from self._gossip()
        checks = health_checks(node)
        yield _gauge(READY, "1 if the node can take counting calls.", int(can_count(checks)))
        yield _gauge(
            DEGRADED,
            "1 if storage or the bus is not answering (the node still counts).",
            int(any(checks[c] is not None for c in ("storage", "bus"))),
        )
        info = GaugeMetricFamily(BUILD_INFO, "Always 1.", labels=["version", "node_id"])
        info.add_metric([__version__, node.table.node if node.table else ""], 1)
        yield info

    def _requests(self) -> Iterator[Metric]:
        req = self.requests
        fam = _counter(
            REQUESTS, "Requests answered, by method and result (ok or the error code).",
            ["method", "result"],
        )  # fmt: skip
        for method, n in sorted(req.ok_counts().items()):
            fam.add_metric([method, "ok"], n)
        refusals: dict[str, int] = dict.fromkeys(BY_CODE, 0)  # every code, from the start
        for (method, code), n in sorted(req.errors.items()):
            fam.add_metric([method, code], n)
            refusals[code] = refusals.get(code, 0) + n
        yield fam
        yield _histogram(
            REQUEST_DURATION,
            "From the read of a request to its answer handed to the socket, by method.",
            ["method"],
            req.latency,
        )
        if self.node.service is not None:
            for code, n in self.node.service.item_refusals.items():
                refusals[code] = refusals.get(code, 0) + n
        ref = _counter(REFUSALS, "Calls and track_many items refused, by error code.", ["reason"])
        for code, n in sorted(refusals.items()):
            ref.add_metric([code], n)
        yield ref
        server = self.node.server
        if server is not None:
            yield _gauge(CONNECTIONS, "Open client connections.", server.connections)
            acc = _counter(CONNECTIONS_ACCEPTED, "Client connections accepted.")
            acc.add_metric([], server.accepted)
            yield acc
            pe = _counter(PROTOCOL_ERRORS, "Connections closed for bytes not a valid request.")
            pe.add_metric([], server.protocol_errors)
            yield pe

    def _units(self) -> Iterator[Metric]:
        u = self.units
        for name, doc, series in (
            (UNITS_STORED, "Units this node counted, once storage holds them.", u.added),
            (UNITS_REMOVED, "Units this node subtracted, once storage holds it.", u.removed),
        ):
            if u.cap:
                fam = _counter(name, doc + " By feature.", ["feature"])
                for feature, n in sorted(series.items()):
                    fam.add_metric([feature], n)
            else:
                fam = _counter(name, doc)
                fam.add_metric([], sum(series.values()))
            yield fam

    def _flush(self, counts: TableCounts) -> Iterator[Metric]:
        node = self.node
        assert node.flusher is not None
        fs = node.flusher.stats
        for name, doc, n in (
            (FLUSH_ROUNDS, "Flush rounds.", fs.rounds),
            (FLUSH_FAILURES, "Flush failures (writes, reads and owner checks).", fs.failures),
            (FLUSH_KEYS_WRITTEN, "Keys whose delta storage took.", fs.keys_written),
        ):
            fam = _counter(name, doc)
            fam.add_metric([], n)
            yield fam
        ws = node.flusher.storage.write_stats()
        fam = _counter(
            FLUSH_WRITES,
            "Flush write requests sent: UpdateItem calls and transactions (DynamoDB; else 0).",
            ["kind"],
        )
        fam.add_metric(["single"], ws.writes - ws.transactions)
        fam.add_metric(["transaction"], ws.transactions)
        yield fam
        for name, doc, value in (
            (FLUSH_WRITE_UNITS, "Write units the flush writes cost (DynamoDB, items <= 1 KB).",
             ws.write_units),
            (FLUSH_CPU, "Process CPU seconds while flush rounds ran (an upper bound of theirs).",
             fs.cpu_seconds),
        ):  # fmt: skip
            fam = _counter(name, doc)
            fam.add_metric([], value)
            yield fam
        yield _histogram(FLUSH_DURATION, "Flush round duration.", [], {"": fs.round_seconds})
        yield _gauge(FLUSH_BACKLOG_KEYS, "Keys with units storage does not have.",
                     counts.backlog_keys or 0)  # fmt: skip
        yield _gauge(
            FLUSH_BACKLOG_UNITS,
            "Units storage does not have (parked keys excluded).",
            counts.backlog_units or 0,
        )
        since = fs.backlog_since
        yield _gauge(
            FLUSH_BACKLOG_AGE,
            "Seconds since the first failure storage has not caught up on (0: none).",
            0.0 if since is None else max(0.0, time.time() - since),
        )
        yield _gauge(FLUSH_PARKED_KEYS, "Keys parked after a permanent write error.",
                     len(fs.poisoned))  # fmt: skip

    def _wal(self) -> Iterator[Metric]:
        wal = self.node.wal
        assert wal is not None
        st = wal.status()
        yield _gauge(WAL_SIZE, "Bytes of write-ahead log on disk.", st["size_bytes"])
        yield _gauge(WAL_SEGMENTS, "Write-ahead log segment files.", st["segments"])
        age = st["oldest_segment_age_s"]
        yield _gauge(
            WAL_OLDEST_AGE, "Age of the oldest log segment, since its first record.", age or 0.0
        )
        for name, doc, n in (
            (WAL_COMMITS, "Log commits (one write per event-loop pass).", wal.commits),
            (WAL_FSYNCS, "Log syncs (fdatasync).", wal.fsyncs),
            (WAL_FAILURES, "Log writes or syncs that failed.", wal.failures),
        ):
            fam = _counter(name, doc)
            fam.add_metric([], n)
            yield fam
        yield _histogram(WAL_FSYNC_DURATION, "Log sync duration.", [], {"": wal.fsync_seconds})
        yield _gauge(WAL_WRITABLE, "1 if the log can be written.", int(wal.broken is None))

    def _gossip(self) -> Iterator[Metric]:
        g = self.node.gossip
        assert g is not None
        yield _gauge(GOSSIP_BUS_CONNECTED, "1 if the bus (Redis) is connected.",
                     int(g.bus.connected))  # fmt: skip
        peers = GaugeMetricFamily(GOSSIP_PEERS, "Peers heard from, by state.", labels=["state"])
        alive = [p for p in g.peers.by_node.values() if p.alive]
        peers.add_metric(["alive"], len(alive))
        peers.add_metric(["dead"], len(g.peers.by_node) - len(alive))
        yield peers
        worst = 0.0
        for p in alive:
            lags = sorted(p.lags)
            if lags:
                worst = max(worst, lags[min(len(lags) - 1, int(0.99 * len(lags)))])
        yield _gauge(
            GOSSIP_LAG,
            "The highest p99 gossip lag (receive time - send time) of a live peer's recent "
            "messages.",
            max(0.0, worst),
        )
        msgs = _counter(GOSSIP_MESSAGES, "Gossip messages accepted from peers.")
        msgs.add_metric([], g.received["messages"])
        yield msgs
        rej = _counter(GOSSIP_REJECTED, "Gossip messages refused, by reason.", ["reason"])
        for reason, n in sorted(g.rejected.items()):
            rej.add_metric([reason], n)
        yield rej
        gaps = _counter(GOSSIP_GAPS, "Sequence gaps seen in peers' messages (lost messages).")
        gaps.add_metric([], sum(p.gaps for p in g.peers.by_node.values()))
        yield gaps


def build_registry(
    node: NodeView, requests: RequestStats, units: FeatureUnits
) -> CollectorRegistry:
    """A registry of its own holding ``node``'s collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(node, requests, units))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format."""
    return generate_latest(registry)
