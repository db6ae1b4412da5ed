"""The bench's harness: what its scenario modules share, with public names.

- **Sizes and rows**: how long and how big a run is (:data:`FULL`, :data:`QUICK`,
  :data:`SMOKE`) and one line of the table (:class:`Row`).
- **Rounds and ratios**: :func:`in_turn` runs one round's sides, each side going first in
  turn; :func:`median`, :func:`ratios` (the median of the per-round ratios) and
  :func:`percentile`.
- **Servers**: everything a run starts, each on its own and stopped at the end
  (:class:`Services`). redis-server listens on a Unix socket in a temp dir (never a TCP port,
  never a running instance), without persistence unless an append-only file is asked for;
  nodes are ``python -m meter serve`` processes (:class:`tests.support.nodes.NodeProcess`); DynamoDB
  Local comes from :mod:`tests.support.dynamodb_local` (:func:`create_table` makes a table on it).
- **Node builds side by side**: :func:`builds` starts a node on the installed build, one
  forced to pure Python and, with ``--beside REV``, one of that commit's tree
  (:class:`TreeNode`, built by :mod:`bench.beside`); :func:`load_rounds` runs their loads and
  the reference's in the same rounds; :func:`node_status` reads a node's ``status``.
- :class:`NullTransport`: a transport for in-process measurements without a socket.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bench.beside import Tree, clean_env
from bench.loadgen import Load, LoadResult, run_load
from tests.support.dynamodb_local import DynamoDBLocal, ensure_installed
from tests.support.nodes import NodeProcess, raw_call, short_tmpdir, wait_for

ROOT = Path(__file__).resolve().parent.parent
Progress = Callable[[str], None]


@dataclass(frozen=True)
class ScaleSizes:
    """Scenario 8 (``scale``, :mod:`bench.scale`)."""

    ddb_keys: int  # cold keys per side per round, DynamoDB
    ddb_rounds: int
    sqlite_keys: int  # keys in the SQLite file, all met cold by a fresh node each round
    sqlite_rounds: int
    rollover_keys: int  # active keys per node, first of the month (3 nodes)
    rollover_sweep_s: float  # the load touches every key of a node once in this long
    rollover_setup_s: float  # seconds allowed to start the nodes and warm their keys
    rollover_before_s: float  # seconds of load before the month ends
    rollover_after_s: float  # and after
    rollover_window_s: float  # the window after the boundary whose latency is judged
    rollover_rounds: int  # runs per read-ahead mode (off / on)
    #: Parts 1 and 3: drain the nodes and check every stored total (else kill them).
    store_check: bool
    #: Part 4, convergence under load: active keys per node (judged), keys per node of the
    #: reported run, items/s per node, seconds probed, runs per size.
    conv_keys: int = 10_000
    conv_keys_report: int = 100_000
    conv_rate: float = 20_000.0
    conv_seconds: float = 20.0
    conv_rounds: int = 1


@dataclass(frozen=True)
class QuotaSizes:
    """Scenario 10 (``quotas``, :mod:`bench.quotas`)."""

    #: (connections, depth) of part 1 on 1 node and on 3 nodes (spread over them).
    one_node: tuple[tuple[int, int], ...]
    three_nodes: tuple[tuple[int, int], ...]
    burst_limit: int  # part 2's small strict limit
    burst_clients: int  # client threads per node of that burst
    overshoot_limit: int  # part 3's limit
    overshoot_clients: int  # client threads per node
    overshoot_ticks: tuple[int, ...]  # gossip ticks measured, ms
    strict_tick: int  # the tick of part 3's strict burst
    #: Part 4 (:mod:`bench.strict_latency`): rounds of the bursts near a strict limit (flat
    #: ``near_flat``, an account ``near_account`` with users at 60 %), clients per node.
    near_rounds: int = 3
    near_flat: int = 300
    near_account: int = 100
    near_clients: int = 4


@dataclass(frozen=True)
class FanoutSizes:
    """Scenario 14 (``fanout``, :mod:`bench.fanout`)."""

    peers: tuple[int, ...]  # simulated peers, one run each
    keys: int  # the pool of keys the node holds warm
    touched: int  # keys each peer touches a tick
    tick_ms: int
    seconds: float  # of load, per run
    #: 3 nodes on a Redis Cluster vs on one redis-server: convergence samples a round, rounds.
    cluster_samples: int = 100
    cluster_rounds: int = 2


@dataclass(frozen=True)
class Sizes:
    """How long and how big: ``full``, ``quick`` (about a minute) or ``smoke`` (seconds)."""

    name: str
    duration: float  # seconds per load step
    rounds: int  # A/B rounds per comparison
    rpc_configs: tuple[tuple[int, int], ...]  # (connections, depth)
    ddb_seconds: float
    ddb_rounds: int
    flush_sizes: tuple[int, ...]
    flush_rounds: int
    memory_keys: int
    conv_samples: int
    conv_ticks: tuple[int, ...]
    durable_configs: tuple[tuple[int, int], ...]  # (connections, depth) for ``durable``
    scale: ScaleSizes
    quotas: QuotaSizes
    fanout: FanoutSizes
    #: Keys a round for the flush CPU per key (batched vs single) and for the batched flush
    #: vs a bare TransactWriteItems loop and the track p99 during a round.
    flush_cpu_keys: int = 2_000
    flush_tx_keys: int = 10_000
    flush_p99_seconds: float = 4.0


FULL = Sizes(
    "full",
    2.0,
    5,
    ((1, 1), (4, 1), (16, 1), (4, 16), (4, 128)),
    4.0,
    3,
    (1_000, 10_000, 100_000),
    3,
    1_000_000,
    200,
    (50, 100),
    ((1, 1), (4, 1), (16, 1), (4, 16)),
    ScaleSizes(
        10_000, 5, 100_000, 3, 10_000, 2.0, 30.0, 25.0, 10.0, 5.0, 1, True, conv_seconds=30.0
    ),
    QuotaSizes(((4, 1), (4, 16)), ((6, 1), (6, 16)), 10_000, 4, 20_000, 2, (25, 100, 1000), 100, 5),
    FanoutSizes((10, 30, 100), 10_000, 100, 100, 10.0, cluster_samples=200, cluster_rounds=3),
)
QUICK = Sizes(
    "quick",
    0.8,
    3,
    ((1, 1), (4, 1), (16, 1), (4, 16), (4, 128)),
    1.5,
    2,
    (1_000,),
    2,
    100_000,
    30,
    (100,),
    ((1, 1), (4, 1), (16, 1), (4, 16)),
    ScaleSizes(5_000, 3, 20_000, 3, 3_000, 2.0, 25.0, 12.0, 7.0, 5.0, 1, False, conv_seconds=10.0),
    QuotaSizes(((4, 1), (4, 16)), ((6, 1),), 10_000, 4, 5_000, 2, (25, 1000), 100),
    FanoutSizes((10, 30, 100), 10_000, 100, 100, 5.0),
)
SMOKE = Sizes(
    "smoke",
    0.15,
    1,
    ((1, 1), (2, 16)),
    0.3,
    1,
    (50,),
    1,
    2_000,
    5,
    (100,),
    ((2, 4),),
    ScaleSizes(400, 1, 1_000, 1, 200, 1.0, 6.0, 4.0, 2.0, 2.0, 1, True, 200, 400, 2_000.0, 2.0),
    QuotaSizes(((2, 1),), ((3, 1),), 1_000, 2, 1_000, 2, (100,), 100, 1),
    FanoutSizes((3,), 200, 20, 100, 1.0, cluster_samples=10, cluster_rounds=1),
    flush_cpu_keys=100,
    flush_tx_keys=200,
    flush_p99_seconds=0.5,
)


@dataclass
class Row:
    """One line of the table."""

    scenario: str
    metric: str
    unit: str
    ours: float | None
    reference: float | None
    ratio: float | None
    target: str
    met: bool | None
    detail: dict[str, Any] = field(default_factory=dict)
    #: ``measured`` (the reference side, measured in the same run) or ``target`` (a fixed
    #: number: the target itself; the ratio is then ours against the target).
    reference_kind: str = "measured"
    #: The same figure on a node running pure Python (``METER_PURE_PYTHON=1``), measured in
    #: the same rounds, and its ratio to the reference; ``ours`` is then the compiled node.
    pure: float | None = None
    pure_ratio: float | None = None
    #: With ``--beside REV``: the same figure on that commit's node, measured in the same
    #: rounds, its ratio to the reference, and ours against it (the median of the per-round
    #: ratios ours / beside).
    beside: float | None = None
    beside_ratio: float | None = None
    vs_beside: float | None = None

    def sides(self, got: dict[str, list[float]], ref: str = "redis") -> Row:
        """Fill the pure (and beside) columns from each side's per-round figures, keyed
        ``ours``, ``pure``, ``beside`` (when run) and ``ref``; returns the row."""
        self.pure, self.pure_ratio = median(got["pure"]), ratios(got["pure"], got[ref])
        if "beside" in got:
            self.beside = median(got["beside"])
            self.beside_ratio = ratios(got["beside"], got[ref])
            self.vs_beside = ratios(got["ours"], got["beside"])
        return self

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def fresh_process(module: str, *args: str) -> dict[str, Any]:
    """Run ``python -m module args`` (a measure that needs a process of its own, as memory
    does) and return the JSON map it prints."""
    run = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    got: dict[str, Any] = json.loads(run.stdout)
    return got


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (0.0 if unknown or gone)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def ratios(a: list[float], b: list[float]) -> float:
    return median([x / y for x, y in zip(a, b, strict=True) if y])


def in_turn(r: int, *sides: Callable[[], Any]) -> list[Any]:
    """Run round ``r``'s sides, starting with side ``r`` modulo their number: A B, B A, ...
    (A B C, B C A, C A B, ... for three). Returns their results in the sides' order."""
    k = r % len(sides)
    got: dict[int, Any] = {}
    for i in [*range(k, len(sides)), *range(k)]:
        got[i] = sides[i]()
    return [got[i] for i in range(len(sides))]


#: The order of the sides, as recorded in the rows' ``detail``.
ALTERNATING = "alternating: ours first in rounds 1, 3, ..., the reference first in 2, 4, ..."
#: What scenarios 1 and 2 run the node on (see ``Services.node``).
NODE_MEMORY = {"node_storage": "memory", "node_durability": "off"}


def percentile(values: list[int] | list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, nearest rank (0.0 if empty)."""
    if not values:
        return 0.0
    s = sorted(values)
    return float(s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))])


#: redis-server's ``appendfsync`` policies.
APPENDFSYNC = ("always", "everysec", "no")


class RedisServer:
    """A private redis-server on ``<dir>/redis.sock``, no TCP.

    No persistence by default. With ``appendfsync`` (``always``, ``everysec`` or ``no``) it
    runs with ``appendonly yes`` and that policy, its append-only file in ``workdir`` (keep
    that on a real disk, not tmpfs, for the fsyncs to be real); still no RDB snapshots.
    """

    def __init__(self, workdir: Path, *, appendfsync: str | None = None) -> None:
        if appendfsync is not None and appendfsync not in APPENDFSYNC:
            raise ValueError(f"appendfsync must be one of {APPENDFSYNC}, got {appendfsync!r}")
        self.workdir = workdir
        self.socket = workdir / "redis.sock"
        self.appendfsync = appendfsync
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed")
        cmd = [
            exe,
            "--port",
            "0",
            "--unixsocket",
            str(self.socket),
            "--unixsocketperm",
            "700",
            "--save",
            "",
            *(
                ("--appendonly", "no")
                if self.appendfsync is None
                else ("--appendonly", "yes", "--appendfsync", self.appendfsync)
            ),
            "--dir",
            str(self.workdir),
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited {self.proc.returncode}")
            with contextlib.suppress(OSError):
                if self.command(b"PING") == b"+PONG\r\n":
                    return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer")

    def command(self, *args: bytes) -> bytes:
        """One RESP command over a fresh connection; the raw answer (first read)."""
        frame = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.socket))
            s.sendall(frame)
            return s.recv(65536)

    def info(self, section: str) -> dict[str, str]:
        """``INFO <section>`` as a dict (``persistence``: ``aof_enabled``...)."""
        raw = self.command(b"INFO", section.encode()).decode(errors="replace")
        out: dict[str, str] = {}
        for line in raw.splitlines()[1:]:
            key, sep, value = line.partition(":")
            if sep:
                out[key] = value
        return out

    def config_get(self, name: str) -> str:
        """One ``CONFIG GET`` value (``appendfsync``...)."""
        raw = self.command(b"CONFIG", b"GET", name.encode()).decode(errors="replace")
        lines = raw.split("\r\n")
        # *2 / $n / name / $m / value
        return lines[4] if len(lines) > 4 else ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


#: Every node's settings unless told otherwise.
NODE_DEFAULTS = {"METER_STORAGE": "memory", "METER_LOG_LEVEL": "WARNING"}


class Services:
    """Everything started for one run; :meth:`close` stops it all (also on errors)."""

    def __init__(self, beside: Tree | None = None) -> None:
        self.workdir = short_tmpdir("mbench-")
        #: ``--beside``: the other commit's tree, whose nodes :func:`builds` adds.
        self.beside = beside
        self._redis: RedisServer | None = None
        self._aof: list[RedisServer] = []
        self._nodes: list[NodeProcess] = []
        self._ddb: DynamoDBLocal | None = None

    def redis(self) -> RedisServer:
        if self._redis is None:
            self._redis = RedisServer(self.workdir).start()
        return self._redis

    def redis_aof(self, appendfsync: str) -> RedisServer:
        """A further private redis-server, ``appendonly yes`` with this ``appendfsync``.

        Each has its own dir (its socket and append-only file) under the run's temp dir,
        which is on /tmp, not tmpfs here. Stop it with :meth:`stop_redis` or at :meth:`close`.
        """
        workdir = self.workdir / f"redis-{appendfsync}-{len(self._aof)}"
        workdir.mkdir()
        server = RedisServer(workdir, appendfsync=appendfsync)
        self._aof.append(server)
        return server.start()

    def stop_redis(self, server: RedisServer) -> None:
        server.stop()
        with contextlib.suppress(ValueError):
            self._aof.remove(server)

    def node(self, name: str, *, clock_shift: float | None = None, **env: str) -> NodeProcess:
        """Start a node (``METER_*`` settings in ``env``; memory storage unless told).

        ``clock_shift``: seconds its wall clock is moved by (:mod:`bench.clockshift`).
        """
        node = NodeProcess(self.workdir, name, **{**NODE_DEFAULTS, **env})
        node.clock_shift = clock_shift
        self._nodes.append(node)
        return node.start()

    def tree_node(self, name: str, tree: Tree, **env: str) -> NodeProcess:
        """Start a node of ``tree`` (:class:`TreeNode`) with the settings :meth:`node` gives."""
        node = TreeNode(self.workdir, name, tree, **{**NODE_DEFAULTS, **env})
        self._nodes.append(node)
        return node.start()

    def stop_node(self, node: NodeProcess, timeout: float = 60.0) -> int:
        """Stop ``node`` (SIGTERM: it drains); SIGKILL after ``timeout`` seconds."""
        code = node.stop(timeout=timeout)
        with contextlib.suppress(ValueError):
            self._nodes.remove(node)
        return code

    def dynamodb(self) -> str:
        """The endpoint of a DynamoDB Local (in memory) started for this run."""
        if self._ddb is None:
            ddb = DynamoDBLocal(ensure_installed())
            ddb.start()
            self._ddb = ddb
        return self._ddb.endpoint

    def close(self) -> None:
        for node in list(self._nodes):
            with contextlib.suppress(Exception):
                node.stop()
        self._nodes.clear()
        if self._redis is not None:
            self._redis.stop()
        for server in self._aof:
            server.stop()
        self._aof.clear()
        if self._ddb is not None:
            self._ddb.__exit__()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- nodes side by side ---------------------------------------------------------------------


def node_status(node: Any) -> dict[str, Any]:
    status: dict[str, Any] = node.call("status")
    return status


class TreeNode(NodeProcess):
    """A node of another tree (``--beside``): ``<venv>/bin/python -m meter serve`` with the
    settings and environment :class:`NodeProcess` gives, less ``PYTHONPATH`` (which would
    import this tree's ``meter``). No clock shift."""

    def __init__(self, workdir: Path, name: str, tree: Tree, **env: str) -> None:
        super().__init__(workdir, name, **env)
        self.tree = tree

    def start(self, timeout: float = 20.0) -> TreeNode:
        if self.clock_shift is not None:
            raise ValueError("a node of another tree runs with the real clock")
        env = clean_env()
        env.update(self.env)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [str(self.tree.python), "-m", "meter", "serve"],
                env=env,
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for(self.answers, timeout, f"node {self.name} ({self.tree.label}) to answer")
        except (AssertionError, RuntimeError) as exc:
            self.kill()
            raise RuntimeError(f"{exc}:\n{self.log()}") from exc
        return self

    def answers(self) -> bool:
        """Whether it answers ``ping`` (raises once the process has exited)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"node {self.name} exited {self.proc.returncode}")
        try:
            return bool(raw_call(self.socket, "ping", timeout=1) == (None, "pong"))
        except OSError:
            return False


@dataclass
class Builds:
    """The nodes one scenario measures side by side, all with the same settings, by side:
    ``ours`` (the installed build), ``pure`` (forced to pure Python) and, with ``--beside``,
    ``beside`` (that commit's node); and whether ours and the beside one run compiled."""

    nodes: dict[str, NodeProcess]
    compiled: bool
    beside: Tree | None = None
    beside_compiled: bool = True

    def label(self, label: str) -> str:
        """``label``, saying which node is not compiled, if one is not."""
        if not self.compiled:
            label += " (node NOT compiled)"
        if self.beside is not None and not self.beside_compiled:
            label += f" ({self.beside.label} node NOT compiled)"
        return label

    def rounds(self, rounds: int) -> int:
        """Rounds for these sides and the reference in rotation: a multiple of their number,
        so each goes first as often."""
        sides = len(self.nodes) + 1
        return -(-rounds // sides) * sides

    def order(self) -> str:
        """The order of the sides, as recorded in the rows' ``detail``."""
        names = ["compiled", "pure", *([self.beside.label] if self.beside else []), "reference"]
        return f"rotating: {', '.join(names)}; then {', '.join([*names[1:], names[0]])}; ..."

    def stop(self, svc: Services) -> None:
        for node in self.nodes.values():
            svc.stop_node(node)


def builds(svc: Services, name: str, **env: str) -> Builds:
    """Start the nodes of :class:`Builds` with these settings (``--beside``: ``svc.beside``)."""
    nodes = {
        "ours": svc.node(name, clock_shift=None, **env),
        "pure": svc.node(f"{name}-pure", clock_shift=None, **{**env, "METER_PURE_PYTHON": "1"}),
    }
    if svc.beside is not None:
        nodes["beside"] = svc.tree_node(f"{name}-beside", svc.beside, **env)

    def compiled(who: str) -> bool:
        return bool((node_status(nodes[who]).get("build") or {}).get("compiled"))

    assert not compiled("pure"), "pure node compiled"
    beside = compiled("beside") if svc.beside is not None else True
    return Builds(nodes, compiled("ours"), svc.beside, beside)


def load_rounds(
    rounds: int, loads: dict[str, Load], progress: Progress, what: str
) -> dict[str, list[LoadResult]]:
    """Each side's results, ``rounds`` rounds of ``loads`` (by side) taking turns going
    first (:func:`in_turn`); ``what`` names the step in the progress lines."""
    got: dict[str, list[LoadResult]] = {who: [] for who in loads}
    for r in range(rounds):
        progress(f"{what}, round {r + 1}/{rounds}")
        results = in_turn(r, *(partial(run_load, load) for load in loads.values()))
        for who, res in zip(loads, results, strict=True):
            got[who].append(res)
    return got


def latencies(got: dict[str, list[LoadResult]]) -> dict[str, float]:
    """``<side>_p50_us`` and ``<side>_p99_us``: each side's median over its rounds."""
    return {
        f"{who}_p{q}_us": median([x.percentile_us(q) for x in results])
        for who, results in got.items()
        for q in (50, 99)
    }


async def create_table(endpoint: str, name: str) -> None:
    from storage.dynamodb import DynamoDBStorage

    store = DynamoDBStorage(name, endpoint_url=endpoint)
    await store.open()
    try:
        await store.init_schema()
    finally:
        await store.close()


class NullTransport:
    """Just enough of a transport for ``data_received``: writes are counted and dropped."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def is_closing(self) -> bool:
        return False

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass
