"""Scenario 9: what metrics cost the hot path.

``track`` throughput of a node with ``metrics_address`` set, scraped every second while it is
loaded, against the same node without it, side by side in one run (alternating which goes
first, as every scenario). Both run on memory storage with no log, as scenario 1, so the
request path is all there is to measure. Target: metrics on keeps >= 97 % of the throughput.
"""

from __future__ import annotations

import threading
import urllib.request
from functools import partial

from bench.loadgen import Load, LoadResult, run_load
from bench.scenarios import ALTERNATING, NODE_MEMORY, Progress, Row, Sizes, _in_turn, _median
from bench.scenarios import _ratios as ratios
from bench.services import Services

METRICS = "9 metrics cost (memory storage)"
#: (connections, depth) per mode: unpipelined calls pay the per-request counting once per
#: read; a pipelined batch pays it once for the batch.
CONFIGS = {"smoke": ((2, 4),), "quick": ((4, 1), (4, 16)), "full": ((1, 1), (4, 1), (4, 16))}
#: How often the metrics side is scraped while loaded.
SCRAPE_INTERVAL_S = 1.0
TARGET = 0.97


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


def _scraped(scraper: _Scraper, load: Load) -> LoadResult:
    with scraper:
        return run_load(load)


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
        ours: list[LoadResult] = []
        ref: list[LoadResult] = []
        for r in range(sizes.rounds):
            progress(f"metrics on vs off: {conns} conn, depth {depth}, round {r + 1}")
            a, b = _in_turn(r, partial(_scraped, scraper, mine), partial(run_load, theirs))
            ours.append(a)
            ref.append(b)
        errors = sum(x.errors for x in ours + ref)
        o_ops = [x.ops_per_s for x in ours]
        r_ops = [x.ops_per_s for x in ref]
        ratio = ratios(o_ops, r_ops)
        label = f"track, metrics on vs off, {conns} conn" + (
            f", pipelined {depth}" if depth > 1 else ""
        )
        rows.append(
            Row(
                METRICS,
                label,
                "ops/s",
                _median(o_ops),
                _median(r_ops),
                ratio,
                f">= {TARGET}x metrics off",
                ratio >= TARGET and errors == 0,
                {
                    "connections": conns,
                    "depth": depth,
                    "errors": errors,
                    **NODE_MEMORY,
                    "scrape_interval_s": SCRAPE_INTERVAL_S,
                    "rounds_on_ops": o_ops,
                    "rounds_off_ops": r_ops,
                    "order": ALTERNATING,
                },
            )
        )
    rows[-1].detail["scrapes"] = scraper.scrapes
    rows[-1].detail["scrape_bytes"] = scraper.bytes
    svc.stop_node(on)
    svc.stop_node(off)
    return rows
