"""Metrics and health over HTTP (``metrics_address``), scraped from real node processes.

``/metrics`` is parsed with prometheus_client's own parser; its counters move with the calls
made; ``/readyz`` fails while DynamoDB Local is stopped or Redis is killed and recovers with
them; bad requests are answered and the listener keeps serving; no address, no listener.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meter.config import load
from meter.errors import BY_CODE, ConfigError
from meter.ops.metrics import METRIC_NAMES
from storage import periods
from tests.support.dynamodb_local import TEST_JAVA_OPTIONS, DynamoDBLocal
from tests.support.fixtures_dynamodb import create_table
from tests.support.nodes import ROOT, NodeProcess, raw_call, short_tmpdir, wait_for
from tests.support.redis_server import RedisServer

#: Samples of one scrape: (sample name, labels as a sorted tuple) -> value.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmpdir()
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def http(address: str, path: str, method: str = "GET") -> tuple[int, str]:
    """``(status, body)`` of one request (never through a proxy)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(f"http://{address}{path}", method=method)
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def raw_http(address: str, data: bytes, timeout: float = 10) -> bytes:
    """Send ``data`` as is and read until the server closes."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def raw_status(address: str, data: bytes) -> int:
    """The status of the answer to ``data`` sent as is."""
    line = raw_http(address, data).split(b"\r\n", 1)[0]
    assert line.startswith(b"HTTP/1."), line
    return int(line.split()[1])


def metrics_address(node: NodeProcess) -> str:
    address = node.call("status")["metrics"]["address"]
    assert isinstance(address, str)
    return address


def scrape(address: str) -> Samples:
    status, text = http(address, "/metrics")
    assert status == 200
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_move_with_calls_and_labels_stay_bounded(workdir: Path) -> None:
    """Every call moves ``meter_requests_total`` by method and result and the latency
    histogram by method; refusals are counted by code (track_many items too); units stored
    are labelled by at most ``metrics_feature_labels`` features; no tenant is ever a label."""
    env = {
        "METER_METRICS_ADDRESS": "127.0.0.1:0",
        "METER_METRICS_FEATURE_LABELS": "2",
        "METER_FLUSH_INTERVAL_MS": "50",
    }
    with NodeProcess(workdir, **env) as node:
        address = metrics_address(node)
        assert f"metrics and probes on http://{address}" in node.log()
        before = scrape(address)
        for _ in range(7):
            node.call("track", "tenant-secret-a", "api", 2)
        node.call("track", "tenant-secret-b", "storage", 3)
        node.call("track", "tenant-secret-c", "gpu", 4)  # a third feature: "other"
        node.call("usage", "tenant-secret-a", "api")
        node.call("usage_all", "tenant-secret-a")  # a map: answered at once, not awaited
        mid = scrape(address)
        assert raw_call(node.socket, "subscribe", "tenant-secret-a", ["api"])[0] is None
        # Answers the hot loop does not give (subscribe's Bind) are timed, not put at 0 s.
        sub = ("meter_request_duration_seconds_sum", (("method", "subscribe"),))
        assert scrape(address)[sub] > mid[sub]
        assert raw_call(node.socket, "subscribe", "", ["api"])[0]["code"] == "invalid_argument"
        assert raw_call(node.socket, "track", "", "api")[0]["code"] == "invalid_argument"
        assert raw_call(node.socket, "no_such_method")[0]["code"] == "unknown_method"
        items = [["tenant-secret-a", "api", 1], ["bad tenant", "api", 1]]
        answers = node.call("track_many", items)
        assert answers[0] == 15 and answers[1]["code"] == "invalid_argument"
        # A pipelined batch takes the node's fast path: 50 tracks in one write.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(node.socket))
            s.sendall(
                b"".join(
                    msgpack.packb([0, i, "track", ["tenant-secret-a", "api", 1]]) for i in range(50)
                )
            )
            unpacker = msgpack.Unpacker(raw=False)
            got = 0
            while got < 50:
                unpacker.feed(s.recv(65536))
                got += sum(1 for _ in unpacker)
        after = wait_for(
            lambda: (
                (s := scrape(address))
                and value(s, "meter_units_stored_total", feature="api") >= 65
                and value(s, "meter_keys", state="warm") == 3  # (at most 1 s old)
                and s
            ),
            10,
            "the units to be stored",
        )

        # Every family of meter.ops.metrics but the cluster's is there (a node alone, SQLite)
        # and the webhooks' (with webhook_urls: tests/test_webhooks.py).
        families = {n for n, _ in after}
        for name in METRIC_NAMES:
            if not name.startswith(("meter_gossip_", "meter_webhooks_")):
                base = name.removesuffix("_total")
                assert any(n == name or n.startswith(base) for n in families), name

        def moved(name: str, **labels: str) -> float:
            return value(after, name, **labels) - value(before, name, **labels)

        # The oldest open period by name (alone, no cycles: the current UTC day's or month's,
        # whichever closes first), valued at its end plus the grace (3,600 s by default).
        oldest = [(dict(lb), v) for (n, lb), v in after.items() if n == "meter_period_oldest_open"]
        assert len(oldest) == 1
        ((labels, closes_at),) = oldest
        assert labels["period"] == node.call("status")["periods"]["oldest_open"]
        assert closes_at == periods.bounds(labels["period"])[1] + 3600

        assert moved("meter_requests_total", method="track", result="ok") == 7 + 2 + 50
        assert moved("meter_requests_total", method="track", result="invalid_argument") == 1
        assert moved("meter_requests_total", method="usage", result="ok") == 1
        assert moved("meter_requests_total", method="track_many", result="ok") == 1
        assert moved("meter_requests_total", method="usage_all", result="ok") == 1
        assert moved("meter_requests_total", method="subscribe", result="ok") == 1
        assert moved("meter_requests_total", method="subscribe", result="invalid_argument") == 1
        assert moved("meter_requests_total", method="other", result="unknown_method") == 1
        assert not [k for k in after if ("method", "no_such_method") in k[1]]
        # The histogram counts every answer, ok or not.
        assert moved("meter_request_duration_seconds_count", method="track") == 7 + 2 + 50 + 1
        assert moved("meter_request_duration_seconds_bucket", method="track", le="+Inf") == 60
        assert moved("meter_request_duration_seconds_sum", method="track") > 0
        assert moved("meter_request_duration_seconds_count", method="subscribe") == 2
        # A call refused and a track_many item refused.
        assert moved("meter_refusals_total", reason="invalid_argument") == 3
        assert moved("meter_refusals_total", reason="unknown_method") == 1
        # At most two features by name, the rest as "other"; every unit is there.
        features = {dict(k[1])["feature"] for k in after if k[0] == "meter_units_stored_total"}
        assert features == {"api", "storage", "other"}
        assert value(after, "meter_units_stored_total", feature="api") == 7 * 2 + 1 + 50
        assert value(after, "meter_units_stored_total", feature="storage") == 3
        assert value(after, "meter_units_stored_total", feature="other") == 4
        assert value(after, "meter_flush_keys_written_total") >= 3
        assert value(after, "meter_wal_fsyncs_total") > value(before, "meter_wal_fsyncs_total")
        assert value(after, "meter_wal_fsync_duration_seconds_count") > 0
        assert value(after, "meter_keys", state="warm") == 3
        assert value(after, "meter_ready") == 1 and value(after, "meter_degraded") == 0
        # No label name nor value anywhere holds a tenant.
        for _, labels in after:
            for k, v in labels:
                assert "tenant" not in k and "tenant-secret" not in v


def test_error_series_are_exported_at_zero_from_the_start(workdir: Path) -> None:
    """A fresh node exports every refusal code, and the internal and unavailable results of
    every method, at 0: ``increase()`` over them sees the first error (the alerts use it)."""
    with NodeProcess(workdir, METER_METRICS_ADDRESS="127.0.0.1:0") as node:
        samples = scrape(metrics_address(node))
        for code in BY_CODE:
            assert samples[("meter_refusals_total", (("reason", code),))] == 0, code
        for method in ("track", "track_many", "usage", "reserve", "commit", "status"):
            for code in ("internal", "unavailable"):
                key = ("meter_requests_total", (("method", method), ("result", code)))
                assert samples[key] == 0, key


def test_table_counts_are_walked_at_most_once_a_second(workdir: Path) -> None:
    """The counts that walk the table (meter_keys, the flush backlog) are reused for up to a
    second, so a flood of scrapes costs one walk a second; they follow the table after it."""
    env = {"METER_METRICS_ADDRESS": "127.0.0.1:0", "METER_FLUSH_INTERVAL_MS": "3600000"}
    with NodeProcess(workdir, **env) as node:
        address = metrics_address(node)
        t0 = time.monotonic()
        first = scrape(address)
        assert value(first, "meter_keys", state="warm") == 0
        node.call("track", "acme", "api", 5)
        again = scrape(address)
        if time.monotonic() - t0 < 0.9:  # (a box too loaded to scrape twice in 0.9 s: skip)
            assert value(again, "meter_keys", state="warm") == 0
            assert value(again, "meter_flush_backlog_units") == 0
        # The request counters are not cached: they move at once.
        assert value(again, "meter_requests_total", method="track", result="ok") == 1
        wait_for(
            lambda: (
                value(s := scrape(address), "meter_keys", state="warm") == 1
                and value(s, "meter_flush_backlog_units") == 5
            ),
            5,
            "the key counts to follow the table within a second",
        )


@pytest.mark.quiet
def test_health_endpoints_and_bad_http_requests(workdir: Path) -> None:
    """/healthz and /readyz answer; a bad request gets its status (404, 405, 400, 408 for
    a client that sends nothing) and the listener keeps serving others meanwhile."""
    with NodeProcess(workdir, METER_METRICS_ADDRESS="127.0.0.1:0") as node:
        address = metrics_address(node)
        assert http(address, "/healthz") == (200, "ok\n")
        status, body = http(address, "/readyz")
        assert status == 200
        assert body == "counting: ok\nlog: ok\nstorage: ok\nbus: ok\n"
        assert http(address, "/readyz?counting") == (200, "counting: ok\nlog: ok\n")
        assert http(address, "/nope")[0] == 404
        assert http(address, "/metrics", method="POST")[0] == 405
        assert http(address, "/healthz", method="HEAD") == (200, "")
        assert raw_status(address, b"garbage\r\n\r\n") == 400
        assert raw_status(address, b"GET /\xff HTTP/1.1\r\n\r\n") == 400
        # A header line over 8 KiB: 400 (aiohttp's answer; the hand-written listener said 431).
        huge = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n"
        assert raw_status(address, huge) == 400
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as silent:
            # A client that sends nothing holds nobody else up...
            t0 = time.monotonic()
            assert http(address, "/healthz") == (200, "ok\n")
            assert time.monotonic() - t0 < 2
            # ...and is answered 408 and closed after the read timeout (5 s).
            assert silent.recv(100).startswith(b"HTTP/1.1 408 ")
            assert time.monotonic() - t0 < 9
        assert http(address, "/metrics")[0] == 200
        assert node.stop() == 0
        with pytest.raises(OSError):  # the listener stopped with the node
            socket.create_connection((host, int(port)), timeout=2).close()


@pytest.mark.quiet
def test_idle_connections_cannot_keep_a_probe_out(workdir: Path) -> None:
    """More idle or trickling clients than the listener serves at once (64) do not keep
    /healthz out: it is answered at once, each new connection closing the oldest one still
    reading its head; and the listener stops cleanly with a probe half sent (no traceback)."""
    with NodeProcess(workdir, METER_METRICS_ADDRESS="127.0.0.1:0") as node:
        address = metrics_address(node)
        host, port = address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(70)]
        for s in idle[::2]:
            s.sendall(b"GET /healthz HTTP/1.1\r\n")  # a head trickled, never finished
        for _ in range(3):
            t0 = time.monotonic()
            assert http(address, "/healthz") == (200, "ok\n")
            # Answered before the head timeout (2 s) freed any slot: room was made for it.
            assert time.monotonic() - t0 < 2
            assert http(address, "/readyz?counting")[0] == 200
        # The oldest idle ones were closed without an answer (not 408 after the timeout).
        first = idle[0]
        try:
            got = first.recv(100)
        except ConnectionResetError:
            got = b""
        assert got == b""
        half = socket.create_connection((host, int(port)), timeout=10)
        half.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n")  # in flight at the stop
        assert node.stop() == 0
        for s in [*idle, half]:
            s.close()
        log = node.log()
        assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
        assert " ERROR " not in log, log[-3000:]


def _listening_tcp_sockets(pid: int) -> int:
    """How many TCP sockets process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in list(fh)[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN
                    n += 1
    return n


def test_no_metrics_address_means_no_tcp_listener(workdir: Path) -> None:
    with NodeProcess(workdir, "plain") as node:
        assert node.proc is not None
        assert node.call("status")["metrics"]["address"] is None
        assert _listening_tcp_sockets(node.proc.pid) == 0
    with NodeProcess(workdir, "metered", METER_METRICS_ADDRESS="127.0.0.1:0") as node:
        assert node.proc is not None
        assert _listening_tcp_sockets(node.proc.pid) == 1


@pytest.mark.parametrize(
    "raw",
    ["9464", "localhost", "localhost:", ":9464", "h:65536", "h:-1", "h:abc", "::1:9464",
     "[::1]", "a b:80", "http://h:80"],
)  # fmt: skip
def test_bad_metrics_addresses_are_refused_naming_the_setting(raw: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(env={"METER_METRICS_ADDRESS": raw})
    assert err.value.setting == "metrics_address"
    assert "host:port" in err.value.message


def test_metrics_settings_are_read_and_checked() -> None:
    assert load(env={}).metrics.address is None
    assert load(env={"METER_METRICS_ADDRESS": ""}).metrics.address is None
    cfg = load(env={"METER_METRICS_ADDRESS": "127.0.0.1:0", "METER_METRICS_FEATURE_LABELS": "5"})
    assert cfg.metrics.address == ("127.0.0.1", 0)
    assert cfg.metrics.feature_labels == 5
    assert load(flags={"metrics_address": "[::1]:9464"}).metrics.address == ("::1", 9464)
    for bad in ("-1", "1001", "many"):
        with pytest.raises(ConfigError) as err:
            load(env={"METER_METRICS_FEATURE_LABELS": bad})
        assert err.value.setting == "metrics_feature_labels"


def _serve(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METER_")}
    env["PYTHONPATH"] = str(ROOT)
    env["METER_DATA_DIR"] = str(workdir / "data")
    env["METER_SOCKET"] = str(workdir / "m.sock")
    return subprocess.run(
        [sys.executable, "-m", "meter", "serve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_serve_flag_and_an_address_in_use_stop_the_node_with_one_line(workdir: Path) -> None:
    bad = _serve(workdir, "--metrics-address", "nowhere")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "meter: configuration error: metrics_address: must be host:port (port 0-65535, "
        "[ipv6]:port), got 'nowhere'"
    ]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = _serve(workdir, "--metrics-address", f"127.0.0.1:{port}")
    assert busy.returncode == 2
    assert f"metrics_address: cannot listen on 127.0.0.1:{port}" in busy.stderr
    assert not (workdir / "m.sock").exists()


def _ready_body(address: str, query: str = "") -> tuple[int, str]:
    return http(address, "/readyz" + query)


def _until(cond: Callable[[], bool], timeout: float, what: str, node: NodeProcess) -> None:
    try:
        wait_for(cond, timeout, what)
    except AssertionError:
        raise AssertionError(f"{what}\n{node.log()[-3000:]}") from None


@pytest.mark.dynamodb
async def test_readyz_fails_while_dynamodb_is_stopped_and_recovers(
    workdir: Path, dynamodb_local_home: Path
) -> None:
    """With DynamoDB Local stopped, /readyz answers 503 naming storage (while the node still
    counts: /readyz?counting stays 200), and 200 again once it is back."""
    server = DynamoDBLocal(
        dynamodb_local_home, db_path=workdir / "ddb", java_options=TEST_JAVA_OPTIONS
    )
    await asyncio.to_thread(server.start)
    try:
        table = await create_table(server.endpoint)
        node = NodeProcess(
            workdir,
            METER_STORAGE="dynamodb",
            METER_DYNAMODB_ENDPOINT=server.endpoint,
            METER_DYNAMODB_TABLE=table,
            METER_FLUSH_INTERVAL_MS="100",
            METER_FLUSH_MAX_BACKOFF_MS="300",
            METER_DYNAMODB_CONNECT_TIMEOUT_S="0.5",
            METER_DYNAMODB_READ_TIMEOUT_S="1",
            METER_METRICS_ADDRESS="127.0.0.1:0",
        )
        await asyncio.to_thread(node.start)
        try:
            address = metrics_address(node)
            node.call("track", "acme", "api", 1)
            assert _ready_body(address)[0] == 200
            await asyncio.to_thread(server.stop)

            def down() -> bool:
                node.call("track", "acme", "api", 1)  # units to write: a round fails
                status, body = _ready_body(address)
                return status == 503 and "storage: failed: " in body

            await asyncio.to_thread(_until, down, 30, "/readyz to fail on storage", node)
            assert _ready_body(address)[0] == 503
            body = _ready_body(address)[1]
            assert "counting: ok\n" in body and "log: ok\n" in body
            assert _ready_body(address, "?counting") == (200, "counting: ok\nlog: ok\n")
            assert value(scrape(address), "meter_degraded") == 1
            await asyncio.to_thread(server.start)
            await asyncio.to_thread(
                _until,
                lambda: _ready_body(address)[0] == 200,
                30,
                "/readyz to pass once DynamoDB is back",
                node,
            )
            assert value(scrape(address), "meter_degraded") == 0
        finally:
            assert await asyncio.to_thread(node.stop) == 0, node.log()
    finally:
        await asyncio.to_thread(server.__exit__)


@pytest.mark.redis
def test_readyz_fails_while_redis_is_killed_and_recovers(
    workdir: Path, redis_factory: Callable[..., RedisServer], cluster_name: str
) -> None:
    """With the bus' redis-server killed, /readyz answers 503 naming the bus (the node
    counts: /readyz?counting stays 200), and 200 again once Redis is back."""
    redis = redis_factory()
    with NodeProcess(
        workdir,
        METER_REDIS_URL=redis.url,
        METER_CLUSTER_NAME=cluster_name,
        METER_METRICS_ADDRESS="127.0.0.1:0",
    ) as node:
        address = metrics_address(node)
        _until(lambda: _ready_body(address)[0] == 200, 20, "/readyz to pass", node)
        assert value(scrape(address), "meter_gossip_bus_connected") == 1
        redis.stop()  # SIGKILL
        _until(
            lambda: (r := _ready_body(address))[0] == 503 and "bus: failed: " in r[1],
            20,
            "/readyz to fail on the bus",
            node,
        )
        assert _ready_body(address, "?counting")[0] == 200
        node.call("track", "acme", "api", 1)  # it still counts
        redis.start()
        _until(lambda: _ready_body(address)[0] == 200, 30, "/readyz to pass again", node)
        assert value(scrape(address), "meter_gossip_bus_connected") == 1
