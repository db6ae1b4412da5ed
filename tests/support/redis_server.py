"""A throw-away ``redis-server`` for tests: loopback only, a free port, no persistence.

Never the machine's own Redis: each :class:`RedisServer` picks a free port on 127.0.0.1 and
can be stopped and started again on the same port (for outage tests). With ``tls=True`` it
speaks only TLS on that port, with a throw-away CA and server certificate that
:func:`make_tls_files` generates (``openssl`` command line) into the server's work dir.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from tests.support.dynamodb_local import free_port


class RedisUnavailable(RuntimeError):
    """No ``redis-server`` binary here, or it would not start."""


@dataclass(frozen=True)
class TLSFiles:
    """PEM files: a CA certificate, and a server certificate (signed by it) with its key."""

    ca_cert: Path
    cert: Path
    key: Path


# req needs a [req] section with a distinguished_name (even with -subj) and reads the
# extensions of -x509 from its -config.
_REQ_CNF = """\
[req]
distinguished_name = dn
[dn]
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
"""

_SERVER_EXT = """\
[v3_server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
"""


def make_tls_files(directory: Path) -> TLSFiles:
    """A new throw-away CA and a server certificate for ``127.0.0.1``/``localhost``.

    EC P-256 keys, valid for two days, written to ``directory`` with the ``openssl`` command
    line. Each call makes a different CA, so one call's CA does not trust another's server.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RedisUnavailable("the openssl command line is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    files = TLSFiles(directory / "ca.crt", directory / "server.crt", directory / "server.key")
    ca_key, csr = directory / "ca.key", directory / "server.csr"
    req_cnf, server_ext = directory / "req.cnf", directory / "server.cnf"
    req_cnf.write_text(_REQ_CNF)
    server_ext.write_text(_SERVER_EXT)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca_cnf = ["-config", str(req_cnf), "-extensions", "v3_ca", "-days", "2"]
    srv_cnf = ["-extfile", str(server_ext), "-extensions", "v3_server", "-days", "2"]
    ca = ["-keyout", str(ca_key), "-out", str(files.ca_cert), "-subj", "/CN=meter test CA"]
    server = ["-keyout", str(files.key), "-out", str(csr), "-subj", "/CN=127.0.0.1"]
    sign = ["-in", str(csr), "-CA", str(files.ca_cert), "-CAkey", str(ca_key), "-set_serial", "2"]
    steps = [
        [openssl, "req", "-x509", *ec, *ca, *ca_cnf],  # the CA, self-signed
        [openssl, "req", "-new", *ec, *server, "-config", str(req_cnf)],  # server key + CSR
        [openssl, "x509", "-req", *sign, "-out", str(files.cert), *srv_cnf],  # CA signs it
    ]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise RedisUnavailable(f"openssl {cmd[1]} failed: {done.stderr[-800:]}")
    return files


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:<port>``; ``password`` turns on AUTH.

    ``tls=True``: the port speaks TLS only (no client certificates asked for), with a server
    certificate for 127.0.0.1 signed by a throw-away CA (:attr:`tls`, made here).
    """

    def __init__(
        self, *, password: str | None = None, port: int | None = None, tls: bool = False
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisUnavailable("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.password = password
        self.port = port or free_port()
        if self.port == 6379:  # never the machine's own Redis
            raise RedisUnavailable("refusing to use port 6379")
        self.dir = Path(tempfile.mkdtemp(prefix="meter-redis-"))
        self.tls: TLSFiles | None = None
        if tls:
            try:
                self.tls = make_tls_files(self.dir / "tls")
            except BaseException:
                shutil.rmtree(self.dir, ignore_errors=True)
                raise
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:port/0``; with TLS
        ``rediss://[:password@]127.0.0.1:port/0?ssl_ca_certs=<the test CA>``."""
        auth = f":{self.password}@" if self.password else ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return self.tls_url(self.tls.ca_cert)

    def tls_url(self, ca_cert: Path, password: str | None = None) -> str:
        """A ``rediss://`` URL for this server that trusts ``ca_cert`` (besides the system CAs)."""
        pw = self.password if password is None else password
        auth = f":{pw}@" if pw else ""
        ca = quote(str(ca_cert), safe="/")
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required"

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
        if self.tls is not None:
            cmd[1:3] = ["--port", "0", "--tls-port", str(self.port)]
            cmd += ["--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key)]
            cmd += ["--tls-ca-cert-file", str(self.tls.ca_cert), "--tls-auth-clients", "no"]
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
        """Whether the server answers PING (an auth error counts as an answer); over TLS,
        trusting the test CA, when the server has TLS."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                s = raw
                if self.tls is not None:
                    ctx = ssl.create_default_context(cafile=str(self.tls.ca_cert))
                    s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
                with s:
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
