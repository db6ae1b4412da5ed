"""Bytes per warm key: a :class:`CounterTable` filled with seeded keys, each incremented once.

Run in its own process (``python -m bench.memory N``) so nothing else is on the heap; prints
one JSON object. Keys are ``(tenant, feature, period)`` with 100 features per tenant; the name
strings are shared per tenant and per feature, as the node's key cache shares them.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import tracemalloc

from meter.keys import period_start
from meter.table import CounterTable
from storage.base import EMPTY


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def measure(n: int, mode: str = "tracemalloc") -> dict[str, float]:
    """Fill a table with ``n`` warm keys; return bytes per key by ``mode``.

    ``tracemalloc`` counts the Python heap blocks the table holds (exact, but tracing slows
    the fill and inflates RSS); ``rss`` is the growth of the resident set without tracing.
    """
    period = period_start("month")
    features = [f"feature-{j:02d}" for j in range(100)]
    tenants = [f"tenant-{i:07d}" for i in range(max(1, n // 100))]
    gc.collect()
    rss0 = _rss_kib()
    if mode == "tracemalloc":
        tracemalloc.start()
    t0, _ = tracemalloc.get_traced_memory()
    table = CounterTable("mem")
    for i in range(n):
        key = (tenants[i // 100], features[i % 100], period)
        table.seed(key, EMPTY)
        table.incr(key, 1)
    gc.collect()
    t1, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss1 = _rss_kib()
    assert len(table) == n
    if mode == "tracemalloc":
        names = sum(sys.getsizeof(s) for s in tenants) + sum(sys.getsizeof(s) for s in features)
        return {
            "keys": n,
            "bytes_per_key_tracemalloc": (t1 - t0) / n,
            "name_strings_bytes_per_key": names / n,
        }
    return {"keys": n, "bytes_per_key_rss": (rss1 - rss0) * 1024 / n}


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    print(json.dumps(measure(n, sys.argv[2] if len(sys.argv) > 2 else "tracemalloc")))
