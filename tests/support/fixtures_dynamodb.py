"""Pytest fixtures for Amazon DynamoDB Local (loaded as a plugin from ``tests/conftest.py``).

``dynamodb_local`` is the endpoint URL of one in-memory DynamoDB Local per test session (on a
free loopback port), for tests marked ``dynamodb`` only; ``dynamodb_table`` gives each test a
fresh, initialised table name; ``dynamodb_storage`` an opened :class:`DynamoDBStorage` on it.
If Java or npm is missing the fixtures fail with a message saying so (deselect with
``-m "not dynamodb"``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from storage.dynamodb import DynamoDBStorage
from tests.support.dynamodb_local import (
    TEST_JAVA_OPTIONS,
    DynamoDBLocal,
    DynamoDBLocalUnavailable,
    ensure_installed,
)


@pytest.fixture(scope="session")
def dynamodb_local_home() -> Path:
    """The directory holding DynamoDBLocal.jar (fetched once into the cache)."""
    try:
        return ensure_installed()
    except DynamoDBLocalUnavailable as exc:
        pytest.fail(f"DynamoDB Local is not available: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def dynamodb_local_server(dynamodb_local_home: Path) -> Iterator[str]:
    """The endpoint URL of a session-wide, in-memory DynamoDB Local."""
    server = DynamoDBLocal(dynamodb_local_home, java_options=TEST_JAVA_OPTIONS)
    try:
        server.start()
    except DynamoDBLocalUnavailable as exc:
        pytest.fail(f"DynamoDB Local did not start: {exc}", pytrace=False)
    try:
        yield server.endpoint
    finally:
        server.__exit__()


@pytest.fixture
def dynamodb_local(request: pytest.FixtureRequest, dynamodb_local_server: str) -> str:
    """The session's DynamoDB Local endpoint, for tests marked ``dynamodb`` only.

    A test that reaches DynamoDB Local without the marker would still run under
    ``-m "not dynamodb"`` (and fail where there is no Java): it fails here instead, naming
    itself, whether it asks for the fixture by name or with ``request.getfixturevalue``.
    """
    if request.node.get_closest_marker("dynamodb") is None:
        pytest.fail(
            f"{request.node.nodeid} uses DynamoDB Local but is not marked "
            "@pytest.mark.dynamodb (pytest.param(..., marks=pytest.mark.dynamodb) for a "
            "parameter)",
            pytrace=False,
        )
    return dynamodb_local_server


def new_table_name() -> str:
    """A table name no other test uses."""
    return f"meter_test_{uuid.uuid4().hex[:12]}"


async def create_table(endpoint: str) -> str:
    """Create a fresh table (with ``init_schema``) at ``endpoint``; return its name."""
    name = new_table_name()
    store = DynamoDBStorage(name, endpoint_url=endpoint)
    await store.open()
    try:
        await store.init_schema()
    finally:
        await store.close()
    return name


@pytest.fixture
async def dynamodb_table(dynamodb_local: str) -> str:
    """A fresh table (created with ``init_schema``) in the session's DynamoDB Local."""
    return await create_table(dynamodb_local)


@pytest.fixture
async def dynamodb_storage(
    dynamodb_local: str, dynamodb_table: str
) -> AsyncIterator[DynamoDBStorage]:
    """An opened :class:`DynamoDBStorage` on a fresh table."""
    store = DynamoDBStorage(dynamodb_table, endpoint_url=dynamodb_local)
    await store.open()
    try:
        yield store
    finally:
        await store.close()
