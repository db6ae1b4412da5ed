"""Pytest fixtures for a real ``redis-server`` (loaded as a plugin from ``tests/conftest.py``).

``redis_server`` is one session-wide server (tests share it; each uses its own cluster name, so
its own channel); ``redis_factory`` starts private servers (for outage, AUTH and TLS tests) and
stops them after the test. Never the Redis on port 6379.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from tests.support.redis_server import RedisServer, RedisUnavailable


def _start(password: str | None = None, tls: bool = False) -> RedisServer:
    try:
        return RedisServer(password=password, tls=tls).start()
    except RedisUnavailable as exc:
        pytest.fail(f"redis-server is not available: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A session-wide redis-server on a free loopback port."""
    server = _start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_factory() -> Iterator[Callable[..., RedisServer]]:
    """``redis_factory(password=None, tls=False)``: a private redis-server, stopped after the
    test; ``tls=True`` serves TLS only, with a throw-away CA (``server.tls``)."""
    servers: list[RedisServer] = []

    def make(password: str | None = None, tls: bool = False) -> RedisServer:
        server = _start(password, tls)
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.close()


@pytest.fixture
def cluster_name() -> str:
    """A cluster name (so a channel) no other test uses."""
    return f"test-{uuid.uuid4().hex[:10]}"
