"""Helpers for multi-node tests and the convergence measurement: real ``meter serve`` processes
sharing one redis-server and one DynamoDB Local table, and a persistent raw RPC connection."""

from __future__ import annotations

import math
import socket
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self

import msgpack

from tests.support.nodes import NodeProcess
from tests.support.redis_server import RedisServer

KEY_TENANT = "acme"


class Conn:
    """One persistent MessagePack-RPC connection to a node (one request at a time)."""

    def __init__(self, path: str | Path, timeout: float = 10) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.unpacker = msgpack.Unpacker(raw=False)
        self.msgid = 0

    def call(self, method: str, *params: Any) -> tuple[Any, Any]:
        """``(error, result)``."""
        self.msgid += 1
        self.sock.sendall(msgpack.packb([0, self.msgid, method, list(params)]))
        while True:
            for msg in self.unpacker:
                assert msg[0] == 1 and msg[1] == self.msgid, msg
                return msg[2], msg[3]
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("node closed the connection")
            self.unpacker.feed(data)

    def ok(self, method: str, *params: Any) -> Any:
        """The result; AssertionError on an error answer."""
        error, result = self.call(method, *params)
        assert error is None, f"{method}: {error}"
        return result

    def close(self) -> None:
        self.sock.close()


def node_env(
    *,
    redis_url: str,
    dynamodb_endpoint: str,
    table: str,
    cluster: str,
    **extra: str,
) -> dict[str, str]:
    """The environment of a clustered node on DynamoDB."""
    return {
        "METER_STORAGE": "dynamodb",
        "METER_DYNAMODB_ENDPOINT": dynamodb_endpoint,
        "METER_DYNAMODB_TABLE": table,
        "METER_REDIS_URL": redis_url,
        "METER_CLUSTER_NAME": cluster,
        "METER_GOSSIP_INTERVAL_MS": "100",
        "METER_FLUSH_INTERVAL_MS": "500",
        "METER_CLUSTER_HEARTBEAT_MS": "300",
        "METER_CLUSTER_PEER_TIMEOUT_MS": "2000",
        **extra,
    }


def fleet_nodes(
    workdir: Path,
    n: int,
    env: dict[str, str],
    clock_shift: float | None = None,
    each: Mapping[int, Mapping[str, str]] | None = None,
) -> list[NodeProcess]:
    """``n`` nodes (ids n0, n1, ...), not started yet, on ``env`` (with ``each[i]`` on top
    for node ``i``); ``clock_shift`` moves their wall clocks (``bench.clockshift``)."""
    nodes = [
        NodeProcess(
            workdir, f"n{i}", **{**env, "METER_NODE_ID": f"n{i}", **(each or {}).get(i, {})}
        )
        for i in range(n)
    ]
    for node in nodes:
        node.clock_shift = clock_shift
    return nodes


def start_together(nodes: list[NodeProcess]) -> list[NodeProcess]:
    """Start ``nodes`` in parallel and wait until every one sees every other as a peer."""
    with ThreadPoolExecutor(len(nodes)) as pool:
        list(pool.map(lambda p: p.start(timeout=60), nodes))
    ids = {p.name for p in nodes}
    wait_until(
        lambda: all(
            set(p.call("status")["cluster"]["live_peers"]) == ids - {p.name} for p in nodes
        ),
        timeout=20,
        what="every node sees every peer",
        nodes=nodes,
    )
    return nodes


def start_nodes(
    workdir: Path, n: int, env: dict[str, str], clock_shift: float | None = None
) -> list[NodeProcess]:
    """Start ``n`` nodes (ids n0, n1, ...) in parallel and wait until all see each other;
    ``clock_shift`` moves their wall clocks (``bench.clockshift``)."""
    return start_together(fleet_nodes(workdir, n, env, clock_shift))


class Fleet:
    """Real clustered nodes on one redis-server, one DynamoDB Local table and one cluster
    name: what the ``fleet`` fixture (one test's) and ``module_fleet`` (one module's) give.

    ``fleet(n, **METER_env)`` starts nodes n0..n{n-1} on :meth:`env` (``redis=`` another
    server, ``clock_shift=`` their clocks moved, ``each={i: env}`` one node's settings on
    top) and waits until every one sees every other; :meth:`node` starts one more node by
    name. Every node it started is killed (SIGKILL) by :meth:`close`, whatever the test did.
    """

    def __init__(
        self, workdir: Path, *, redis_url: str, dynamodb_endpoint: str, table: str, cluster: str
    ) -> None:
        self.workdir = workdir
        self.redis_url = redis_url
        self.dynamodb_endpoint = dynamodb_endpoint
        self.table = table
        self.cluster = cluster
        #: Every node started through this fleet, in order.
        self.started: list[NodeProcess] = []

    def env(self, *, redis: RedisServer | None = None, **extra: str) -> dict[str, str]:
        """A clustered node's environment on this fleet's services (:func:`node_env`)."""
        return node_env(
            redis_url=self.redis_url if redis is None else redis.url,
            dynamodb_endpoint=self.dynamodb_endpoint,
            table=self.table,
            cluster=self.cluster,
            **extra,
        )

    def __call__(
        self,
        n: int,
        *,
        redis: RedisServer | None = None,
        clock_shift: float | None = None,
        each: Mapping[int, Mapping[str, str]] | None = None,
        **extra: str,
    ) -> list[NodeProcess]:
        assert not any(p.name == "n0" for p in self.started), "one fleet(n) per fleet"
        nodes = fleet_nodes(self.workdir, n, self.env(redis=redis, **extra), clock_shift, each)
        self.started.extend(nodes)  # killed by close() even if a start fails
        return start_together(nodes)

    def node(self, name: str, *, redis: RedisServer | None = None, **extra: str) -> NodeProcess:
        """One more node, ``name`` (also its id), on this fleet's services, started."""
        node = NodeProcess(self.workdir, name, METER_NODE_ID=name, **self.env(redis=redis, **extra))
        self.started.append(node)
        return node.start(timeout=60)

    def close(self) -> None:
        """Kill every node still running."""
        for p in self.started:
            if p.proc is not None and p.proc.poll() is None:
                p.kill()


def wait_until(
    cond: Callable[[], bool],
    timeout: float,
    what: str,
    nodes: list[NodeProcess] | None = None,
    step: float = 0.02,
) -> float:
    """Poll ``cond`` until true; return the seconds it took. Fails with the nodes' logs."""
    t0 = time.monotonic()
    while True:
        if cond():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            logs = "\n".join(f"--- {p.name}\n{p.log()[-3000:]}" for p in nodes or [])
            raise AssertionError(f"timed out after {timeout}s waiting until {what}\n{logs}")
        time.sleep(step)


def usages(nodes: list[NodeProcess], feature: str) -> list[int]:
    """Every node's view of one counter."""
    return [p.call("usage", KEY_TENANT, feature) for p in nodes]


class NodeThreads:
    """One daemon thread per node, each running ``_run(i)``: :meth:`start`, then :meth:`join`
    (which fails if one is still running)."""

    def __init__(self, nodes: list[NodeProcess]) -> None:
        self.nodes = nodes
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(len(nodes))]  # fmt: skip

    def _run(self, i: int) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def join(self, timeout: float = 120) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads)


def until_refused(
    nodes: list[NodeProcess],
    request: Callable[[int], tuple[str, list[Any]]],
    refusal: str,
    connections: int = 4,
) -> list[int]:
    """From ``connections`` connections to each node, send ``request(n)`` (a method and its
    params; ``n`` counts that connection's calls from its index) until each connection is
    refused with ``refusal`` (``unavailable`` answers are sent on); the calls acknowledged,
    per node. Fails on any other error."""
    acked = [0] * len(nodes)
    lock = threading.Lock()
    errors: list[Any] = []

    def run(i: int, c: int) -> None:
        conn = Conn(nodes[i].socket)
        try:
            for n in range(c, c + 100_000):
                method, params = request(n)
                error, _ = conn.call(method, *params)
                if error is None:
                    with lock:
                        acked[i] += 1
                elif error["code"] == refusal:
                    return
                elif error["code"] != "unavailable":
                    errors.append(error)
                    return
        finally:
            conn.close()

    threads = [threading.Thread(target=run, args=(i, c)) for i in range(len(nodes))
               for c in range(connections)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    return acked


class Load:
    """Threads tracking units on the same keys through several nodes; counts what was acked.

    Every item carries a request id. A call whose answer never came (the node died under it)
    is kept in ``in_doubt[i]``: it may or may not have been counted, and sending it again with
    :meth:`resend_in_doubt` makes sure it is, once.
    """

    def __init__(self, nodes: list[NodeProcess], features: list[str], batch: int = 10) -> None:
        self.nodes = nodes
        self.features = features
        self.batch = batch
        self.acked = [0] * len(nodes)
        self.errors = [0] * len(nodes)
        self.in_doubt: list[list[list[Any]] | None] = [None] * len(nodes)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(nodes))
        ]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def _run(self, i: int) -> None:
        try:
            conn = Conn(self.nodes[i].socket, timeout=5)
        except OSError:
            self.errors[i] += 1
            return
        n = 0
        try:
            while not self._stop.is_set():
                items: list[list[Any]] = [
                    [
                        KEY_TENANT,
                        self.features[(n + j) % len(self.features)],
                        1 + (n + j) % 3,
                        {"id": f"{self.nodes[i].name}-{n + j}"},
                    ]
                    for j in range(self.batch)
                ]
                n += self.batch
                try:
                    error, result = conn.call("track_many", items)
                except OSError:  # the node died: what it acked so far is counted
                    self.errors[i] += 1
                    self.in_doubt[i] = items
                    return
                self._count(i, items, error, result)
                time.sleep(0.002)
        finally:
            conn.close()

    def _count(self, i: int, items: list[list[Any]], error: Any, result: Any) -> None:
        if error is not None:
            self.errors[i] += 1
            return
        for item, r in zip(items, result, strict=True):
            if not isinstance(r, dict):  # an error map means not counted
                self.acked[i] += item[2]

    def resend_in_doubt(self, i: int) -> None:
        """Send node ``i``'s unanswered call again (same ids) and count its answer."""
        items = self.in_doubt[i]
        if items is not None:
            conn = Conn(self.nodes[i].socket)
            try:
                error, result = conn.call("track_many", items)
            finally:
                conn.close()
            assert error is None, error
            self._count(i, items, error, result)
            self.in_doubt[i] = None

    def stop_node_load(self) -> None:
        """Stop all threads and wait for them."""
        self._stop.set()
        for t in self._threads:
            t.join(10)

    @property
    def total(self) -> int:
        return sum(self.acked)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank: the smallest value with at least ``q`` of the values
    at or below it) of ``values``."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def measure_visibility(
    nodes: list[NodeProcess], feature: str, samples: int, tick_s: float, timeout: float = 5.0
) -> dict[str, Any]:
    """Track one unit on node ``i % n`` and time until every other node shows it.

    Returns per-sample latencies (ms, to the last node to see it) and ``anomalies``: readings
    above the expected total (a double count) or below the previous one (a dip).
    """
    conns = [Conn(p.socket) for p in nodes]
    try:
        expected = conns[0].ok("usage", KEY_TENANT, feature)
        for c in conns[1:]:
            assert c.ok("usage", KEY_TENANT, feature) == expected
        lat: list[float] = []
        anomalies: list[tuple[int, int, int]] = []
        for s in range(samples):
            # Spread the samples over the tick's phase.
            time.sleep(tick_s * ((s * 0.618) % 1.0))
            src = s % len(nodes)
            t0 = time.monotonic()
            conns[src].ok("track", KEY_TENANT, feature, 1)
            expected += 1
            pending = [i for i in range(len(nodes)) if i != src]
            while pending:
                for i in list(pending):
                    v = conns[i].ok("usage", KEY_TENANT, feature)
                    if v > expected or v < expected - 1:
                        anomalies.append((s, i, v - expected))
                    if v == expected:
                        pending.remove(i)
                if time.monotonic() - t0 > timeout:
                    raise AssertionError(f"sample {s}: nodes {pending} never saw the unit")
            lat.append((time.monotonic() - t0) * 1000)
        return {
            "samples": len(lat),
            "p50_ms": round(statistics.median(lat), 2),
            "p99_ms": round(percentile(lat, 0.99), 2),
            "max_ms": round(max(lat), 2),
            "anomalies": anomalies,
            "latencies_ms": lat,
        }
    finally:
        for c in conns:
            c.close()
