"""Real node processes for tests: start ``python -m meter serve``, wait until it answers, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import msgpack

ROOT = Path(__file__).resolve().parents[2]
#: ``period_grace_s`` for tests that count in fixed past periods (a backfill): ten years.
BACKFILL_GRACE_S = 3650 * 86400
#: The same as a node's environment.
BACKFILL = {"METER_PERIOD_GRACE_S": str(BACKFILL_GRACE_S)}


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``cond`` until it returns something true (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def short_tmpdir(prefix: str = "meter-") -> Path:
    """A temp dir with a short path (AF_UNIX socket paths must stay under 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def raw_call(sock_path: str | Path, method: str, *params: Any, timeout: float = 5) -> Any:
    """One request with nothing but ``socket`` and ``msgpack``: ``(error, result)``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock_path))
        s.sendall(msgpack.packb([0, 1, method, list(params)]))
        unpacker = msgpack.Unpacker(raw=False)
        while True:
            data = s.recv(65536)
            if not data:
                raise ConnectionError("node closed the connection")
            unpacker.feed(data)
            for msg in unpacker:
                assert msg[0] == 1 and msg[1] == 1
                return msg[2], msg[3]


class NodeProcess:
    """A ``meter serve`` child process with its own data dir and socket."""

    def __init__(self, workdir: Path, name: str = "node", **env: str) -> None:
        self.workdir = workdir
        self.name = name
        #: Seconds the node's wall clock is moved by (``bench.clockshift``), if any: set it
        #: before :meth:`start`.
        self.clock_shift: float | None = None
        self.socket = workdir / f"{name}.sock"
        self.data_dir = workdir / f"{name}-data"
        self.log_path = workdir / f"{name}.log"
        self.env = {
            "METER_SOCKET": str(self.socket),
            "METER_DATA_DIR": str(self.data_dir),
            "METER_LOG_LEVEL": "INFO",
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout: float = 20.0) -> NodeProcess:
        """Start the process and wait until it answers ``ping``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("METER_")}
        env.update(self.env)
        env["PYTHONPATH"] = str(ROOT)
        self._log = self.log_path.open("ab")
        command = [sys.executable, "-m", "meter", "serve"]
        if self.clock_shift is not None:
            command[2:3] = ["bench.clockshift", repr(self.clock_shift)]
        self.proc = subprocess.Popen(
            command,
            env=env,
            cwd=self.workdir,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node {self.name} exited {self.proc.returncode}:\n{self.log()}")
            try:
                if raw_call(self.socket, "ping", timeout=1) == (None, "pong"):
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"node {self.name} did not answer within {timeout}s:\n{self.log()}")

    def call(self, method: str, *params: Any) -> Any:
        """A raw call; raises AssertionError carrying the error map on an error answer."""
        error, result = raw_call(self.socket, method, *params)
        if error is not None:
            raise AssertionError(f"{method} failed: {error}")
        return result

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig`` and wait for the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def kill(self) -> int:
        """SIGKILL: no drain."""
        return self.stop(signal.SIGKILL)

    def log(self) -> str:
        """Everything the process printed so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> NodeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
