"""Scenario 9: what metrics cost the hot path.

A node with ``metrics_address`` set, scraped every second while it is loaded, against the same
node without it, side by side in one run (alternating which goes first, as every scenario).
Both run on memory storage with no log, as scenario 1, so the request path is all there is to
measure. Per shape:

- **the cost** (judged, target at most 3 %): what metrics add to a request's CPU on the
  server's path, measured in process (``bench.micro.metrics_pair``: ``data_received`` fed
  passes of the shape's depth, metrics off and on in turn, 21 rounds, each side's fastest), as
  a share of what a request costs the node end to end (its CPU time over the requests it
  counted, from ``/proc``, metrics off);
- the end-to-end CPU per request, on against off, and ``track`` throughput: context. On
  2 cores the load generator competes with the node, and round-to-round noise (10-15 %) is
  larger than the effect measured, so these cannot judge a 3 % target either way.
"""

from __future__ import annotations

import threading
import urllib.request
from dataclasses import dataclass
from functools import partial

from bench.harness import (
    ALTERNATING,
    NODE_MEMORY,
    Progress,
    Row,
    Services,
    Sizes,
    cpu_seconds,
    in_turn,
    median,
    ratios,
)
from bench.loadgen import Load, LoadResult, run_load
from bench.micro import metrics_pair, service
from tests.support.nodes import NodeProcess

METRICS = "9 metrics cost (memory storage)"
#: (connections, depth) per mode: unpipelined calls pay the per-request counting once per
#: read; a pipelined batch pays it once for the batch.
CONFIGS = {"smoke": ((2, 4),), "quick": ((4, 1), (4, 16)), "full": ((1, 1), (4, 1), (4, 16))}
#: How often the metrics side is scraped while loaded.
SCRAPE_INTERVAL_S = 1.0
#: The node's CPU per request with metrics on, at most this many times without.
COST_TARGET = 1.03


class _Scraper:
    """GETs ``/metrics`` every :data:`SCRAPE_INTERVAL_S` in a thread until stopped."""

    def __init__(self, address: str) -> None:
        self.url = f"http://{address}/metrics"
        self.scrapes = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._opener.open(self.url, timeout=10) as resp:
                self.bytes += len(resp.read())
            self.scrapes += 1
            self._stop.wait(SCRAPE_INTERVAL_S)

    def __enter__(self) -> _Scraper:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)


@dataclass
class _Round:
    load: LoadResult
    cpu_s: float  # the node's CPU time over the round
    requests: int  # requests the node counted over the round

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_s / self.requests * 1e6 if self.requests else 0.0


def _measured(node: NodeProcess, load: Load, scraper: _Scraper | None) -> _Round:
    assert node.proc is not None
    pid = node.proc.pid
    before = node.call("status")["server"]["requests"]
    cpu = cpu_seconds(pid)
    if scraper is None:
        result = run_load(load)
    else:
        with scraper:
            result = run_load(load)
    cpu = cpu_seconds(pid) - cpu
    requests = node.call("status")["server"]["requests"] - before - 1  # (this status)
    return _Round(result, cpu, requests)


def metrics_cost(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    """``track`` with metrics on (and scraped) against metrics off."""
    on = svc.node("metrics-on", METER_METRICS_ADDRESS="127.0.0.1:0")
    off = svc.node("metrics-off")
    address = on.call("status")["metrics"]["address"]
    scraper = _Scraper(address)
    rows: list[Row] = []
    for conns, depth in CONFIGS[sizes.name]:
        mine = Load("meter", str(on.socket), "track", conns, depth, duration=sizes.duration)
        theirs = Load("meter", str(off.socket), "track", conns, depth, duration=sizes.duration)
        ours: list[_Round] = []
        ref: list[_Round] = []
        for r in range(sizes.rounds):
            progress(f"metrics on vs off: {conns} conn, depth {depth}, round {r + 1}")
            a, b = in_turn(
                r, partial(_measured, on, mine, scraper), partial(_measured, off, theirs, None)
            )
            ours.append(a)
            ref.append(b)
        errors = sum(x.load.errors for x in ours + ref)
        shape = f"{conns} conn" + (f", pipelined {depth}" if depth > 1 else "")
        detail = {
            "connections": conns,
            "depth": depth,
            "errors": errors,
            **NODE_MEMORY,
            "scrape_interval_s": SCRAPE_INTERVAL_S,
            "order": ALTERNATING,
        }
        o_cpu = [x.cpu_us_per_request for x in ours]
        r_cpu = [x.cpu_us_per_request for x in ref]
        node_us = median(r_cpu)
        off_ns, on_ns = metrics_pair(service(), depth)
        added_us = max(0.0, on_ns - off_ns) / 1000
        share = 1 + added_us / node_us if node_us else float("inf")
        rows.append(
            Row(
                METRICS,
                f"cost: node CPU per track with metrics' added CPU, {shape}",
                "us",
                node_us + added_us,
                node_us,
                share,
                f"<= {COST_TARGET}x metrics off",
                share <= COST_TARGET and errors == 0,
                {
                    **detail,
                    "added_ns_in_process": on_ns - off_ns,
                    "server_path_ns_off": off_ns,
                    "server_path_ns_on": on_ns,
                    "node_cpu_us_per_request_off": node_us,
                },
            )
        )
        rows.append(
            Row(
                METRICS,
                f"node CPU per track end to end, metrics on vs off, {shape}",
                "us",
                median(o_cpu),
                node_us,
                ratios(o_cpu, r_cpu),
                "(context: noisy)",
                True,
                {**detail, "rounds_on_us": o_cpu, "rounds_off_us": r_cpu},
            )
        )
        o_ops = [x.load.ops_per_s for x in ours]
        r_ops = [x.load.ops_per_s for x in ref]
        rows.append(
            Row(
                METRICS,
                f"track, metrics on vs off, {shape}",
                "ops/s",
                median(o_ops),
                median(r_ops),
                ratios(o_ops, r_ops),
                "(context: noisy)",
                True,
                {**detail, "rounds_on_ops": o_ops, "rounds_off_ops": r_ops},
            )
        )
    rows[-1].detail["scrapes"] = scraper.scrapes
    rows[-1].detail["scrape_bytes"] = scraper.bytes
    svc.stop_node(on)
    svc.stop_node(off)
    return rows
