"""Redis behind TLS (``rediss://``) with a password, for the security tests.

Native when a TLS-capable ``redis-server`` is found (``LLM_SIDECAR_TEST_REDIS_TLS_BINARY``,
``redis-server`` on PATH, or Debian's redis-tools binary, which `.ci/run` installs when it
can); else a plain server behind :class:`FaultProxy` terminating TLS. Either way the client
side, which is what the services own, sees a real TLS server with a certificate from the
test CA.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from sidecar_runtime.process.procs import free_port
from tests.harness.fault_proxy import FaultProxy
from tests.harness.redis_servers import (
    START_TIMEOUT_S,
    ProcessRedis,
    RedisUnavailable,
    redis_binary,
)
from tests.harness.tls import TlsFiles

ENV_BINARY = "LLM_SIDECAR_TEST_REDIS_TLS_BINARY"
DEBIAN_BINARY = "/usr/bin/redis-check-rdb"
"""Debian's redis-tools ships the server only under this name; redis picks its mode from
argv[0], so a link named ``redis-server`` runs the server."""


def tls_binary_candidates(workdir: Path) -> list[str]:
    found = [os.environ.get(ENV_BINARY, ""), shutil.which("redis-server") or ""]
    if os.access(DEBIAN_BINARY, os.X_OK):
        link = workdir / "redis-server"
        if not link.exists():
            link.symlink_to(DEBIAN_BINARY)
        found.append(str(link))
    return [b for b in dict.fromkeys(found) if b and os.access(b, os.X_OK)]


@dataclass
class TlsRedis:
    files: TlsFiles
    password: str
    port: int
    mode: str
    """``native`` (redis-server speaks TLS) or ``proxy`` (TLS terminated in front of it)."""
    process: subprocess.Popen[bytes] | None = None
    plain: ProcessRedis | None = None
    proxy: FaultProxy | None = None
    workdir: Path | None = None

    @property
    def url(self) -> str:
        return (f"rediss://:{self.password}@127.0.0.1:{self.port}/0"
                f"?ssl_ca_certs={self.files.ca_cert}")

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, ssl=True,
                           ssl_ca_certs=str(self.files.ca_cert), **kwargs)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.proxy is not None:
            self.proxy.stop()
        if self.plain is not None:
            self.plain.stop()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _wait_tls(server: TlsRedis, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process is not None and server.process.poll() is not None:
            return False
        try:
            with server.client(socket_timeout=0.5) as client:
                if client.ping():
                    return True
        except (redis.RedisError, OSError):
            time.sleep(0.05)
    return False


def _native(files: TlsFiles, password: str, binary: str, workdir: Path) -> TlsRedis | None:
    port = free_port()
    args = [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--dir", str(workdir), "--save", "", "--appendonly", "no",
            "--tls-cert-file", str(files.server_cert), "--tls-key-file", str(files.server_key),
            "--tls-ca-cert-file", str(files.ca_cert), "--tls-auth-clients", "optional",
            "--requirepass", password]
    log = (workdir / f"redis-tls-{port}.log").open("ab")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    server = TlsRedis(files, password, port, "native", process=process)
    if _wait_tls(server, START_TIMEOUT_S):
        return server
    server.stop()  # not built with TLS ("FATAL CONFIG FILE ERROR"), or it would not start
    return None


def start_tls_redis(files: TlsFiles, password: str) -> TlsRedis:
    workdir = Path(tempfile.mkdtemp(prefix="redis-tls-"))
    for binary in tls_binary_candidates(workdir):
        server = _native(files, password, binary, workdir)
        if server is not None:
            server.workdir = workdir
            return server
    shutil.rmtree(workdir, ignore_errors=True)
    plain_binary = redis_binary()
    if plain_binary is None:
        raise RedisUnavailable("no redis-server binary")
    plain = ProcessRedis(binary=plain_binary, password=password).start()
    proxy = FaultProxy("127.0.0.1", plain.port, server_ssl=files.server_context()).start()
    server = TlsRedis(files, password, proxy.port, "proxy", plain=plain, proxy=proxy)
    if not _wait_tls(server, START_TIMEOUT_S):
        server.stop()
        raise RedisUnavailable("TLS proxy in front of redis did not answer")
    return server
