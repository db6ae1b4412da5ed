"""Fixtures of tests that start node processes (loaded as a plugin from ``tests/conftest.py``):
a short temp dir (socket paths are limited), a list of nodes killed at the end whatever the
test did, and a fleet of real clustered nodes (:class:`~tests.support.cluster_harness.Fleet`).

``fleet`` is one test's: ``fleet(n, **METER_env)`` starts ``n`` nodes on the session's
redis-server (``redis=`` another), the test's DynamoDB Local table (``dynamodb_table``, so the
test can read what they stored) and the test's cluster name (``cluster_name``). A test that
uses it is marked ``dynamodb`` and ``redis``.

``module_fleet`` is shared by the tests of one module, on a table and a cluster name of its
own: only for tests that cannot affect each other (each its own tenants, none reading
fleet-wide status counters, none stopping a node or a server).
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster_harness import Fleet
from tests.support.fixtures_dynamodb import create_table
from tests.support.nodes import NodeProcess, short_tmpdir
from tests.support.redis_server import RedisServer


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = short_tmpdir("mt-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def nodes_cleanup() -> Iterator[list[NodeProcess]]:
    started: list[NodeProcess] = []
    yield started
    for p in started:
        if p.proc is not None and p.proc.poll() is None:
            p.kill()


@pytest.fixture
def fleet(
    workdir: Path,
    redis_server: RedisServer,
    dynamodb_local: str,
    dynamodb_table: str,
    cluster_name: str,
) -> Iterator[Fleet]:
    """``fleet(n, **METER_env)``: this test's real nodes, killed at its end."""
    f = Fleet(
        workdir,
        redis_url=redis_server.url,
        dynamodb_endpoint=dynamodb_local,
        table=dynamodb_table,
        cluster=cluster_name,
    )
    try:
        yield f
    finally:
        f.close()


@pytest.fixture(scope="module")
def module_fleet(
    request: pytest.FixtureRequest, redis_server: RedisServer, dynamodb_local_server: str
) -> Iterator[Fleet]:
    """A :class:`Fleet` shared by the tests of one module (see the module doc), killed after
    the last of them; the module is marked ``dynamodb`` and ``redis``."""
    for mark in ("dynamodb", "redis"):
        if request.node.get_closest_marker(mark) is None:
            pytest.fail(f"{request.node.nodeid} uses module_fleet but is not marked {mark}")
    workdir = short_tmpdir("mf-")
    f = Fleet(
        workdir,
        redis_url=redis_server.url,
        dynamodb_endpoint=dynamodb_local_server,
        table=asyncio.run(create_table(dynamodb_local_server)),
        cluster=f"test-{uuid.uuid4().hex[:10]}",
    )
    try:
        yield f
    finally:
        f.close()
        shutil.rmtree(workdir, ignore_errors=True)
