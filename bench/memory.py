"""Bytes per warm key, in a fresh process (``python -m bench.memory N [MODE] [PATH]``).

Keys are ``(tenant, feature, period)``, 100 features per tenant, each seeded and incremented
once, so every key is also on the dirty and touched lists. Two ways to make them (``PATH``):

``wire`` (the default)
    the node's real path: pipelined ``track(tenant, feature, 1)`` requests, one read of 100
    (one tenant's features) at a time, go through a server connection's ``data_received``
    (the protocol decoder, so every name is a fresh ``str`` per request), the
    :class:`Service` (``key_for`` and its key cache) and the seeding of a cold key from
    :class:`MemoryStorage`, as the node serves them. What is measured is everything left on
    the heap afterwards: the table, the service (its key cache included) and the connection.
``table``
    :meth:`CounterTable.seed` and :meth:`CounterTable.incr` called directly with keys built
    from name strings made before measuring, shared per tenant and per feature: the table's
    own cost, a floor for the wire figure.

Prints one JSON object.
"""

from __future__ import annotations

import asyncio
import gc
import json
import resource
import sys
import tracemalloc
from collections.abc import Callable

import msgpack
import uvloop

from meter.core.keys import period_start
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.node.wiring import build_service
from storage.base import EMPTY
from storage.memory import MemoryStorage

#: Features per tenant; also the requests per read on the wire path.
FEATURES = 100


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _names(n: int) -> tuple[list[str], list[str]]:
    tenants = [f"tenant-{i:07d}" for i in range(max(1, n // FEATURES))]
    features = [f"feature-{j:02d}" for j in range(FEATURES)]
    return tenants, features


def _fill_table(n: int) -> Callable[[], object]:
    """The ``table`` path, ready to run: returns what it fills (kept alive while measured)."""
    period = period_start("month")
    tenants, features = _names(n)

    def fill() -> object:
        table = CounterTable("mem")
        for i in range(n):
            key = (tenants[i // FEATURES], features[i % FEATURES], period)
            table.seed(key, EMPTY)
            table.incr(key, 1)
        assert len(table) == n
        return (table, tenants, features)

    return fill


def _fill_wire(n: int) -> Callable[[], object]:
    """The ``wire`` path, ready to run: the request bytes are built before measuring."""
    from bench.harness import NullTransport
    from meter.core.server import RpcServer, _Connection

    tenants, features = _names(n)
    reads: list[bytes] = []
    for i in range(0, n, FEATURES):
        tenant = tenants[i // FEATURES]
        reads.append(
            b"".join(
                msgpack.packb([0, j, "track", [tenant, features[j], 1]])
                for j in range(min(FEATURES, n - i))
            )
        )
    del tenants, features  # only the bytes go in: every name the node keeps, it decoded

    def fill() -> object:
        table = CounterTable("mem")
        svc = build_service(table, MemoryStorage())
        srv = RpcServer(
            "/nonexistent",
            svc,
            max_frame=1 << 20,
            high_water=1 << 20,
            low_water=1,
            notify=svc.notify,
            warm_tracks=svc.warm_tracks,
            wal=svc.wal,
            watch=svc.watch,
            reads=svc.reads,
        )
        conn = _Connection(srv)
        transport = NullTransport()

        async def serve() -> None:
            conn.connection_made(transport)  # type: ignore[arg-type]
            for data in reads:
                conn.data_received(data)
                while srv.in_flight:  # the cold keys' seeding tasks
                    await asyncio.sleep(0)

        uvloop.run(serve())  # the node serves on uvloop (meter.cli.main)
        assert len(table) == n and table.stats().unseeded == 0 and srv.internal_errors == 0
        return (svc, srv, conn)

    return fill


def measure(n: int, mode: str = "tracemalloc", path: str = "wire") -> dict[str, float | str]:
    """Fill ``n`` warm keys by ``path``; return bytes per key by ``mode``.

    ``tracemalloc`` counts the Python heap blocks left allocated (exact, but tracing slows
    the fill and inflates RSS); ``rss`` is the growth of the resident set without tracing.
    """
    fill = _fill_wire(n) if path == "wire" else _fill_table(n)
    gc.collect()
    rss0 = _rss_kib()
    if mode == "tracemalloc":
        tracemalloc.start()
    t0, _ = tracemalloc.get_traced_memory()
    kept = fill()
    gc.collect()
    t1, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss1 = _rss_kib()
    out: dict[str, float | str] = {"keys": n, "path": path}
    if mode == "tracemalloc":
        out[f"{path}_bytes_per_key_tracemalloc"] = (t1 - t0) / n
        if path == "wire":
            svc = kept[0] if isinstance(kept, tuple) else None
            assert isinstance(svc, Service)
            out["wire_key_cache_pairs"] = len(svc.keys.cache)
    else:
        out[f"{path}_bytes_per_key_rss"] = (rss1 - rss0) * 1024 / n
    del kept
    return out


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    mode = sys.argv[2] if len(sys.argv) > 2 else "tracemalloc"
    path = sys.argv[3] if len(sys.argv) > 3 else "wire"
    print(json.dumps(measure(n, mode, path)))
