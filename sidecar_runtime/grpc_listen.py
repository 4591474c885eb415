"""Where and how extproc and ratelimit listen for Envoy: ``host:port`` or a Unix socket
(``unix:/path``), in plain text or TLS (``LLM_SIDECAR_GRPC_TLS_*``; a client CA makes it mutual
TLS). The one place the two services' gRPC listeners are set up."""

from __future__ import annotations

import os
import ssl

from sidecar_runtime.h2grpc import Server, tls_context
from sidecar_runtime.settings import Settings
from sidecar_runtime.wire_names import UNIX_PREFIX


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
    return await server.add_port(listen_address(host, port), tls=server_tls(settings),
                                 reuse_port=shared)
