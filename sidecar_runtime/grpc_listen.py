"""Where and how extproc and ratelimit listen for Envoy: ``host:port`` or a Unix socket
(``unix:/path``), in plain text or TLS (``LLM_SIDECAR_GRPC_TLS_*``; a client CA makes it mutual
TLS). The one place the two services' gRPC listeners are set up."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import grpc

from sidecar_runtime.settings import Settings
from sidecar_runtime.wire_names import UNIX_PREFIX


def listen_address(host: str, port: int) -> str:
    """gRPC's address string: ``unix:/path`` as given, else ``host:port``."""
    return host if host.startswith(UNIX_PREFIX) else f"{host}:{port}"


def metrics_host(host: str) -> str:
    """The HTTP /metrics and /healthz listener's host: the gRPC host, or every interface
    when gRPC is on a Unix socket (probes and scrapes come over the pod network)."""
    return "0.0.0.0" if host.startswith(UNIX_PREFIX) else host


def reuse_port_option(shared: bool) -> tuple[str, int]:
    """gRPC's SO_REUSEPORT switch. On only for ``--workers N`` (every worker binds the same
    port); off otherwise, so a second copy started by mistake fails with "address in use"
    instead of silently taking half of the connections."""
    return ("grpc.so_reuseport", 1 if shared else 0)


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS credentials from the settings, or None for plain text. Raises ``ValueError`` (no
    secret in it) when the files are incomplete or unreadable."""
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
    try:
        chain, private = Path(cert).read_bytes(), Path(key).read_bytes()
        roots = Path(client_ca).read_bytes() if client_ca else None
    except OSError as exc:
        raise ValueError(f"cannot read a gRPC TLS file: {exc.filename}: {exc.strerror}") from None
    return grpc.ssl_server_credentials([(private, chain)], root_certificates=roots,
                                       require_client_auth=roots is not None)


def add_port(server: grpc.aio.Server, host: str, port: int, settings: Settings) -> int:
    """Listen on ``host:port`` or ``unix:/path``; the port bound (1 for a Unix socket).
    A stale socket file left by a killed process is removed first."""
    address = listen_address(host, port)
    if address.startswith(UNIX_PREFIX):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address[len(UNIX_PREFIX):])
    credentials = server_credentials(settings)
    bound: int
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    return bound
