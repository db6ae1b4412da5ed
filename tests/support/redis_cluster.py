"""A throw-away Redis Cluster for tests: 3 masters with 1 replica each, loopback only.

Six ``redis-server`` processes with ``--cluster-enabled yes`` on free ports of 127.0.0.1 (the
cluster bus on a free port of its own, ``--cluster-port``), no persistence, a node timeout of
1 s so that a killed master's replica is promoted within a few seconds; joined into one cluster
by ``redis-cli --cluster create``. Never the machine's own Redis on port 6379.
:meth:`RedisCluster.kill_master` is the outage: SIGKILL one master, wait for its replica.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.dynamodb_local import free_port
from tests.support.redis_server import RedisUnavailable

SLOTS = 16384
MASTERS = 3
REPLICAS = 1
#: ``cluster-node-timeout`` (ms): how long a silent master takes to be marked failed.
NODE_TIMEOUT_MS = 1000

T = TypeVar("T")


@dataclass(frozen=True)
class NodeInfo:
    """One line of ``CLUSTER NODES``."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    slots: tuple[tuple[int, int], ...]  # inclusive ranges

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def failed(self) -> bool:
        """Marked failed by the cluster (not merely suspected, ``fail?``)."""
        return bool(self.flags & {"fail", "noaddr", "handshake"})

    def owns(self, slot: int) -> bool:
        return any(lo <= slot <= hi for lo, hi in self.slots)


def parse_nodes(text: str) -> list[NodeInfo]:
    """Parse the answer to ``CLUSTER NODES`` (slots being migrated, ``[...]``, are skipped)."""
    nodes = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        address = fields[1].split("@")[0]  # ip:port@cport[,hostname]
        slots = []
        for spec in fields[8:]:
            if spec.startswith("["):
                continue
            lo, _, hi = spec.partition("-")
            slots.append((int(lo), int(hi or lo)))
        nodes.append(
            NodeInfo(
                node_id=fields[0],
                port=int(address.rsplit(":", 1)[1]),
                flags=frozenset(fields[2].split(",")),
                master_id=None if fields[3] == "-" else fields[3],
                slots=tuple(slots),
            )
        )
    return nodes


class RedisCluster:
    """A Redis Cluster of :data:`MASTERS` masters with :data:`REPLICAS` replica each, its
    nodes' config files and logs under ``workdir/node-<port>/``.

    :meth:`start` waits until every node says ``cluster_state:ok`` with all slots assigned
    and every replica is in sync; :meth:`stop` kills every process (idempotent).
    """

    def __init__(self, workdir: Path) -> None:
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            raise RedisUnavailable("redis-server or redis-cli is not installed (apt install redis)")
        self.binary, self.cli = binary, cli
        self.workdir = workdir
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        #: Seconds :meth:`start` took (process start, ``--cluster create``, convergence).
        self.start_seconds = 0.0

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> RedisCluster:
        """Start the nodes, create the cluster and wait until it is ready."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        ports = self._free_ports(2 * MASTERS * (1 + REPLICAS))
        self.ports = ports[::2]
        try:
            for port, bus in zip(ports[::2], ports[1::2], strict=True):
                self._spawn(port, bus)
            self._wait(deadline, "every node answers", lambda: all(map(self._answers, self.ports)))
            addresses = [f"127.0.0.1:{p}" for p in self.ports]
            replicas = ["--cluster-replicas", str(REPLICAS), "--cluster-yes"]
            created = subprocess.run(
                [self.cli, "--cluster", "create", *addresses, *replicas],
                capture_output=True,
                text=True,
                timeout=max(1.0, deadline - time.monotonic()),
                check=False,
            )
            if created.returncode != 0:
                out = (created.stdout + created.stderr)[-1500:]
                raise RedisUnavailable(f"redis-cli --cluster create failed: {out}")
            self._wait(deadline, "the cluster is ready", lambda: self._ready(self.ports))
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Kill every node (SIGKILL) and wait for it; idempotent."""
        procs, self.procs = self.procs, {}
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what the cluster says -------------------------------------------------------------

    @property
    def nodes_arg(self) -> str:
        """``127.0.0.1:p1,127.0.0.1:p2,...``: the current masters (a client's startup nodes)."""
        return ",".join(f"127.0.0.1:{p}" for p in self.masters())

    def alive(self) -> list[int]:
        """The ports of the nodes whose process is running."""
        return [p for p in self.ports if p in self.procs and self.procs[p].poll() is None]

    def nodes(self) -> list[NodeInfo]:
        """``CLUSTER NODES`` as the first live node that answers sees it."""
        for port in self.alive():
            with contextlib.suppress(redis.RedisError):
                return parse_nodes(self._command(port, "CLUSTER", "NODES"))
        raise RedisUnavailable("no node of the cluster answers")

    def masters(self) -> list[int]:
        """The ports of the masters that own slots and are not marked failed, by first slot."""
        masters = [n for n in self.nodes() if n.is_master and n.slots and not n.failed]
        return [n.port for n in sorted(masters, key=lambda n: n.slots[0][0])]

    def master_of_slot(self, slot: int) -> int:
        """The port of the master that owns ``slot``."""
        for n in self.nodes():
            if n.is_master and n.owns(slot):
                return n.port
        raise LookupError(f"no master owns slot {slot}")

    def replicas_of(self, port: int) -> list[int]:
        """The ports of the replicas of the master on ``port``."""
        nodes = self.nodes()
        master_id = next(n.node_id for n in nodes if n.port == port)
        return [n.port for n in nodes if n.master_id == master_id and not n.failed]

    # -- faults ----------------------------------------------------------------------------

    def kill_master(self, port: int, timeout: float = 30) -> int:
        """SIGKILL the master on ``port``, wait until its replica is promoted and the
        surviving nodes say ``cluster_state:ok`` again; the promoted replica's port."""
        nodes = self.nodes()
        master = next((n for n in nodes if n.port == port), None)
        if master is None or not master.is_master or port not in self.alive():
            raise ValueError(f"127.0.0.1:{port} is not a live master")
        replicas = [n.port for n in nodes if n.master_id == master.node_id and not n.failed]
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(10)
        survivors = self.alive()

        def promoted() -> int | None:
            for p in replicas:
                me = self._myself(p)
                if me.is_master and me.slots and self._ready(survivors, synced=False):
                    return p
            return None

        return self._wait(time.monotonic() + timeout, f"a replica of {port} takes over", promoted)

    # -- internals -------------------------------------------------------------------------

    @staticmethod
    def _free_ports(n: int) -> list[int]:
        ports: list[int] = []
        while len(ports) < n:
            port = free_port()
            if port not in ports and port != 6379:
                ports.append(port)
        return ports

    def _spawn(self, port: int, bus: int) -> None:
        node_dir = self.workdir / f"node-{port}"
        node_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.binary,
            *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(node_dir)),
            *("--cluster-enabled", "yes", "--cluster-port", str(bus)),
            *("--cluster-config-file", str(node_dir / "nodes.conf")),
            *("--cluster-node-timeout", str(NODE_TIMEOUT_MS)),
            # A replica may take over however long it was cut off from its master.
            *("--cluster-replica-validity-factor", "0"),
            *("--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "notice"),
        ]
        with (node_dir / "redis.log").open("ab") as log:
            self.procs[port] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    @staticmethod
    def _client(port: int) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1,
            decode_responses=True, retry=Retry(NoBackoff(), 0),
        )  # fmt: skip

    def _command(self, port: int, *args: str) -> str:
        """The text of the answer (a command sent as separate words gets no parsing)."""
        with self._client(port) as client:
            return str(client.execute_command(*args))

    def _myself(self, port: int) -> NodeInfo:
        """The node on ``port`` as it sees itself."""
        return next(
            n for n in parse_nodes(self._command(port, "CLUSTER", "NODES")) if "myself" in n.flags
        )

    def _answers(self, port: int) -> bool:
        try:
            with self._client(port) as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    def _info(self, port: int, *args: str) -> dict[str, str]:
        """``CLUSTER INFO`` or ``INFO <section>`` as a dict."""
        text = self._command(port, *args)
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def _ready(self, ports: list[int], *, synced: bool = True) -> bool:
        """Every node on ``ports`` says ``cluster_state:ok`` with all slots assigned; with
        ``synced``, also knows every node, each replica's link to its master is up and each
        master has a replica."""
        try:
            for port in ports:
                info = self._info(port, "CLUSTER", "INFO")
                if (info.get("cluster_state"), info.get("cluster_slots_assigned")) != (
                    "ok",
                    str(SLOTS),
                ):
                    return False
                if synced and info.get("cluster_known_nodes") != str(len(self.ports)):
                    return False
                repl = self._info(port, "INFO", "replication") if synced else {}
                if repl.get("master_link_status", "up") != "up":  # only a replica has one
                    return False
            if not synced:
                return True
            nodes = self.nodes()
            masters = {n.node_id for n in nodes if n.is_master and n.slots}
            with_replica = {n.master_id for n in nodes if n.master_id in masters}
            return len(masters) == MASTERS and with_replica == masters
        except redis.RedisError:
            return False

    def _wait(self, deadline: float, what: str, cond: Callable[[], T | None]) -> T:
        while True:
            with contextlib.suppress(redis.RedisError):
                got = cond()
                if got:
                    return got
            dead = [p for p in self.ports if p in self.procs and self.procs[p].poll() is not None]
            if dead:
                raise RedisUnavailable(f"redis-server on {dead} exited: {self._log(dead[0])}")
            if time.monotonic() > deadline:
                raise RedisUnavailable(f"timed out waiting until {what}")
            time.sleep(0.02)

    def _log(self, port: int) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / f"node-{port}" / "redis.log").read_text(errors="replace")[-800:]
        return ""
