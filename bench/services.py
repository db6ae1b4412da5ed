"""The servers a bench run needs, each started on its own and stopped at the end.

redis-server listens on a Unix socket in a temp dir (never a TCP port, never a running
instance); nodes are ``python -m meter serve`` processes (:class:`tests.nodes.NodeProcess`);
DynamoDB Local comes from :mod:`tests.dynamodb_local`.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.dynamodb_local import DynamoDBLocal, ensure_installed
from tests.nodes import NodeProcess, short_tmpdir


class RedisServer:
    """A private redis-server on ``<dir>/redis.sock``, no TCP, no persistence."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.socket = workdir / "redis.sock"
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
            "--appendonly",
            "no",
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
        self._nodes: list[NodeProcess] = []
        self._ddb: DynamoDBLocal | None = None

    def redis(self) -> RedisServer:
        if self._redis is None:
            self._redis = RedisServer(self.workdir).start()
        return self._redis

    def node(self, name: str, **env: str) -> NodeProcess:
        """Start a node (``METER_*`` settings in ``env``; memory storage unless told)."""
        settings = {"METER_STORAGE": "memory", "METER_LOG_LEVEL": "WARNING", **env}
        node = NodeProcess(self.workdir, name, **settings)
        self._nodes.append(node)
        return node.start()

    def stop_node(self, node: NodeProcess) -> int:
        code = node.stop()
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
        if self._ddb is not None:
            self._ddb.__exit__()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
