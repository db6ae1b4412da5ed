"""DynamoDB's JSON protocol spoken directly, for the flush's transactions and read-backs
(ADR 0015).

botocore spends about 2 ms of CPU on every request around the network: its endpoint rules
run a JMESPath search over every item of a transaction, its serializer walks the request's
shape value by value, the user agent string is built again, and a dozen hooks fire. A flush
sends the same two kinds of request thousands of times, and their items are already in
DynamoDB's wire shape. So this module sends them itself: the body is the request as JSON,
signed by botocore's own SigV4 signer with the session's credentials (refreshed as botocore
refreshes them), posted with aiohttp to the endpoint botocore resolved. Only what the flush
needs is here; every other call goes through botocore.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.request
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest

#: DynamoDB's JSON protocol: the API version in every target.
TARGET = "DynamoDB_20120810."
CONTENT_TYPE = "application/x-amz-json-1.0"


class WireError(Exception):
    """An error answer: its code (``TransactionCanceledException``...), message, HTTP
    status, and a cancelled transaction's reason code per item (``None`` otherwise)."""

    def __init__(self, code: str, message: str, status: int, reasons: list[str] | None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.reasons = reasons


class NoCredentials(Exception):
    """The session has no AWS credentials to sign with."""


class Wire:
    """Signed JSON requests to one DynamoDB endpoint over one aiohttp connection pool."""

    def __init__(
        self,
        url: str,
        region: str,
        credentials: Any,
        *,
        connections: int,
        connect_timeout: float,
        read_timeout: float,
        user_agent: str,
    ) -> None:
        self.url = url.rstrip("/") + "/"
        self.region = region
        #: botocore's (aio) credentials: frozen per request, so a refresh is picked up.
        self.credentials = credentials
        self._connections = connections
        self._timeout = aiohttp.ClientTimeout(sock_connect=connect_timeout, sock_read=read_timeout)
        self._headers = {"Content-Type": CONTENT_TYPE, "User-Agent": user_agent}
        self._http: aiohttp.ClientSession | None = None
        self._proxy: str | None = None

    async def open(self) -> None:
        """Open the connection pool. As botocore does, it takes the proxy from
        ``HTTPS_PROXY``/``HTTP_PROXY`` (and ``NO_PROXY``) and trusts the CA bundle of
        ``AWS_CA_BUNDLE`` when set; a proxy or bundle named only in botocore's config file is
        not seen here (docs/storage.md)."""
        if self._http is None:
            bundle = os.environ.get("AWS_CA_BUNDLE")
            tls: ssl.SSLContext | bool = (
                ssl.create_default_context(cafile=bundle) if bundle else True
            )
            # The proxy is looked up once: aiohttp's trust_env looks it up (and ~/.netrc)
            # again on every request, which cost a flush 150 us of CPU a key.
            parts = urlsplit(self.url)
            proxy = urllib.request.getproxies().get(parts.scheme)
            if proxy and urllib.request.proxy_bypass(parts.hostname or ""):
                proxy = None
            self._proxy = proxy or None
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._connections, ssl=tls),
                timeout=self._timeout,
            )

    async def close(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.close()

    async def call(self, op: str, params: dict[str, Any]) -> dict[str, Any]:
        """One request of operation ``op``; its answer. Raises :class:`WireError` for an
        error answer, :class:`NoCredentials`, and aiohttp's or asyncio's errors (timeouts,
        connections) as they are: the caller maps them."""
        if self._http is None:
            raise RuntimeError("the wire is not open")
        if self.credentials is None:
            raise NoCredentials("no AWS credentials to sign DynamoDB requests with")
        frozen = await self.credentials.get_frozen_credentials()
        body = json.dumps(params, separators=(",", ":")).encode()
        request = AWSRequest(
            "POST", self.url, data=body, headers={**self._headers, "X-Amz-Target": TARGET + op}
        )
        SigV4Auth(frozen, "dynamodb", self.region).add_auth(request)
        async with self._http.post(
            self.url, data=body, headers=dict(request.headers.items()), proxy=self._proxy
        ) as resp:
            raw = await resp.read()
            status = resp.status
        try:
            answer: Any = json.loads(raw) if raw else {}
        except ValueError:
            answer = None
        if status == 200 and isinstance(answer, dict):
            return answer
        if not isinstance(answer, dict):
            raise WireError("InternalServerError", f"HTTP {status}: {raw[:200]!r}", status, None)
        code = str(answer.get("__type", "")).rpartition("#")[2] or f"HTTP{status}"
        message = str(answer.get("message", answer.get("Message", "")))
        reasons = answer.get("CancellationReasons")
        codes = (
            [str(r.get("Code", "None")) if isinstance(r, dict) else "?" for r in reasons]
            if isinstance(reasons, list)
            else None
        )
        raise WireError(code, message, status, codes)
