"""The HTTP/JSON API (docs/http.md) against a real node process, with outside clients: curl on
the API's Unix socket and on TCP, and Node.js (its built-in ``fetch`` on TCP, its ``http``
module on the Unix socket), each through every method and its errors; bad input changes
nothing; a track over MessagePack-RPC reaches a Server-Sent Events stream; the bearer token."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from meter.config import load
from meter.errors import ConfigError
from meter.http.signatures import SIGNATURES
from tests.support.nodes import NodeProcess, short_tmpdir, wait_for

pytestmark = pytest.mark.xdist_group("http_api")

#: ``(status, JSON body)`` of one call.
Answer = tuple[int, Any]
#: ``send(method, body text, headers) -> answer``.
Send = Callable[[str, str, dict[str, str]], Answer]

NODE_CLIENT = r"""
// Reads [{path, body, headers}] from stdin; POSTs each in order, over TCP with fetch or over
// the Unix socket with the http module; prints [[status, json], ...]. A body's "$<n>" is
// replaced by the JSON of the n-th answer's result (a reservation id made before).
const http = require("http");
const [base, sock] = [process.argv[1], process.argv[2]];  // (node -e: no script name)
function viaSocket(path, body, headers) {
  return new Promise((resolve, reject) => {
    const req = http.request({socketPath: sock, path, method: "POST", headers}, (res) => {
      let data = "";
      res.on("data", (c) => (data += c));
      res.on("end", () => resolve([res.statusCode, data]));
    });
    req.on("error", reject);
    req.end(body);
  });
}
async function main() {
  const calls = JSON.parse(require("fs").readFileSync(0, "utf8"));
  const out = [];
  for (const c of calls) {
    const body = c.body.replace(/"\$(\d+)"/g, (_, n) => JSON.stringify(out[+n][1].result));
    let status, text;
    if (sock) {
      [status, text] = await viaSocket(c.path, body, c.headers);
    } else {
      const res = await fetch(base + c.path, {method: "POST", body, headers: c.headers});
      [status, text] = [res.status, await res.text()];
    }
    out.push([status, JSON.parse(text)]);
  }
  console.log(JSON.stringify(out));
}
main().catch((e) => { console.error(e); process.exit(1); });
"""


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    workdir = short_tmpdir()
    n = NodeProcess(
        workdir,
        METER_STORAGE="memory",
        METER_HTTP_SOCKET=str(workdir / "http.sock"),
        METER_HTTP_ADDRESS="127.0.0.1:0",
        METER_MAX_FRAME_BYTES="65536",
        METER_TENANT_HIERARCHY="true",
    )
    with n:
        yield n
    shutil.rmtree(workdir, ignore_errors=True)


def api_address(node: NodeProcess) -> str:
    address = node.call("status")["http"]["address"]
    assert isinstance(address, str)
    return address


def curl(target: list[str], path: str, body: str, headers: dict[str, str]) -> Answer:
    """One POST by curl; ``target`` is ``["--unix-socket", path]`` or ``[]``, ``path`` the
    whole URL."""
    args = ["curl", "-sS", "-X", "POST", *target, "--data-binary", "@-", "-w", "\n%{http_code}"]
    for k, v in {"Content-Type": "application/json", **headers}.items():
        args += ["-H", f"{k}: {v}"]
    out = subprocess.run([*args, path], input=body.encode(), capture_output=True, check=True)
    text, status = out.stdout.decode().rsplit("\n", 1)
    return int(status), json.loads(text) if text else None


def curl_socket(node: NodeProcess) -> Send:
    sock = str(node.env["METER_HTTP_SOCKET"])
    return lambda m, b, h: curl(["--unix-socket", sock], f"http://meter/v1/{m}", b, h)


def curl_tcp(node: NodeProcess) -> Send:
    address = api_address(node)
    return lambda m, b, h: curl([], f"http://{address}/v1/{m}", b, h)


def node_js(base: str, sock: str, calls: list[tuple[str, str, dict[str, str]]]) -> list[Answer]:
    """Every call through one Node.js process, in order."""
    script = [
        {"path": f"/v1/{m}", "body": b, "headers": {"Content-Type": "application/json", **h}}
        for m, b, h in calls
    ]
    out = subprocess.run(
        ["node", "-e", NODE_CLIENT, base, sock],
        input=json.dumps(script).encode(),
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr.decode()
    return [(s, b) for s, b in json.loads(out.stdout)]


def _month() -> str:
    return datetime.now(UTC).strftime("%Y-%m")


#: ``(method, body: an object, or text sent as is, headers, check)``.
Case = tuple[str, Any, dict[str, str], Callable[[Answer], bool]]


def cases(t: str) -> list[Case]:
    """Every method and its errors for tenant ``t``, in order: ``(method, body, headers,
    check)``; a body ``"$n"`` value is the n-th answer's result."""

    def ok(pred: Callable[[Any], bool] = lambda r: True) -> Callable[[Answer], bool]:
        return lambda a: a[0] == 200 and pred(a[1]["result"])

    def err(status: int, code: str) -> Callable[[Answer], bool]:
        return lambda a: (
            a[0] == status and a[1]["error"]["code"] == code and bool(a[1]["error"]["message"])
        )

    k = {"Idempotency-Key": f"{t}-k1"}
    return [
        ("ping", {}, {}, ok(lambda r: r == "pong")),  # 0
        ("status", "", {}, ok(lambda r: isinstance(r["node_id"], str))),
        ("set_feature", {"feature": "api"}, {}, ok(lambda r: r["feature"] == "api")),
        ("get_feature", {"feature": "api"}, {}, ok(lambda r: r["declared"] is True)),
        (
            "set_plan",
            {"name": f"p-{t}", "features": {"api": {"limit": "100"}}},
            {},
            ok(lambda r: r["version"] >= 1),
        ),
        ("assign_plan", {"tenant": t, "plan": f"p-{t}"}, {}, ok()),  # 5
        ("limits", {"tenant": t}, {}, ok(lambda r: r["limits"]["api"]["limit"] == 100)),
        ("track", {"tenant": t, "feature": "api", "qty": 5}, k, ok(lambda r: r == 5)),
        # The same Idempotency-Key: answered as the first time, counted once.
        ("track", {"tenant": t, "feature": "api", "qty": 5}, k, ok(lambda r: r == 5)),
        ("track", {"tenant": t, "feature": "api", "qty": 200}, {}, err(429, "limit_exceeded")),
        ("check", {"tenant": t, "feature": "api"}, {}, ok(lambda r: r["allowed"] is True)),  # 10
        ("usage", {"tenant": t, "feature": "api"}, {}, ok(lambda r: r == 5)),
        ("usage_all", {"tenant": t}, {}, ok(lambda r: r == {"api": 5})),
        (
            "track_many",
            {"items": [[t, "api", 1], [t, "api", "1", {"id": f"{t}-m1"}]]},
            {},
            ok(lambda r: r == [6, 7]),
        ),
        (
            "reserve",
            {"tenant": t, "feature": "api", "qty": 2, "ttl_ms": 60000},
            {},
            ok(lambda r: isinstance(r, str)),
        ),
        ("commit", {"reservation_id": "$14"}, {}, ok(lambda r: r == 9)),  # 15
        ("reserve", {"tenant": t, "feature": "api", "qty": 1}, {}, ok()),
        ("release", {"reservation_id": "$16"}, {}, ok(lambda r: r is None)),
        (
            "void",
            {"call_id": f"{t}-k1"},
            {},
            ok(lambda r: r["voided"] == 5 and r["value"] == 4),
        ),
        ("set_limit", {"tenant": t, "feature": "tok", "limit": 10, "kind": "soft"}, {}, ok()),
        ("clear_limit", {"tenant": t, "feature": "tok"}, {}, ok()),  # 20
        ("history", {"tenant": t, "feature": "api"}, {}, ok(lambda r: sum(v for _, v in r) == 4)),
        ("export", {"period": _month(), "limit": 10}, {}, ok(lambda r: "rows" in r)),
        ("grant", {"tenant": t, "amount": 100}, {"Idempotency-Key": f"{t}-g"}, ok()),
        (
            "grant",
            {"tenant": t, "amount": 100},
            {"Idempotency-Key": f"{t}-g"},
            ok(lambda r: r["balance_after"] == 100),
        ),
        ("debit", {"tenant": t, "amount": 1000}, {}, err(402, "insufficient_balance")),  # 25
        ("balance", {"tenant": t}, {}, ok(lambda r: r["available"] == 100)),
        ("ledger", {"tenant": t}, {}, ok(lambda r: len(r["entries"]) == 1)),
        ("ledger_timeline", {"limit": 1000}, {}, ok(lambda r: "entries" in r)),
        ("close_period", {"period": _month(), "node": "gone"}, {}, err(400, "invalid_argument")),
        # Errors: each changes nothing (the usage below is still 4).
        ("nope", {}, {}, err(404, "unknown_method")),  # 30
        ("track", '{"tenant": ', {}, err(400, "invalid_argument")),  # malformed JSON
        ("track", "[" * 5000, {}, err(400, "invalid_argument")),  # nested too deeply
        ("track", [t, "api", 1], {}, err(400, "invalid_argument")),  # not an object
        ("track", {"tenant": t, "feature": "api", "qty": "x"}, {}, err(400, "invalid_argument")),
        ("track", {"tenant": t, "feature": 7}, {}, err(400, "invalid_argument")),
        ("track", {"tenant": t, "feature": "api", "bogus": 1}, {}, err(400, "invalid_argument")),
        ("track", {"feature": "api"}, {}, err(400, "invalid_argument")),  # missing tenant
        # A read ignores an Idempotency-Key (client middleware may add one to every POST).
        ("usage", {"tenant": t, "feature": "api"}, k, ok(lambda r: r == 4)),
        ("track", {"tenant": t, "feature": "api", "id": "other"}, k, err(400, "invalid_argument")),
        ("usage", {"tenant": t, "feature": "api", "at": "soon"}, {}, err(400, "invalid_argument")),
        ("commit", {"reservation_id": "no-such"}, {}, err(404, "not_found")),
        ("track", {"tenant": t, "feature": "web"}, k, err(409, "conflict")),  # k1 is api's
        (
            "track",
            {"tenant": t, "feature": "api", "at": 1_000_000_000},
            {},
            err(409, "period_closed"),
        ),
        ("track", {"tenant": t, "feature": "x" * 70_000}, {}, err(413, "payload_too_large")),
        ("usage", {"tenant": t, "feature": "api"}, {}, ok(lambda r: r == 4)),
        ("usage", {"tenant": t, "feature": "web"}, {}, ok(lambda r: r == 0)),
        ("track", {"tenant": f"{t}/al", "feature": "api", "qty": 3}, {}, ok(lambda r: r == 3)),
        (
            "usage_children",
            {"account": t, "feature": "api"},
            {},
            ok(
                lambda r: (
                    r
                    == {"total": 7, "children": [{"tenant": f"{t}/al", "value": 3}]}
                    | {"cursor": None}
                )
            ),
        ),
        (
            "usage_children",
            {"account": t, "feature": "api", "limit": 0},
            {},
            err(400, "invalid_argument"),
        ),
    ]


def _body(body: Any) -> str:
    return body if isinstance(body, str) else json.dumps(body)


def _run_python(send: Send, t: str) -> None:
    answers: list[Answer] = []
    for i, (method, body, headers, check) in enumerate(cases(t)):
        text = _body(body)
        for n, (_, prev) in enumerate(answers):
            if f'"${n}"' in text:
                text = text.replace(f'"${n}"', json.dumps(prev["result"]))
        got = send(method, text, headers)
        answers.append(got)
        assert check(got), (i, method, body, got)


def test_every_method_and_its_errors_by_curl_on_the_socket(node: NodeProcess) -> None:
    _run_python(curl_socket(node), "curl-sock")


def test_every_method_and_its_errors_by_curl_on_tcp(node: NodeProcess) -> None:
    _run_python(curl_tcp(node), "curl-tcp")


@pytest.mark.parametrize("transport", ["fetch-tcp", "http-socket"])
def test_every_method_and_its_errors_by_node_js(node: NodeProcess, transport: str) -> None:
    t = f"js-{transport}"
    table = cases(t)
    calls = [(m, _body(b), h) for m, b, h, _ in table]
    sock = "" if transport == "fetch-tcp" else str(node.env["METER_HTTP_SOCKET"])
    answers = node_js(f"http://{api_address(node)}", sock, calls)
    for i, ((method, body, _, check), got) in enumerate(zip(table, answers, strict=True)):
        assert check(got), (i, method, body, got)


def test_integers_past_2_53_are_exact_both_ways(node: NodeProcess) -> None:
    send = curl_socket(node)
    big = 2**53 + 1
    status, body = send("track", json.dumps({"tenant": "big", "feature": "f", "qty": str(big)}), {})
    assert (status, body) == (200, {"result": str(big)})
    status, body = send("track", json.dumps({"tenant": "big", "feature": "f", "qty": -2}), {})
    assert body == {"result": 2**53 - 1}  # back within JSON's exact range: a number again
    assert node.call("usage", "big", "f") == 2**53 - 1


def test_get_on_a_method_and_the_openapi_document(node: NodeProcess) -> None:
    sock = str(node.env["METER_HTTP_SOCKET"])
    out = subprocess.run(
        ["curl", "-sS", "--unix-socket", sock, "-w", "\n%{http_code}", "http://m/v1/track"],
        capture_output=True,
        check=True,
    )
    assert out.stdout.decode().rsplit("\n", 1)[1] == "405"
    out = subprocess.run(
        ["curl", "-sS", "--unix-socket", sock, "http://m/openapi.json"],
        capture_output=True,
        check=True,
    )
    doc = json.loads(out.stdout)
    assert {p.removeprefix("/v1/") for p in doc["paths"]} == {*SIGNATURES, "subscribe"}


def test_a_track_over_rpc_reaches_an_event_stream(node: NodeProcess) -> None:
    """``GET /v1/subscribe``: the watched counter now, then the change a MessagePack-RPC
    track makes, within the push's tick; and the stream's subscriber goes with it."""
    node.call("track", "sse", "api", 3)
    host, port = api_address(node).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /v1/subscribe?tenant=sse&features=api HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        got = b""

        def has(text: bytes) -> bool:
            nonlocal got
            s.settimeout(0.2)
            with contextlib.suppress(TimeoutError):
                got += s.recv(65536)
            return text in got

        wait_for(lambda: has(b'"value":3'), what="the value now", timeout=10)
        assert b"text/event-stream" in got
        node.call("track", "sse", "api", 4)
        wait_for(lambda: has(b'"value":7'), what="the pushed value", timeout=10)
        assert b'event: usage\ndata: {"tenant":"sse","feature":"api","value":7' in got
        assert node.call("status")["http"]["streams"] == 1
    wait_for(lambda: node.call("status")["http"]["streams"] == 0, what="the stream's end")


def test_the_bearer_token_guards_tcp_and_non_loopback_needs_one() -> None:
    workdir = short_tmpdir()
    try:
        with NodeProcess(
            workdir,
            METER_STORAGE="memory",
            METER_HTTP_ADDRESS="127.0.0.1:0",
            METER_HTTP_TOKEN="s3cret",
        ) as n:
            send = curl_tcp(n)
            status, body = send("ping", "{}", {})
            assert (status, body["error"]["code"]) == (401, "unauthenticated")
            assert send("ping", "{}", {"Authorization": "Bearer wrong"})[0] == 401
            assert send("ping", "{}", {"Authorization": "Bearer s3cret"}) == (
                200,
                {"result": "pong"},
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    with pytest.raises(ConfigError, match="http_token"):
        load(env={"METER_HTTP_ADDRESS": "0.0.0.0:8080"})
    with pytest.raises(ConfigError, match="http_token"):
        load(env={"METER_HTTP_ADDRESS": "example.com:8080"})
    assert load(env={"METER_HTTP_ADDRESS": "0.0.0.0:8080", "METER_HTTP_TOKEN": "t"}).http.token
    assert load(env={"METER_HTTP_ADDRESS": "[::1]:0"}).http.address == ("::1", 0)
    with pytest.raises(ConfigError, match="differ"):
        load(env={"METER_SOCKET": "/tmp/a.sock", "METER_HTTP_SOCKET": "/tmp/a.sock"})


def test_a_drain_ends_streams_and_removes_the_socket(tmp_path: Path) -> None:
    """SIGTERM: an open event stream ends, the API's socket file goes, the node drains."""
    workdir = short_tmpdir()
    try:
        n = NodeProcess(workdir, METER_STORAGE="memory", METER_HTTP_SOCKET=str(workdir / "h.sock"))
        with n:
            sock = str(workdir / "h.sock")
            stream = subprocess.Popen(
                ["curl", "-sS", "-N", "--unix-socket", sock, "http://m/v1/subscribe?tenant=d"],
                stdout=subprocess.PIPE,
            )
            wait_for(lambda: n.call("status")["http"]["streams"] == 1, what="the stream")
            t0 = time.monotonic()
            assert n.stop() == 0
            assert stream.wait(10) == 0  # the stream ended cleanly with the node
            assert time.monotonic() - t0 < 10
            assert not Path(sock).exists()
            log = n.log()
            assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_an_answered_http_track_survives_kill_9() -> None:
    """A call answered over HTTP is in the write-ahead log: kill -9 right after the answer,
    restart, and the unit is there (sqlite storage, the default log)."""
    workdir = short_tmpdir()
    try:
        env = {"METER_HTTP_SOCKET": str(workdir / "h.sock"), "METER_FLUSH_INTERVAL_MS": "60000"}
        n = NodeProcess(workdir, **env).start()
        send = curl_socket(n)
        for i in range(1, 21):
            assert send("track", json.dumps({"tenant": "k9", "feature": "f"}), {}) == (
                200,
                {"result": i},
            )
        n.kill()
        with NodeProcess(workdir, **env) as again:
            assert again.call("usage", "k9", "f") == 20
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _raw(node: NodeProcess, request: bytes) -> tuple[int, bytes]:
    """``(status, body)`` of one request sent as is (with ``Connection: close``) on the API's
    TCP address."""
    host, port = api_address(node).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_web_pages_cannot_call_the_api(node: NodeProcess) -> None:
    """A browser's page may POST to a loopback port, but not with ``Content-Type:
    application/json`` without a preflight (never answered), not without ``Origin``, and (DNS
    rebinding) not with a loopback ``Host``: each is refused and counts nothing; HEAD does not
    open a stream."""
    body = json.dumps({"tenant": "web", "feature": "f"}).encode()

    def post(headers: bytes) -> tuple[int, bytes]:
        return _raw(
            node,
            b"POST /v1/track HTTP/1.1\r\nContent-Length: %d\r\nConnection: close\r\n%s\r\n%s"
            % (len(body), headers, body),
        )

    assert post(b"Host: 127.0.0.1\r\nContent-Type: text/plain\r\n")[0] == 415
    assert post(b"Host: 127.0.0.1\r\n")[0] == 415
    origin = b"Host: 127.0.0.1\r\nContent-Type: application/json\r\nOrigin: http://evil.example\r\n"
    assert post(origin)[0] == 403
    rebound = b"Host: evil.example:8080\r\nContent-Type: application/json\r\n"
    assert post(rebound)[0] == 403
    status, got = post(b"Host: localhost:1\r\nContent-Type: application/json; charset=utf-8\r\n")
    assert (status, json.loads(got)) == (200, {"result": 1})
    assert node.call("usage", "web", "f") == 1  # only the last one counted
    head = b"HEAD /v1/subscribe?tenant=web HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    status, _ = _raw(node, head)
    assert status == 405
    assert node.call("status")["http"]["streams"] == 0


async def test_an_answer_waits_for_the_log_and_a_failed_write_is_unavailable(
    tmp_path: Path,
) -> None:
    """In process, on a real log: with the log's disk full, an HTTP ``track`` (and an error
    answer behind it) is answered 503 and counts nothing, where an answer sent before the
    commit would have said 200."""
    import aiohttp

    from meter.http.api import Api
    from meter.http.listener import Limits, Listener
    from storage.memory import MemoryStorage
    from tests.support.services import logged_service
    from tests.test_wal_service import disk_full

    svc, wal = await logged_service(tmp_path / "wal", MemoryStorage())
    api = Api(svc, wal=wal, watch=svc.watch)
    listener = Listener(Limits(8, 5.0, 5.0, 1 << 20), api.handler())
    sock = str(tmp_path / "h.sock")
    await listener.start_unix(sock)
    hdr = {"Content-Type": "application/json"}
    try:
        conn = aiohttp.UnixConnector(path=sock)
        async with aiohttp.ClientSession(connector=conn) as session:

            async def track(qty: int) -> tuple[int, Any]:
                body = {"tenant": "w", "feature": "f", "qty": qty}
                async with session.post("http://m/v1/track", json=body, headers=hdr) as r:
                    return r.status, await r.json()

            assert await track(2) == (200, {"result": 2})
            with disk_full(wal):
                status, got = await track(5)
                assert (status, got["error"]["code"]) == (503, "unavailable")
            assert svc.table.value(("w", "f", svc.key_for("w", "f")[2])) == 2
    finally:
        await listener.close()
        await wal.close(final_checkpoint=False)


async def test_a_listener_full_of_working_connections_never_cuts_a_call_off(
    tmp_path: Path,
) -> None:
    """A connection past the limit, with every connection past its first request, asks the
    oldest to close once its call is answered: the call at work there still gets its answer
    (a reset would make a client retry a call that counted), and the new one is served."""
    import asyncio

    from aiohttp import web

    from meter.http.listener import Limits, Listener

    working = asyncio.Event()
    finish = asyncio.Event()

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/slow":
            working.set()
            await finish.wait()
        return web.Response(text="ok")

    listener = Listener(Limits(2, 5.0, 5.0, 1024), handle)
    sock = str(tmp_path / "l.sock")
    await listener.start_unix(sock)

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(sock)

    async def answer(reader: asyncio.StreamReader) -> bytes:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        return head.split(b" ")[1] + b" " + await reader.readexactly(length)

    try:
        a = await connect()
        a[1].write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(working.wait(), 10)
        b = await connect()
        b[1].write(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await answer(b[0]) == b"200 ok"
        c = await connect()  # a third: room is made (a and b have both sent a request)
        c[1].write(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await answer(c[0]) == b"200 ok"
        finish.set()
        assert await answer(a[0]) == b"200 ok"  # answered, then closed
        assert await asyncio.wait_for(a[0].read(), 10) == b""
        for _, writer in (a, b, c):
            writer.close()
    finally:
        await listener.close()
