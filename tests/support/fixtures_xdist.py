"""How the suite shares the machine between pytest-xdist workers (loaded as a plugin from
``tests/conftest.py``; ``pyproject.toml`` runs ``-n 4 --dist loadgroup``).

- A test marked ``quiet`` measures latency against a bound that holds on a loaded 2-core
  machine but not on one running three more workers: it runs alone. Every other test holds a
  shared lock while it runs (setup to teardown); a quiet test takes it exclusively, so it
  starts once the tests running elsewhere have ended, and no other test starts until it is
  done. Quiet tests are one ``xdist_group`` ("quiet"), so they run one after the other on
  one worker, and that worker keeps the lock from the first to the last of them: the others
  wait once, not once per quiet test. A turnstile in front of the shared lock keeps a stream
  of other tests from starving the quiet ones.
- A test that uses ``module_fleet`` runs in its module's ``xdist_group``: the module's tests
  share one fleet only if they run on one worker.
- The tests start longest first (``LONGEST_FIRST``, measured), so the last worker to finish
  is not the one that picked up a minute-long test at the end; the quiet ones come last,
  when what still runs elsewhere (and must end before they start) is short.

Without xdist (``-p no:xdist``, ``-n 0``) there is nothing to share: the locks are not taken.
The lock files are in the run's base temp dir, which the workers of one run share and no
other run uses.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO

import pytest

#: Test files and tests (node id prefixes) that take longest, longest first: started first.
#: Measured with ``--durations`` on 4 workers (the wheel build: 4 min there, 1 alone); a test
#: not listed keeps its place after these.
LONGEST_FIRST = (
    "tests/test_build.py::test_pip_install_of_a_wheel_runs_compiled",
    "tests/test_wal_crash.py",
    "tests/test_bench_smoke.py::test_smoke_scale_counts_exactly",
    "tests/test_export_dynamodb.py",
    "tests/test_bench_smoke.py::test_smoke_quotas_admits_exactly",
    "tests/test_escrow_properties.py",
    "tests/test_rollover.py::test_a_month_rolls_over_under_load_on_two_nodes",
    "tests/test_build.py::test_pure_subset",
    "tests/test_bench_smoke.py::test_smoke_run_writes_table_and_json",
    "tests/test_sqlite_storage.py::test_the_batched_write_equals_the_one_key_at_a_time_write",
    "tests/test_strict_cluster.py",
    "tests/test_table_properties.py",
    "tests/test_node_dynamodb.py",
    "tests/test_warm_up.py",
    "tests/test_seeding.py",
    "tests/test_dynamodb_faults.py",
    "tests/test_cluster_nodes.py",
)


def _quiet(item: pytest.Item) -> bool:
    return item.get_closest_marker("quiet") is not None


def _rank(item: pytest.Item) -> int:
    if _quiet(item):
        return len(LONGEST_FIRST) + 1  # last: the tests still running then are short ones
    for i, prefix in enumerate(LONGEST_FIRST):
        if item.nodeid.startswith(prefix):
            return i
    return len(LONGEST_FIRST)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _quiet(item):
            item.add_marker(pytest.mark.xdist_group("quiet"))
        elif "module_fleet" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(f"fleet:{item.nodeid.split('::')[0]}"))
    items.sort(key=_rank)  # stable: the order within a rank stays the collection order


class _Gate:
    """The worker's side of the locks: ``turnstile`` and ``room`` (``flock``)."""

    def __init__(self, directory: Path) -> None:
        self.turnstile = (directory / "quiet-turnstile.lock").open("a")
        self.room = (directory / "quiet-room.lock").open("a")
        self.exclusive = False

    @staticmethod
    def _lock(f: IO[str], how: int) -> None:
        fcntl.flock(f.fileno(), how)

    def enter(self, quiet: bool) -> None:
        if quiet:
            if not self.exclusive:
                self._lock(self.turnstile, fcntl.LOCK_EX)  # no other test starts from now
                self._lock(self.room, fcntl.LOCK_EX)  # once those running have ended
                self.exclusive = True
        else:
            self._lock(self.turnstile, fcntl.LOCK_EX)  # not while a quiet test waits or runs
            self._lock(self.turnstile, fcntl.LOCK_UN)
            self._lock(self.room, fcntl.LOCK_SH)

    def leave(self, quiet: bool, next_quiet: bool) -> None:
        if not quiet:
            self._lock(self.room, fcntl.LOCK_UN)
        elif not next_quiet:
            self._lock(self.room, fcntl.LOCK_UN)
            self._lock(self.turnstile, fcntl.LOCK_UN)
            self.exclusive = False


_gate_key = pytest.StashKey[_Gate]()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        return  # not a worker of a parallel run (a pytest a worker started inherits its env)
    # xdist gives each worker <the run's base temp>/popen-gwN as its own base temp.
    config.stash[_gate_key] = _Gate(Path(config.option.basetemp).parent)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    gate = item.config.stash.get(_gate_key, None)
    if gate is not None:
        gate.enter(_quiet(item))


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    yield  # the fixtures are torn down first
    gate = item.config.stash.get(_gate_key, None)
    if gate is not None:
        gate.leave(_quiet(item), nextitem is not None and _quiet(nextitem))
