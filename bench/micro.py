"""In-process micro-benchmarks of the hot path (no sockets): per-call cost of the layers.

Used to measure each optimisation in isolation (``python -m bench.micro``); the end-to-end
scenarios are in :mod:`bench.scenarios`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgpack

from bench.harness import NullTransport
from meter.core.counts import RequestStats
from meter.core.protocol import Decoder, Encoder, Request
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.node.wiring import build_service
from storage.base import EMPTY
from storage.memory import MemoryStorage


def _best(fn: Callable[[], object], n: int, repeat: int = 5) -> float:
    """Best-of-``repeat`` nanoseconds per call of ``fn`` over ``n`` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def _best_each(fn: Callable[[Any], object], args: list[Any], repeat: int = 5) -> float:
    """Best-of-``repeat`` nanoseconds per call of ``fn(a)`` for each ``a`` of ``args``."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for a in args:
            fn(a)
        best = min(best, (time.perf_counter_ns() - t0) / len(args))
    return best


def measure() -> dict[str, float]:
    """ns per operation for each layer of a ``track`` and a 100-item ``track_many``."""
    svc = service()
    table = svc.table
    items = [["micro-t", f"f{j}", 1] for j in range(100)]
    key = svc.key_for("micro-t", "f0")
    out: dict[str, float] = {}
    out["table.incr"] = _best(lambda: table.incr(key, 1), 100_000)
    out["service.key_for"] = _best(lambda: svc.key_for("micro-t", "f0"), 100_000)
    out["service.track"] = _best(lambda: svc.dispatch("track", ["micro-t", "f0", 1]), 100_000)
    # As from the wire: names decoded afresh for each request (equal strings, new objects).
    decoded = [msgpack.unpackb(msgpack.packb(["micro-t", f"f{i % 100}", 1])) for i in range(10_000)]
    out["service.track (decoded names)"] = _best_each(lambda p: svc.dispatch("track", p), decoded)

    def key_miss(p: list[Any]) -> None:
        svc.keys.cache.clear()  # a key cache miss on names already known, as after a cache restart
        svc.key_for(p[0], p[1])

    out["service.key_for miss (known)"] = _best_each(key_miss, decoded[:2000])
    out["service.track_many/item"] = _best(lambda: svc.dispatch("track_many", [items]), 1000) / 100
    frames = b"".join(msgpack.packb([0, i, "track", ["micro-t", "f0", 1]]) for i in range(16))
    dec = Decoder()
    enc = Encoder()

    def codec() -> None:
        answers: list[tuple[int, dict[str, str] | None, Any]] = []
        for msg in dec.feed(frames):
            assert type(msg) is Request
            answers.append((msg.msgid, None, 1))
        enc.responses(answers)

    out["codec/request (batch 16)"] = _best(codec, 10_000) / 16
    out["server/track (batch 16)"] = _best(_server_feed(svc, frames), 10_000) / 16
    for depth in (1, 16):
        off, on = metrics_pair(svc, depth)
        out[f"server/track (batch {depth}, metrics off)"] = off
        out[f"server/track (batch {depth}, metrics on)"] = on
    many = msgpack.packb([0, 1, "track_many", [items]])
    out["server/track_many/item"] = _best(_server_feed(svc, many), 2_000) / 100
    return out


def service() -> Service:
    """A service on memory storage with ``micro-t``'s features f0 .. f99 seeded."""
    table = CounterTable("micro")
    svc = build_service(table, MemoryStorage())
    for j in range(100):
        table.seed(svc.key_for("micro-t", f"f{j}"), EMPTY)
    return svc


def metrics_pair(svc: Service, depth: int, rounds: int = 21) -> tuple[float, float]:
    """ns per ``track`` through the server's ``data_received`` in passes of ``depth``, metrics
    off and on: both sides measured in turn (the side that goes first alternates) for
    ``rounds`` rounds, each side's fastest round kept. On a shared 2-core VM a round can be
    30 % slow; the fastest is the least disturbed, and off against off agrees within ~100 ns."""
    batch = b"".join(msgpack.packb([0, i, "track", ["micro-t", "f0", 1]]) for i in range(depth))
    feeds = (_server_feed(svc, batch), _server_feed(svc, batch, RequestStats(svc.methods)))
    n = max(200, 5_000 // depth)
    got: tuple[list[float], list[float]] = ([], [])
    for r in range(rounds):
        for side in (0, 1) if r % 2 == 0 else (1, 0):
            got[side].append(_best(feeds[side], n) / depth)
    return min(got[0]), min(got[1])


def _server_feed(
    svc: Service, frames: bytes, stats: RequestStats | None = None
) -> Callable[[], None]:
    """``data_received`` of a server connection fed ``frames``, without a socket;
    ``stats``: metrics on (requests counted and timed)."""
    from meter.core.server import RpcServer, _Connection

    srv = RpcServer(
        "/nonexistent",
        svc,
        max_frame=1 << 20,
        high_water=1 << 20,
        low_water=1 << 18,
        notify=svc.notify,
        warm_tracks=svc.warm_tracks,
        wal=svc.wal,
        watch=svc.watch,
        reads=svc.reads,
        request_stats=stats,
    )
    conn = _Connection(srv)
    conn.connection_made(NullTransport())  # type: ignore[arg-type]
    return lambda: conn.data_received(frames)


def main() -> None:
    asyncio.run(asyncio.sleep(0))
    for name, ns in measure().items():
        print(f"{name:30s} {ns:8.0f} ns")


if __name__ == "__main__":
    main()
