"""The HTTP/JSON API: every wire method as ``POST /v1/<method>``, live usage and alerts as
Server-Sent Events on ``GET /v1/subscribe``, the OpenAPI document on ``GET /openapi.json``
(docs/http.md).

A call goes through the same dispatch as a MessagePack-RPC one, by the table of
:mod:`meter.http.signatures`, and its answer leaves once the write-ahead log holds what it did,
as on the socket. Each answer is ``{"result": ...}``, or ``{"error": {"code", "message"}}``
with the code's HTTP status (:data:`~meter.http.signatures.STATUS`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from inspect import isawaitable
from time import perf_counter
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from meter.core.server import Dispatcher
from meter.core.watch import Bind, Subscriber, Watch
from meter.errors import InvalidArgument, MeterError, Unavailable
from meter.http.listener import Handler
from meter.http.openapi import document
from meter.http.signatures import JSON_SAFE_INT, SIGNATURES, STATUS, to_json, wire_params

if TYPE_CHECKING:
    from meter.core.counts import RequestStats
    from meter.wal.log import WriteAheadLog

log = logging.getLogger("meter.http")

#: An event stream with nothing to send writes a comment this often (proxies, dead peers).
KEEPALIVE_S = 15.0
#: A stream looks this often whether its client is still there.
CHECK_S = 1.0
#: Notifications written to a stream at a time.
EVENT_BATCH = 256
_JSON = "application/json"
#: Results of these types are answered at once; anything else is checked for awaitability.
_PLAIN = frozenset({int, str, dict, list, type(None), bool})


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_dumps = _ENCODER.encode
_DECODER = json.JSONDecoder()
#: A number of 19 digits or more: orjson reads an integer past 64 bits as a float (inexact),
#: so a body holding one is read by the standard decoder.
_LONG_NUMBER = re.compile(rb"[0-9]{19}")


def read_json(raw: bytes) -> Any:
    """A call's JSON body (empty: ``{}``), by orjson (5x the standard decoder on a call's
    body) where it reads exactly what the standard one does; ``ValueError`` if not JSON (or
    nested past the interpreter's recursion limit)."""
    if _LONG_NUMBER.search(raw) is None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # (empty, NaN, bad UTF-8: the standard decoder's answer and message)
    text = raw.decode()
    try:
        return _DECODER.decode(text) if text.strip() else {}
    except RecursionError:
        raise ValueError("nested too deeply") from None


def error_response(
    code: str, message: str, headers: dict[str, str] | None = None, status: int | None = None
) -> web.Response:
    """The answer of an error ``code``: its status (or ``status``) and ``{"error": {code,
    message}}``."""
    return web.Response(
        status=status or STATUS.get(code, 500),
        text=_dumps({"error": {"code": code, "message": message}}),
        content_type=_JSON,
        headers=headers,
    )


class Api:
    """The API's handlers over one node's dispatch, log and watch."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        wal: WriteAheadLog | None,
        watch: Watch,
        request_stats: RequestStats | None = None,
    ) -> None:
        self._dispatch = dispatcher.dispatch
        self.wal = wal
        self.watch = watch
        self.request_stats = request_stats
        #: Open event streams: each one's subscriber, and the event that wakes its writer.
        self._streams: dict[Subscriber, asyncio.Event] = {}
        self._openapi = _dumps(document())
        self.closing = False
        #: Calls answered, and those answered with an error.
        self.calls = 0
        self.errors = 0

    def stats(self) -> dict[str, int]:
        """Counters for ``status``."""
        return {"calls": self.calls, "errors": self.errors, "streams": len(self._streams)}

    def handler(self, token: str | None = None, *, tcp: bool = False) -> Handler:
        """The API's handler; with ``token`` every request must carry ``Authorization:
        Bearer <token>``. On ``tcp`` without a token, only requests naming a loopback host
        in ``Host`` are served (a web page's DNS rebinding names its own)."""
        calls = {f"/v1/{method}": self._method(method) for method in SIGNATURES}
        gets = {"/v1/subscribe": self.subscribe, "/openapi.json": self.openapi}
        expected = None if token is None else token.encode("utf-8", "surrogateescape")
        check_host = tcp and token is None

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            refused = _refused(request, expected, check_host)
            if refused is not None:
                return refused
            path = request.path
            if request.method == "POST":
                call = calls.get(path)
                if call is not None:
                    return await call(request)
            elif request.method == "GET" or (request.method == "HEAD" and path != "/v1/subscribe"):
                get = gets.get(path)
                if get is not None:
                    return await get(request)
            return self.unknown(request)

        return handle

    def unknown(self, request: web.BaseRequest) -> web.Response:
        """What no route answers: a path called with a verb it does not take is 405 (code
        ``invalid_argument``), an unknown method ``unknown_method`` (404), another path
        ``not_found``."""
        path = request.path
        method = path.removeprefix("/v1/")
        if path in ("/v1/subscribe", "/openapi.json"):
            return error_response(
                "invalid_argument", f"{path}: send it as GET", {"Allow": "GET"}, status=405
            )
        if f"/v1/{method}" == path and method in SIGNATURES:
            return error_response(
                "invalid_argument", f"{method}: send it as POST", {"Allow": "POST"}, status=405
            )
        if path.startswith("/v1/"):
            return error_response(
                "unknown_method", f"unknown method {method[:64]!r}: see /openapi.json"
            )
        return error_response("not_found", f"no such path {path[:64]!r}: see /openapi.json")

    def _method(self, method: str) -> Handler:
        """The handler of ``POST /v1/<method>`` (one coroutine: each level is a cost)."""
        sig = SIGNATURES[method]
        stats = self.request_stats
        label = None if stats is None else stats.label(method)

        async def call(request: web.BaseRequest) -> web.Response:
            t0 = perf_counter()
            code: str | None = None
            try:
                if self.closing:
                    raise Unavailable("the node is shutting down")
                try:
                    raw = await request.read()
                    body = read_json(raw)
                except web.HTTPRequestEntityTooLarge as exc:
                    raise _TooLarge(exc.text or "the body is too large") from None
                except ValueError as exc:  # (UnicodeDecodeError is one)
                    raise InvalidArgument(f"{method}: the body is not JSON: {exc}") from None
                key = None if sig.read else request.headers.get("Idempotency-Key")
                result = self._dispatch(method, wire_params(sig, body, key))
                if type(result) not in _PLAIN and isawaitable(result):
                    result = await result
                wal = self.wal
                if wal is not None and wal.dirty:
                    await self._committed(wal)
                if type(result) is int and -JSON_SAFE_INT <= result <= JSON_SAFE_INT:
                    answer = f'{{"result":{result}}}'  # (a counter's value: most answers)
                else:
                    answer = _dumps({"result": to_json(result)})
            except MeterError as exc:
                code = exc.code
                wal = self.wal
                if wal is not None and wal.dirty:  # (as the socket: every answer, errors too)
                    try:
                        await self._committed(wal)
                    except Unavailable as failed:
                        code = failed.code
                        return error_response(failed.code, str(failed))
                return error_response(exc.code, str(exc))
            except ValueError as exc:  # what JSON cannot carry
                code = "internal"
                log.error("unencodable result of %.64r answered as internal: %s", method, exc)
                return error_response("internal", "internal error")
            except Exception:
                code = "internal"
                log.exception("internal error in %.64r", method)
                return error_response("internal", "internal error")
            finally:
                self.calls += 1
                if code is not None:
                    self.errors += 1
                if stats is not None:
                    assert label is not None
                    stats.one(label, code, perf_counter() - t0)
            return web.Response(text=answer, content_type=_JSON)

        return call

    async def _committed(self, wal: WriteAheadLog) -> None:
        """Return once ``wal`` holds what was appended so far (the socket holds its answers
        so); :class:`Unavailable` if that write failed (its records were undone)."""
        done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

        def send(arrays: list[list[Any]], error: str | None) -> None:
            if not done.done():
                done.set_result(error)

        wal.hold(send, [])
        error = await done
        if error is not None:
            raise Unavailable(f"the write-ahead log failed, nothing was done: {error}")

    async def openapi(self, request: web.BaseRequest) -> web.Response:
        """``GET /openapi.json``."""
        return web.Response(text=self._openapi, content_type=_JSON)

    # -- event streams --------------------------------------------------------------------

    async def subscribe(self, request: web.BaseRequest) -> web.StreamResponse:
        """``GET /v1/subscribe?tenant=T&features=a,b&alerts=true``: the watched counters now
        (``usage`` events), then each change and each alert as it happens."""
        q = request.query
        tenants = q.getall("tenant", [])
        alerts = q.get("alerts", "false")
        if self.closing:
            return error_response("unavailable", "the node is shutting down")
        if alerts not in ("true", "false") or (not tenants and alerts != "true"):
            return error_response(
                "invalid_argument",
                "subscribe: give tenant=T (repeat for more), alerts=true, or both",
            )
        raw = q.get("features")
        sub = Subscriber()
        rows: list[list[Any]] = []
        streaming = False
        try:
            features = None if raw is None else [f for f in raw.split(",") if f]
            for tenant in tenants:
                rows.extend(await self._bound("subscribe", [tenant, features], sub))
            if alerts == "true":
                await self._bound("subscribe_alerts", [], sub)
            wal = self.wal
            if wal is not None and wal.dirty:  # (values the log holds: none a crash undoes)
                await self._committed(wal)
            streaming = True
        except MeterError as exc:
            return error_response(exc.code, str(exc))
        finally:
            if not streaming:
                self.watch.remove(sub)
        wake = self._streams[sub] = asyncio.Event()
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"}
        )
        try:
            await resp.prepare(request)
            await resp.write(b"".join(_usage_event(r) for r in rows) or b": watching\n\n")
            quiet = 0.0
            while not self.closing:
                transport = request.transport
                if transport is None or transport.is_closing():
                    break  # the client went away (nothing to write tells it otherwise)
                try:
                    await asyncio.wait_for(wake.wait(), CHECK_S)
                except TimeoutError:
                    quiet += CHECK_S
                    if quiet >= KEEPALIVE_S:
                        quiet = 0.0
                        await resp.write(b": keep-alive\n\n")
                    continue
                wake.clear()
                quiet = 0.0
                while sub.alerts:
                    await resp.write(
                        b"".join(_event("alert", a) for a in sub.take_alerts(EVENT_BATCH))
                    )
                while sub.pending:
                    await resp.write(b"".join(_usage_event(r) for r in sub.take(EVENT_BATCH)))
        except ConnectionError:
            pass  # the client went away
        finally:
            del self._streams[sub]
            self.watch.remove(sub)
        return resp

    async def _bound(self, method: str, params: list[Any], sub: Subscriber) -> Any:
        bind = self._dispatch(method, params)
        assert type(bind) is Bind
        result = bind.run(sub)
        return await result if isawaitable(result) else result

    def push(self) -> None:
        """Wake every stream with notifications waiting (the node's usage push)."""
        for sub, wake in self._streams.items():
            if sub.has_pending:
                wake.set()

    def close(self) -> None:
        """Refuse calls from now on (the node drains); end every stream."""
        self.closing = True
        for wake in self._streams.values():
            wake.set()


class _TooLarge(MeterError):
    """A body over the listener's ``max_body`` (HTTP only: the socket has ``max_frame_bytes``)."""

    code = "payload_too_large"


def _event(kind: str, data: Any) -> bytes:
    return f"event: {kind}\ndata: {_dumps(to_json(data))}\n\n".encode()


def _usage_event(row: list[Any]) -> bytes:
    """A usage notification (``[tenant, feature, value, period, dims?]``) as an event."""
    data: dict[str, Any] = {"tenant": row[0], "feature": row[1], "value": row[2], "period": row[3]}
    if len(row) > 4:
        data["dimensions"] = row[4]
    return _event("usage", data)


#: ``Host`` names a request on a TCP listener without a token may carry (with any port).
_LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})


def _refused(
    request: web.BaseRequest, token: bytes | None, check_host: bool
) -> web.Response | None:
    """Why ``request`` is not served, as its answer, or ``None``. A browser's page may send a
    request to a loopback port; it cannot send one with ``Content-Type: application/json``
    (without a preflight the API never answers), with no ``Origin``, nor (DNS rebinding)
    with a loopback ``Host``."""
    headers = request.headers
    if (
        token is None
        and not check_host
        and headers.get("Content-Type") == _JSON
        and "Origin" not in headers
    ):
        return None  # (what every call of a client looks like: the checks below pass)
    if token is not None:
        scheme, _, given = headers.get("Authorization", "").partition(" ")
        raw = given.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(raw, token):
            return error_response(
                "unauthenticated",
                "send Authorization: Bearer <http_token>",
                headers={"WWW-Authenticate": "Bearer"},
            )
    if "Origin" in headers:
        return error_response(
            "invalid_argument", "requests from web pages (with an Origin) are refused", status=403
        )
    if check_host:
        host = headers.get("Host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        if name not in _LOOPBACK_HOSTS and not name.startswith("127."):
            return error_response(
                "invalid_argument", f"Host {host[:64]!r} is not this machine", status=403
            )
    if request.method == "POST":
        kind = headers.get("Content-Type", "").partition(";")[0].strip().lower()
        if kind != "application/json":
            return error_response(
                "invalid_argument",
                "send the params as Content-Type: application/json",
                status=415,
            )
    return None
