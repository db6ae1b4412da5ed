"""A throw-away ``redis-server`` for tests: loopback only, a free port, no persistence.

Never the machine's own Redis: each :class:`RedisServer` picks a free port on 127.0.0.1 and
can be stopped and started again on the same port (for outage tests).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.dynamodb_local import free_port


class RedisUnavailable(RuntimeError):
    """No ``redis-server`` binary here, or it would not start."""


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:<port>``; ``password`` turns on AUTH."""

    def __init__(self, *, password: str | None = None, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisUnavailable("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.password = password
        self.port = port or free_port()
        if self.port == 6379:  # never the machine's own Redis
            raise RedisUnavailable("refusing to use port 6379")
        self.dir = Path(tempfile.mkdtemp(prefix="meter-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:port/0``."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10) -> RedisServer:
        """Start and wait until it answers PING."""
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        if self.password:
            cmd += ["--requirepass", self.password]
        log = (self.dir / "redis.log").open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.proc.poll() is not None:
                raise RedisUnavailable(f"redis-server exited {self.proc.returncode}: {self._log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RedisUnavailable(f"redis-server did not answer: {self._log()}")
            time.sleep(0.02)
        return self

    def answers(self) -> bool:
        """Whether the server answers PING (an auth error counts as an answer)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                data = s.recv(64)
                return data.startswith((b"+PONG", b"-NOAUTH", b"-ERR"))
        except OSError:
            return False

    def stop(self) -> None:
        """Kill it (SIGKILL: an outage, not a shutdown) and wait."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def restart(self) -> None:
        """Start again on the same port."""
        self.stop()
        self.start()

    def _log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "redis.log").read_text(errors="replace")[-800:]
        return ""

    def close(self) -> None:
        """Stop and remove the work dir."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
