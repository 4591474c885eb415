"""Where and how extproc and ratelimit listen for Envoy: ``host:port`` or a Unix socket
(``unix:/path``), in plain text or TLS (``LLM_SIDECAR_GRPC_TLS_*``; a client CA makes it mutual
TLS). The one place the two services' gRPC listeners are set up."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import ssl
import time

from sidecar_runtime.h2grpc import Server, tls_context
from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.process.settings import Settings
from sidecar_runtime.wire.names import UNIX_PREFIX

log = get_logger("sidecar_runtime.process.grpc_listen")

HELD_PORT_WAIT_S = 65.0
"""How long a port that no one listens on but a connection holds is waited for: Linux keeps a
closed connection in TIME_WAIT for 60 s."""


def listen_address(host: str, port: int) -> str:
    """gRPC's address string: ``unix:/path`` as given, else ``host:port``."""
    return host if host.startswith(UNIX_PREFIX) else f"{host}:{port}"


def metrics_host(host: str) -> str:
    """The HTTP /metrics and /healthz listener's host: the gRPC host, or every interface
    when gRPC is on a Unix socket (probes and scrapes come over the pod network)."""
    return "0.0.0.0" if host.startswith(UNIX_PREFIX) else host


def server_tls(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context from the settings, or None for plain text. Raises ``ValueError`` (no
    secret in it) when the files are incomplete, unreadable or not a certificate and its key."""
    cert, key, client_ca = (settings.grpc_tls_cert_file, settings.grpc_tls_key_file,
                            settings.grpc_tls_client_ca_file)
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("LLM_SIDECAR_GRPC_TLS_CLIENT_CA_FILE needs a server certificate: "
                             "set LLM_SIDECAR_GRPC_TLS_CERT_FILE and ..._KEY_FILE")
        return None
    if cert is None or key is None:
        raise ValueError("LLM_SIDECAR_GRPC_TLS_CERT_FILE and LLM_SIDECAR_GRPC_TLS_KEY_FILE go "
                         "together")
    for path in (cert, key, client_ca):
        if path is not None and not os.access(path, os.R_OK):
            raise ValueError(f"cannot read a gRPC TLS file: {path}")
    try:
        return tls_context(cert, key, client_ca)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"the gRPC TLS files {cert}, {key}"
                         f"{', ' + client_ca if client_ca else ''} are not a PEM certificate "
                         f"chain, its key and CA certificates ({type(exc).__name__})") from None


async def add_port(server: Server, host: str, port: int, settings: Settings, *,
                   shared: bool = False) -> int:
    """Listen on ``host:port`` or ``unix:/path``; the port bound (1 for a Unix socket).
    A stale socket file left by a killed process is removed first. ``shared``: SO_REUSEPORT,
    on only for ``--workers N`` (every worker binds the same port); off otherwise, so a second
    copy started by mistake fails with "address in use" instead of silently taking half of the
    connections."""
    tls = server_tls(settings)
    address = listen_address(host, port)
    deadline: float | None = None
    while True:
        try:
            return await server.add_port(address, tls=tls, reuse_port=shared)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or address.startswith(UNIX_PREFIX) \
                    or listening(host, port):
                raise
            # No one listens, yet the bind fails: the port is some connection's source port
            # (the defaults 50051 and 50052 lie in Linux's ephemeral range, 32768-60999), or a
            # connection from it is in TIME_WAIT. Either lets go of it: wait, do not fail.
            now = time.monotonic()
            if deadline is None:
                deadline = now + HELD_PORT_WAIT_S
                log.warning("grpc_port_held", port=port, wait_s=HELD_PORT_WAIT_S,
                            detail="no one listens, but a connection holds the port as its "
                                   "source port; waiting for it to close")
            if now >= deadline:
                raise
            await asyncio.sleep(0.5)


def listening(host: str, port: int) -> bool:
    """Whether something accepts connections on ``host:port`` (a wildcard host is probed on
    loopback)."""
    probe_host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(
        host, host.strip("[]"))
    try:
        with socket.create_connection((probe_host, port), timeout=1.0):
            return True
    except OSError:
        return False
