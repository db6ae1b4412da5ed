"""Scenario 15: what HTTP/JSON costs (docs/http.md).

One node (memory storage, no log, as scenario 1) with the API on its own Unix socket and the
probes on TCP, and beside it a bare aiohttp server on uvloop (``python -m bench.http_cost
bare``) whose handlers answer a constant, measured in the same rounds, taking turns going
first:

- **track over HTTP/JSON vs a bare aiohttp handler** (judged, target at least 0.8x): the same
  POST, keep-alive, on a Unix socket; what the API adds to aiohttp's own cost (parsing the
  JSON, the method table, the dispatch, the answer) is the gap;
- the server's CPU per ``track``, bare against the API (judged the same way: on 2 cores the
  load generator's processes compete with the servers, so throughput moves with them, while
  the CPU a server spends per request does not);
- track over HTTP/JSON vs the same over MessagePack-RPC on the node's RPC socket: context,
  what a client pays for HTTP;
- ``/healthz`` on the node's probe listener vs the bare server's, and ``/metrics`` scrapes per
  second (the probes now run on aiohttp): context.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from bench.harness import (
    NODE_MEMORY,
    Progress,
    Row,
    Services,
    Sizes,
    cpu_seconds,
    in_turn,
    load_rounds,
    median,
    ratios,
)
from bench.loadgen import Load, LoadResult, run_load

HTTP = "15 HTTP/JSON API (memory storage)"
#: The API's ``track`` against the bare handler: at least this share of its throughput.
TARGET = 0.8
#: (connections, depth) per mode.
CONFIGS = {
    "smoke": ((2, 1),),
    "quick": ((1, 1), (4, 1), (4, 16)),
    "full": ((1, 1), (4, 1), (16, 1), (4, 16)),
}


def _bare(path: str, port_file: str) -> None:
    """A bare aiohttp server: ``POST /v1/track`` answers ``{"result":1}``, ``GET /healthz``
    ``ok``; on the Unix socket ``path`` and on a TCP port it writes to ``port_file``."""
    import uvloop
    from aiohttp import web

    async def track(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text='{"result":1}', content_type="application/json")

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/track", track)
        app.router.add_get("/healthz", healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.UnixSite(runner, path).start()
        sock = socket.create_server(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        Path(port_file).write_text(str(sock.getsockname()[1]))
        await asyncio.Event().wait()

    uvloop.run(main())


def _start_bare(workdir: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    path = str(workdir / "bare-http.sock")
    port_file = workdir / "bare-http.port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.http_cost", "bare", path, str(port_file)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    deadline = time.monotonic() + 20
    while not (port_file.exists() and port_file.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the bare aiohttp server did not start")
        time.sleep(0.05)
    return proc, path, f"tcp:127.0.0.1:{port_file.read_text()}"


def _rounds(
    sizes: Sizes,
    loads: dict[str, Load],
    pids: dict[str, int | None],
    progress: Progress,
    what: str,
) -> tuple[dict[str, list[LoadResult]], dict[str, list[float]]]:
    """Each side's loads in rotation (:func:`in_turn`), and the CPU its server spent per
    request (microseconds; the warm-up's requests estimated at the measured rate)."""
    got: dict[str, list[LoadResult]] = {who: [] for who in loads}
    cpu: dict[str, list[float]] = {who: [] for who in loads if pids[who] is not None}
    rounds = -(-sizes.rounds // len(loads)) * len(loads)

    def side(who: str) -> tuple[LoadResult, float]:
        before = cpu_seconds(pids[who])
        result = run_load(loads[who])
        spent = cpu_seconds(pids[who]) - before
        load = loads[who]
        requests = result.ops * (load.warmup + load.duration) / load.duration
        return result, spent / requests * 1e6 if requests else 0.0

    for r in range(rounds):
        progress(f"{what}, round {r + 1}/{rounds}")
        for who, (result, us) in zip(
            loads, in_turn(r, *(partial(side, w) for w in loads)), strict=True
        ):
            got[who].append(result)
            if who in cpu:
                cpu[who].append(us)
    return got, cpu


def http_cost(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    """``track`` over HTTP/JSON against a bare aiohttp handler and against MessagePack-RPC;
    the probes against the bare server's."""
    api_sock = str(svc.workdir / "http-api.sock")
    node = svc.node("http", METER_HTTP_SOCKET=api_sock, METER_METRICS_ADDRESS="127.0.0.1:0")
    probes = "tcp:" + node.call("status")["metrics"]["address"]
    bare, bare_sock, bare_tcp = _start_bare(svc.workdir)
    rows: list[Row] = []
    try:
        for conns, depth in CONFIGS[sizes.name]:
            d = sizes.duration
            loads = {
                "http": Load("http", api_sock, "track", conns, depth, duration=d),
                "bare": Load("http", bare_sock, "track", conns, depth, duration=d),
                "rpc": Load("meter", str(node.socket), "track", conns, depth, duration=d),
            }
            shape = f"{conns} conn" + (f", pipelined {depth}" if depth > 1 else "")
            pids = {"http": node.proc.pid if node.proc else None, "bare": bare.pid, "rpc": None}
            got, cpu = _rounds(sizes, loads, pids, progress, f"track over HTTP: {shape}")
            ops = {who: [x.ops_per_s for x in res] for who, res in got.items()}
            errors = sum(x.errors for res in got.values() for x in res)
            p99 = {who: median([x.percentile_us(99) for x in res]) for who, res in got.items()}
            detail = {
                "connections": conns,
                "depth": depth,
                "errors": errors,
                **NODE_MEMORY,
                "p99_us": p99,
                **{f"rounds_{who}_ops": x for who, x in ops.items()},
                **{f"rounds_{who}_cpu_us": x for who, x in cpu.items()},
                "order": "rotating: http, bare, rpc; then bare, rpc, http; ...",
            }
            ratio = ratios(ops["http"], ops["bare"])
            rows.append(
                Row(
                    HTTP,
                    f"track over HTTP/JSON vs a bare aiohttp handler, {shape}",
                    "ops/s",
                    median(ops["http"]),
                    median(ops["bare"]),
                    ratio,
                    f">= {TARGET}x bare aiohttp",
                    ratio >= TARGET and errors == 0,
                    detail,
                )
            )
            # The server's CPU per request: what the loaders' share of 2 cores leaves out.
            cpu_ratio = ratios(cpu["bare"], cpu["http"])
            rows.append(
                Row(
                    HTTP,
                    f"server CPU per track, bare aiohttp / HTTP/JSON (higher: cheaper), {shape}",
                    "us",
                    median(cpu["http"]),
                    median(cpu["bare"]),
                    cpu_ratio,
                    f">= {TARGET}x (the API costs at most 1/{TARGET} of bare's CPU)",
                    cpu_ratio >= TARGET and errors == 0,
                    detail,
                )
            )
            rows.append(
                Row(
                    HTTP,
                    f"track over HTTP/JSON vs MessagePack-RPC, {shape}",
                    "ops/s",
                    median(ops["http"]),
                    median(ops["rpc"]),
                    ratios(ops["http"], ops["rpc"]),
                    "(context)",
                    None,
                    detail,
                )
            )
        d = sizes.duration
        loads = {
            "node": Load("http", probes, "GET", 2, 1, duration=d, target="/healthz"),
            "bare": Load("http", bare_tcp, "GET", 2, 1, duration=d, target="/healthz"),
        }
        got = load_rounds(-(-sizes.rounds // len(loads)) * len(loads), loads, progress, "/healthz")
        ops = {who: [x.ops_per_s for x in res] for who, res in got.items()}
        errors = sum(x.errors for res in got.values() for x in res)
        rows.append(
            Row(
                HTTP,
                "/healthz on the node's probe listener vs a bare aiohttp handler, 2 conn",
                "ops/s",
                median(ops["node"]),
                median(ops["bare"]),
                ratios(ops["node"], ops["bare"]),
                "(context)",
                None,
                {"errors": errors, **{f"rounds_{w}_ops": x for w, x in ops.items()}},
            )
        )
        metrics = run_load(Load("http", probes, "GET", 1, 1, duration=d, target="/metrics"))
        rows.append(
            Row(
                HTTP,
                "/metrics scrapes per second, 1 conn (p50 in detail)",
                "ops/s",
                metrics.ops_per_s,
                None,
                None,
                "(context)",
                None,
                {"errors": metrics.errors, "p50_us": metrics.percentile_us(50)},
            )
        )
    finally:
        bare.kill()
        bare.wait()
        svc.stop_node(node)
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["bare"]:
        _bare(sys.argv[2], sys.argv[3])
