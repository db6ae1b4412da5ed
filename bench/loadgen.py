"""A raw-socket load generator: hand-built frames, several processes, one connection each.

No client library on either side: the request frames are built once (MessagePack-RPC for the
node, RESP for redis-server) and written as bytes; answers are counted, not interpreted beyond
an error check. A worker writes ``depth`` requests in one ``sendall`` and waits for all
``depth`` answers (``depth`` 1 is unpipelined); the latency recorded is that batch's round
trip. Workers run for a fixed time and stop by themselves.
"""

from __future__ import annotations

import array
import json
import multiprocessing as mp
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgpack

#: Give up on a silent server after this many seconds (the run then reports errors).
SOCKET_TIMEOUT = 10.0


@dataclass(frozen=True)
class Load:
    """What every worker of one step sends."""

    proto: str  # "meter", "redis" or "http" (HTTP/1.1 keep-alive, pipelined by ``depth``)
    path: str  # Unix socket path, or ``tcp:host:port``
    method: str  # "track", "track_many" or "incr"
    connections: int
    depth: int  # requests per round trip (1: unpipelined)
    items: int = 1  # increments per request (track_many: items per call; redis: 1)
    keys: int = 1  # distinct keys per connection for track / incr (cycled through a batch)
    duration: float = 1.0
    warmup: float = 0.2
    #: Tenant of worker ``i``: ``tenant.format(i=i)`` (without ``{i}``: one tenant for all).
    tenant: str = "bench-{i}"
    #: Further Unix sockets: worker ``i`` connects to ``(path, *paths)[i % (1 + len(paths))]``
    #: (one load spread over the nodes of a cluster).
    paths: tuple[str, ...] = ()
    #: Dimensions per call (``model``, ``region``: the feature must declare them): a
    #: ``track`` gives the same values every call, a ``track_many`` item ``j`` gives
    #: ``model=m<j % 10>``, ``region=r<j // 10 % 10>`` (100 combinations).
    dims: int = 0
    #: A unique feature's value (feature ``u``, declared ``unique``): every ``track`` gives
    #: it (met once, then known: the already-seen path).
    value: str = ""
    #: ``http``: the request target; ``track`` POSTs its JSON params there, any other
    #: method is sent as the request's method with no body (``GET`` a probe).
    target: str = "/v1/track"

    def socket_of(self, worker: int) -> str:
        """The socket worker ``worker`` connects to."""
        every = (self.path, *self.paths)
        return every[worker % len(every)]


@dataclass
class LoadResult:
    """The merged outcome of one step."""

    ops: int  # requests answered within the measured window
    increments: int  # ops x items
    errors: int
    seconds: float
    latencies_ns: list[int]  # one per round trip

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    @property
    def increments_per_s(self) -> float:
        return self.increments / self.seconds if self.seconds else 0.0

    def percentile_us(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the round-trip latencies, in microseconds."""
        lat = sorted(self.latencies_ns)
        if not lat:
            return 0.0
        i = min(len(lat) - 1, max(0, round(q / 100 * (len(lat) - 1))))
        return lat[i] / 1000


def _feature(load: Load, j: int) -> str:
    """The feature of a worker's ``j``-th key: ``f`` alone, or ``f0`` .. ``f{keys-1}``."""
    return "f" if load.keys == 1 else f"f{j % load.keys}"


def meter_frames(load: Load, worker: int) -> bytes:
    """``depth`` MessagePack-RPC requests (msgids 0..depth-1) in one buffer.

    Tenant ``bench-<worker>`` (``load.tenant``); ``track`` cycles through ``keys`` features,
    ``track_many`` counts ``items`` features (``f0`` ..) per call.
    """
    tenant = load.tenant.format(i=worker)
    out = bytearray()
    for msgid in range(load.depth):
        if load.method == "track_many" and load.dims:
            items = [[tenant, "f", 1, {"dims": _dims(load.dims, j)}] for j in range(load.items)]
            out += msgpack.packb([0, msgid, "track_many", [items]])
        elif load.method == "track_many":
            items = [[tenant, f"f{j}", 1] for j in range(load.items)]
            out += msgpack.packb([0, msgid, "track_many", [items]])
        elif load.value:
            out += msgpack.packb([0, msgid, "track", [tenant, "u", 1, {"value": load.value}]])
        elif load.dims:
            opts = {"dims": _dims(load.dims, 0)}
            out += msgpack.packb([0, msgid, "track", [tenant, _feature(load, msgid), 1, opts]])
        else:
            out += msgpack.packb([0, msgid, "track", [tenant, _feature(load, msgid), 1]])
    return bytes(out)


def _dims(n: int, j: int) -> dict[str, str]:
    """The first ``n`` of item ``j``'s dimensions (see :attr:`Load.dims`)."""
    return dict(list({"model": f"m{j % 10}", "region": f"r{j // 10 % 10}"}.items())[:n])


def http_frames(load: Load, worker: int) -> bytes:
    """``depth`` HTTP/1.1 keep-alive requests in one buffer: a ``track`` as the JSON API
    takes it (docs/http.md), or a bare ``GET`` of ``load.target``."""
    if load.method != "track":
        one = f"{load.method} {load.target} HTTP/1.1\r\nHost: bench\r\n\r\n".encode()
        return one * load.depth
    out = bytearray()
    tenant = load.tenant.format(i=worker)
    for j in range(load.depth):
        body = json.dumps({"tenant": tenant, "feature": _feature(load, j), "qty": 1}).encode()
        out += (
            f"POST {load.target} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
    return bytes(out)


class _HttpAnswers:
    """Counts whole HTTP/1.1 answers (each with a Content-Length) in a byte stream."""

    def __init__(self) -> None:
        self.buf = b""
        self.errors = 0

    def feed(self, data: bytes) -> int:
        buf = self.buf + data
        n = 0
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end].lower() + b"\r\n"
            at = head.find(b"content-length:") + 15
            length = int(head[at : head.find(b"\r\n", at)])
            if len(buf) < end + 4 + length:
                break
            if not buf.startswith(b"HTTP/1.1 200"):
                self.errors += 1
            buf = buf[end + 4 + length :]
            n += 1
        self.buf = buf
        return n


def redis_frames(load: Load, worker: int) -> bytes:
    """``depth`` RESP ``INCR`` commands in one buffer, on the node's names joined by ``:``
    (``bench-<worker>:f`` with the default ``load.tenant``, or ``bench-<worker>:f0`` ..
    cycling through ``keys``)."""
    out = bytearray()
    for j in range(load.depth):
        key = f"{load.tenant.format(i=worker)}:{_feature(load, j)}".encode()
        out += b"*2\r\n$4\r\nINCR\r\n$%d\r\n%s\r\n" % (len(key), key)
    return bytes(out)


def _worker(load: Load, index: int, ready: Any, go: Any, out: Connection) -> None:
    try:
        out.send(_run(load, index, ready, go))
    except Exception as exc:  # reported, never raised past the process boundary
        out.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        out.close()


def _run(load: Load, index: int, ready: Any, go: Any) -> tuple[Any, ...]:
    build = {"meter": meter_frames, "redis": redis_frames, "http": http_frames}[load.proto]
    frames = build(load, index)
    depth = load.depth
    where = load.socket_of(index)
    if where.startswith("tcp:"):
        host, port = where[4:].rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(where)
    sock.settimeout(SOCKET_TIMEOUT)
    ready.release()
    if not go.wait(60):
        sock.close()
        return ("error", "never started")
    is_redis = load.proto == "redis"
    http = _HttpAnswers() if load.proto == "http" else None
    unpacker = msgpack.Unpacker(raw=False)
    lat = array.array("q")
    now = time.perf_counter_ns
    t_start = now() + int(load.warmup * 1e9)
    t_end = t_start + int(load.duration * 1e9)
    ops = errors = 0
    sendall, recv = sock.sendall, sock.recv
    while True:
        t0 = now()
        if t0 >= t_end:
            break
        sendall(frames)
        got = 0
        while got < depth:
            data = recv(262144)
            if not data:
                raise ConnectionError("server closed the connection")
            if http is not None:
                got += http.feed(data)
            elif is_redis:
                got += data.count(b"\n")
                if b"-" in data:
                    errors += data.count(b"-")
            else:
                unpacker.feed(data)
                for msg in unpacker:
                    got += 1
                    if msg[2] is not None:
                        errors += 1
        t1 = now()
        if t0 >= t_start:
            ops += depth
            lat.append(t1 - t0)
    sock.close()
    if http is not None:
        errors += http.errors
    return ("ok", ops, errors, lat.tobytes())


def run_load(load: Load) -> LoadResult:
    """Start ``load.connections`` worker processes, run them together, merge their results."""
    ctx = mp.get_context("fork")
    ready = ctx.Semaphore(0)
    go = ctx.Event()
    procs: list[Any] = []
    pipes: list[Connection] = []
    for i in range(load.connections):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(load, i, ready, go, child), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        pipes.append(parent)
    try:
        for _ in procs:
            if not ready.acquire(timeout=30):
                raise RuntimeError("a load worker did not connect within 30 s")
        go.set()
        ops = errors = 0
        latencies: list[int] = []
        limit = load.warmup + load.duration + SOCKET_TIMEOUT + 30
        for pipe in pipes:
            if not pipe.poll(limit):
                raise RuntimeError("a load worker did not report back in time")
            msg = pipe.recv()
            if msg[0] != "ok":
                raise RuntimeError(f"load worker failed: {msg[1]}")
            _, n, e, raw = msg
            ops += n
            errors += e
            lat = array.array("q")
            lat.frombytes(raw)
            latencies.extend(lat)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for pipe in pipes:
            pipe.close()
    return LoadResult(ops, ops * load.items, errors, load.duration, latencies)
