"""An HTTP proxy in front of DynamoDB Local that counts requests by operation and injects
faults into ``BatchGetItem`` (the seeding read), leaving every other operation untouched.

It reads each HTTP/1.1 request whole, names its operation from the ``X-Amz-Target`` header
(``DynamoDB_20120810.BatchGetItem`` -> ``BatchGetItem``), and then, for ``BatchGetItem`` only:

``fail = "500"``
    answers ``500 InternalServerError`` itself (the request never reaches the server);
``fail = "drop"``
    closes the connection without an answer (the request never reaches the server);
``unprocessed = n``
    forwards the request and rewrites the next ``n`` answers that hold items: about half of
    the returned items (at least one) are taken out of ``Responses`` and put into
    ``UnprocessedKeys``, as DynamoDB does when it runs short of capacity, so the client has to
    ask for them again. ``Content-Length`` is fixed and ``x-amz-crc32`` recomputed (botocore
    checks it);
:meth:`DynamoDBProxy.hold`
    forwards each request but holds its answer until the test releases it
    (:meth:`~DynamoDBProxy.release_held`, :meth:`~DynamoDBProxy.stop_holding`), so the node's
    reads can be seen in flight and queued, wave by wave, whatever the machine's speed.

:meth:`DynamoDBProxy.answer_next`
    answers the next request of an operation with a canned DynamoDB error (the request never
    reaches the server), e.g. a ``TransactWriteItems`` cancelled for a given reason.

Setting ``fail`` back to ``None`` heals the proxy; a request already held is not replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import zlib
from collections import Counter
from typing import Any

from tests.support.lossy_proxy import LoopbackProxy

TARGET_PREFIX = "DynamoDB_20120810."


class Message:
    """One HTTP/1.1 message: its start line, headers (in order) and whole body."""

    def __init__(self, start: str, headers: list[tuple[str, str]], body: bytes) -> None:
        self.start = start
        self.headers = headers
        self.body = body

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def encode(self) -> bytes:
        """The message as bytes, with ``Content-Length`` set to the body (never chunked)."""
        lines = [self.start]
        for k, v in self.headers:
            if k.lower() not in ("content-length", "transfer-encoding"):
                lines.append(f"{k}: {v}")
        lines.append(f"Content-Length: {len(self.body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


async def read_message(reader: asyncio.StreamReader) -> Message | None:
    """Read one whole HTTP/1.1 message (``None`` on a clean end of stream)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    start, *rest = head[:-4].decode("latin-1").split("\r\n")
    headers = []
    for line in rest:
        k, _, v = line.partition(":")
        headers.append((k.strip(), v.strip()))
    msg = Message(start, headers, b"")
    length = msg.header("content-length")
    if length is not None:
        msg.body = await reader.readexactly(int(length))
    elif (msg.header("transfer-encoding") or "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
            if size == 0:
                break
        msg.body = b"".join(parts)
    elif not start.startswith("HTTP/"):
        msg.body = b""  # a request without a length has no body
    else:
        msg.body = await reader.read()  # a response ended by the close
    return msg


class DynamoDBProxy(LoopbackProxy):
    """Listens on ``127.0.0.1:<port>`` and forwards to ``127.0.0.1:<upstream_port>``."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__()
        self.upstream_port = upstream_port
        #: ``"500"`` or ``"drop"``: how ``BatchGetItem`` requests fail now; ``None``: they pass.
        self.fail: str | None = None
        #: How many more ``BatchGetItem`` answers with items to rewrite (see the module doc).
        self.unprocessed = 0
        #: Requests received, by operation (``BatchGetItem``, ``UpdateItem``, ...).
        self.ops: Counter[str] = Counter()
        #: ``BatchGetItem`` requests failed (answered 500 or dropped).
        self.failed = 0
        #: ``BatchGetItem`` answers rewritten, and items moved into ``UnprocessedKeys``.
        self.rewritten = 0
        self.moved = 0
        #: Keys asked for by ``BatchGetItem`` requests forwarded, per (pk, sk).
        self.asked: Counter[tuple[str, str]] = Counter()
        #: ``BatchGetItem`` answers held now, and released so far (see :meth:`hold`).
        self.held = 0
        self.released = 0
        self._release: asyncio.Event | None = None
        self._canned: dict[str, list[Message]] = {}

    def answer_next(self, op: str, error: str, message: str, **fields: Any) -> None:
        """Answer the next ``op`` request (after any queued before) with a 400 error of type
        ``error`` and ``fields`` (e.g. ``CancellationReasons``) without forwarding it."""
        body = {"__type": f"com.amazonaws.dynamodb.v20120810#{error}", "message": message}
        self._canned.setdefault(op, []).append(_error(400, "Bad Request", {**body, **fields}))

    def forget_answers(self, op: str) -> None:
        """Drop the answers :meth:`answer_next` queued for ``op`` and not sent yet."""
        self._canned.pop(op, None)

    def hold(self) -> None:
        """From now on, hold each ``BatchGetItem`` answer until :meth:`release_held`."""
        if self._release is None:
            self._release = asyncio.Event()

    def release_held(self) -> None:
        """Send the answers held now; keep holding later ones."""
        if self._release is not None:
            self._release.set()
            self._release = asyncio.Event()

    def stop_holding(self) -> None:
        """Send every held answer and hold no more."""
        if self._release is not None:
            self._release.set()
            self._release = None

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        up_w: asyncio.StreamWriter | None = None
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            while (request := await read_message(client_r)) is not None:
                target = request.header("x-amz-target") or ""
                op = target.removeprefix(TARGET_PREFIX)
                self.ops[op] += 1
                canned = self._canned.get(op)
                if canned:
                    client_w.write(canned.pop(0).encode())
                    await client_w.drain()
                    continue
                if op == "BatchGetItem" and self.fail is not None:
                    self.failed += 1
                    if self.fail == "drop":
                        return  # closes both sides: no answer at all
                    client_w.write(_error_500().encode())
                    await client_w.drain()
                    continue
                if op == "BatchGetItem":
                    for spec in json.loads(request.body)["RequestItems"].values():
                        self.asked.update((k["pk"]["S"], k["sk"]["S"]) for k in spec["Keys"])
                up_w.write(request.encode())
                await up_w.drain()
                response = await read_message(up_r)
                if response is None:
                    return
                if op == "BatchGetItem" and self.unprocessed > 0:
                    self._move_to_unprocessed(request, response)
                release = self._release
                if op == "BatchGetItem" and release is not None:
                    self.held += 1
                    try:
                        await release.wait()
                    finally:
                        self.held -= 1
                    self.released += 1
                client_w.write(response.encode())
                await client_w.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:
            pass  # closing: the connection ends here (the server's callback must not see it)
        finally:
            for w in (client_w, up_w):
                if w is not None:
                    w.close()
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await w.wait_closed()
            self._tasks.discard(task)

    def _move_to_unprocessed(self, request: Message, response: Message) -> None:
        if response.start.split()[1] != "200":
            return
        asked: dict[str, Any] = json.loads(request.body)["RequestItems"]
        body: dict[str, Any] = json.loads(response.body)
        unprocessed: dict[str, Any] = body.get("UnprocessedKeys") or {}
        moved = 0
        for table, items in body.get("Responses", {}).items():
            if not items:
                continue
            n = max(1, len(items) // 2)
            keep, move = items[n:], items[:n]
            body["Responses"][table] = keep
            spec = {k: v for k, v in asked[table].items() if k != "Keys"}
            keys = [{"pk": it["pk"], "sk": it["sk"]} for it in move]
            entry = unprocessed.setdefault(table, {**spec, "Keys": []})
            entry["Keys"].extend(keys)
            moved += len(keys)
        if not moved:
            return
        body["UnprocessedKeys"] = unprocessed
        self.unprocessed -= 1
        self.rewritten += 1
        self.moved += moved
        response.body = json.dumps(body).encode()
        response.headers = [
            (k, str(zlib.crc32(response.body) & 0xFFFFFFFF) if k.lower() == "x-amz-crc32" else v)
            for k, v in response.headers
        ]


def _error_500() -> Message:
    body = {
        "__type": "com.amazonaws.dynamodb.v20120810#InternalServerError",
        "message": "injected by the test proxy",
    }
    return _error(500, "Internal Server Error", body)


def _error(status: int, reason: str, body: dict[str, Any]) -> Message:
    data = json.dumps(body).encode()
    return Message(
        f"HTTP/1.1 {status} {reason}",
        [
            ("Content-Type", "application/x-amz-json-1.0"),
            ("Content-Length", str(len(data))),
            ("x-amz-crc32", str(zlib.crc32(data) & 0xFFFFFFFF)),
        ],
        data,
    )
