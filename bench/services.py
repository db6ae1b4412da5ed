"""The servers a bench run needs, each started on its own and stopped at the end.

redis-server listens on a Unix socket in a temp dir (never a TCP port, never a running
instance), without persistence unless an append-only file is asked for; nodes are
``python -m meter serve`` processes (:class:`tests.support.nodes.NodeProcess`); DynamoDB Local comes
from :mod:`tests.support.dynamodb_local`.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.support.dynamodb_local import DynamoDBLocal, ensure_installed
from tests.support.nodes import NodeProcess, short_tmpdir

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


class Services:
    """Everything started for one run; :meth:`close` stops it all (also on errors)."""

    def __init__(self) -> None:
        self.workdir = short_tmpdir("mbench-")
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
        settings = {"METER_STORAGE": "memory", "METER_LOG_LEVEL": "WARNING", **env}
        node = NodeProcess(self.workdir, name, **settings)
        node.clock_shift = clock_shift
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
