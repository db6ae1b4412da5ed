"""Scenario 13, corrections (docs/protocol.md, ``void``): what a ``void`` costs against the
``track`` it takes back, side by side in one run.

Each of 4 worker processes, one connection each, unpipelined, sends ``track`` calls under
fresh request ids (the calls a void can take back), then a ``void`` of each of them, every id
once: both phases of all workers run at the same time, and a round's ratio is the voids' rate
over the tracks' rate. The node is the compiled build on memory storage without a log (as
scenario 1), tenant ``acme/u<worker>`` with the hierarchy on and feature ``f`` declared with
dimension ``model``, so each call counts (and each void takes back) on 4 counters.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import msgpack

from bench.harness import NODE_MEMORY, Progress, Row, Services, Sizes, median, node_status

SCENARIO = "13 corrections (memory storage)"
WORKERS = 4


def corrections(svc: Services, sizes: Sizes, progress: Progress) -> list[Row]:
    node = svc.node("voids", METER_TENANT_HIERARCHY="true")
    compiled = bool((node_status(node).get("build") or {}).get("compiled"))
    try:
        node.call("set_feature", "f", {"dimensions": ["model"]})
        calls = max(2000, int(10_000 * sizes.duration))
        ratios: list[float] = []
        tracks: list[float] = []
        voids: list[float] = []
        errors = 0
        with ProcessPoolExecutor(WORKERS) as pool:
            for r in range(sizes.rounds):
                progress(f"void vs track, round {r + 1}/{sizes.rounds}")
                jobs = [pool.submit(_worker, str(node.socket), w, r, calls) for w in range(WORKERS)]
                done = [j.result() for j in jobs]
                track_s = max(d[0] for d in done)
                void_s = max(d[1] for d in done)
                errors += sum(d[2] for d in done)
                tracks.append(WORKERS * calls / track_s)
                voids.append(WORKERS * calls / void_s)
                ratios.append(track_s / void_s)
    finally:
        svc.stop_node(node)
    ratio = median(ratios)
    return [
        Row(
            SCENARIO,
            "void vs the track it takes back (4 counters), 4 conn",
            "ops/s",
            median(voids),
            median(tracks),
            ratio,
            ">= 0.8x",
            ratio >= 0.8 and errors == 0 and compiled,
            {
                **NODE_MEMORY,
                "connections": WORKERS,
                "calls_per_worker_round": calls,
                "errors": errors,
                "rounds_ratio": ratios,
            },
            "measured",
        )
    ]


def _worker(path: str, worker: int, round_: int, calls: int) -> tuple[float, float, int]:
    """Track ``calls`` calls under fresh ids, then void each; each phase's seconds, and the
    error answers."""
    tenant = f"acme/u{worker}"
    ids = [f"r{round_}-w{worker}-{i}" for i in range(calls)]
    tracks = [msgpack.packb([0, i, "track", [tenant, "f", 1, {"id": rid, "dims": {"model": "a"}}]])
              for i, rid in enumerate(ids)]  # fmt: skip
    voids = [msgpack.packb([0, i, "void", [rid]]) for i, rid in enumerate(ids)]
    errors = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        unpacker = msgpack.Unpacker(raw=False)
        seconds: list[float] = []
        for frames in (tracks, voids):
            start = time.perf_counter()
            for frame in frames:
                s.sendall(frame)
                errors += _answer(s, unpacker)
            seconds.append(time.perf_counter() - start)
    return seconds[0], seconds[1], errors


def _answer(s: socket.socket, unpacker: Any) -> int:
    """Read one answer: 1 if it is an error."""
    while True:
        for msg in unpacker:
            return 0 if msg[2] is None else 1
        data = s.recv(65536)
        if not data:
            raise ConnectionError("the node closed the connection")
        unpacker.feed(data)
