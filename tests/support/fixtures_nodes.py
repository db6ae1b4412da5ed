"""Fixtures of tests that start node processes: a short temp dir (socket paths are limited),
and a list of nodes killed at the end whatever the test did."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.nodes import NodeProcess, short_tmpdir


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
