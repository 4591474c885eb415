"""The gRPC server both services run: the part of ``grpc.aio.Server`` they use, on asyncio.

grpc.aio spends about 100 µs of CPU per message in its own machinery (its completion-queue
poller thread, callbacks into the event loop), 4 to 5 times what extproc's own work on a message
costs; this server parses HTTP/2 frames straight off the event loop's reads and runs each call
as one task, about 20 µs per message (docs/decisions/0001-own-http2-server.md). It speaks
what Envoy's gRPC clients (and grpcio's) send: h2c or TLS with ALPN ``h2``, on TCP or a Unix
socket, identity encoding only, ``grpc-timeout``, flow control both ways.

Servicers register as with grpc.aio (``add_*Servicer_to_server(servicer, server)``: both
``add_generic_rpc_handlers`` and ``add_registered_method_handlers`` are here) and see a
:class:`~sidecar_runtime.h2grpc.call.Context` in place of grpc.aio's ``ServicerContext``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import time
from collections.abc import Callable, Mapping, Sequence

import grpc

from sidecar_runtime.h2grpc.call import Metadata, first_handler
from sidecar_runtime.h2grpc.connection import Connection
from sidecar_runtime.h2grpc.head import RequestHead
from sidecar_runtime.h2grpc.limits import Limits
from sidecar_runtime.wire.names import GRPC_MAX_CONCURRENT_STREAMS, UNIX_PREFIX

DEFAULT_MAX_RECEIVE = 4 * 1024 * 1024
"""grpc's default limit on one request message."""


class Server:
    """gRPC over HTTP/2 on the running event loop. Lifecycle as grpc.aio's: add handlers,
    :meth:`add_port`, :meth:`start`, :meth:`stop` with a grace period."""

    def __init__(self, *, max_receive_message_length: int = DEFAULT_MAX_RECEIVE,
                 max_concurrent_streams: int = GRPC_MAX_CONCURRENT_STREAMS,
                 limits: Limits | None = None,
                 on_close: Callable[[str], None] | None = None) -> None:
        self.max_receive_message_length = max_receive_message_length
        self.max_concurrent_streams = max_concurrent_streams
        """Open streams per connection (advertised in SETTINGS); a stream beyond is refused."""
        self.limits = limits or Limits()
        """What one peer may make the server hold or do (:mod:`.limits`)."""
        self.connection_buffer = self.limits.buffer_for(max_receive_message_length)
        """The request bytes one connection may hold for its handlers."""
        self._sweep: asyncio.TimerHandle | None = None
        self.on_close = on_close
        """Told why the server ended a connection (an error code's name, ``idle``,
        ``handshake_timeout``, ``incomplete_timeout``, ``too_many_connections``): the
        service's ``llm_sidecar_grpc_connections_closed_total``."""
        self._registered: dict[str, grpc.RpcMethodHandler] = {}
        self._generic: list[grpc.GenericRpcHandler] = []
        self._listeners: list[asyncio.Server] = []
        self._connections: set[Connection] = set()
        self._active = 0
        self._idle: asyncio.Event | None = None
        self._all_closed: asyncio.Event | None = None
        self._stopped = False
        self.heads: dict[bytes, tuple[int, RequestHead]] = {}
        """Request heads decoded without the HPACK dynamic table, by their blocks (with the
        table size they were decoded at): at most ``limits.heads_cache_bytes``."""
        self.heads_bytes = [0]
        """What :attr:`heads` holds, in bytes (one cell the connections' decoders share)."""

    # -- handlers (grpc.aio.Server's registration API) -------------------------------------

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(
            self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        for name, handler in handlers.items():
            self._registered[f"/{service}/{name}"] = handler

    def handler(self, path: str, metadata: Metadata) -> grpc.RpcMethodHandler | None:
        """The handler of ``path`` (``/package.Service/Method``), or None."""
        found = self._registered.get(path)
        if found is None and self._generic:
            found = first_handler(self._generic, path, metadata)
        return found

    # -- listening --------------------------------------------------------------------------

    async def add_port(self, address: str, *, tls: ssl.SSLContext | None = None,
                       reuse_port: bool = False) -> int:
        """Listen on ``host:port`` or ``unix:/path`` (not serving until :meth:`start`); the
        port bound (1 for a Unix socket). Raises ``OSError`` when it cannot."""
        loop = asyncio.get_running_loop()
        if address.startswith(UNIX_PREFIX):
            path = address[len(UNIX_PREFIX):]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            listener = await loop.create_unix_server(
                lambda: Connection(self), path, ssl=tls, start_serving=False)
            self._listeners.append(listener)
            return 1
        host, _, port = address.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        listener = await loop.create_server(
            lambda: Connection(self), host or None, int(port), ssl=tls, reuse_port=reuse_port,
            start_serving=False, backlog=1024)
        self._listeners.append(listener)
        bound: int = listener.sockets[0].getsockname()[1]
        return bound

    async def start(self) -> None:
        for listener in self._listeners:
            await listener.start_serving()
        self._sweep = asyncio.get_running_loop().call_later(self.limits.sweep_s, self._tick)

    def _tick(self) -> None:
        """Every ``limits.sweep_s``: each connection checks its timeouts."""
        now = time.monotonic()
        for connection in list(self._connections):
            connection.tick(now)
        self._sweep = asyncio.get_running_loop().call_later(self.limits.sweep_s, self._tick)

    async def stop(self, grace: float | None) -> None:
        """Stop listening, send every connection GOAWAY, give the calls in flight up to
        ``grace`` seconds (None: wait for them), then cut the rest and close."""
        if self._stopped:
            return
        self._stopped = True
        if self._sweep is not None:
            self._sweep.cancel()
        for listener in self._listeners:
            listener.close()
        for connection in list(self._connections):
            connection.drain()
        if self._connections and (grace is None or grace > 0):
            # A draining connection closes itself once its calls are done and their answers
            # sent (an answer may still wait for a slow client's window after its handler).
            self._all_closed = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_closed.wait(), grace)
        for connection in list(self._connections):
            connection.cancel_calls()
        if self._active:  # the cut calls finish their handlers' cleanup
            self._idle = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 5.0)
        for listener in self._listeners:
            await listener.wait_closed()

    @property
    def ports(self) -> list[int]:
        return [sock.getsockname()[1] for listener in self._listeners
                for sock in listener.sockets if sock.family != socket.AF_UNIX]

    # -- bookkeeping, from the connections --------------------------------------------------

    def connection_opened(self, connection: Connection) -> bool:
        """Count ``connection`` in; False when the process already has as many as
        ``limits.max_connections`` (the connection then ends at once)."""
        if len(self._connections) >= self.limits.max_connections:
            return False
        self._connections.add(connection)
        if self._stopped:
            connection.drain()
        return True

    def closed_by_us(self, reason: str) -> None:
        """A connection ended by the server, and why."""
        if self.on_close is not None:
            self.on_close(reason)

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._connections)

    def connection_closed(self, connection: Connection) -> None:
        self._connections.discard(connection)
        if not self._connections and self._all_closed is not None:
            self._all_closed.set()

    def call_started(self) -> None:
        self._active += 1

    def call_ended(self) -> None:
        self._active -= 1
        if self._active == 0 and self._idle is not None:
            self._idle.set()


def tls_context(chain: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """A server TLS context for gRPC: ALPN ``h2``, TLS 1.2 or newer, the client's certificate
    required and checked against ``client_ca`` when given (mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(chain, key)
    context.set_alpn_protocols(["h2"])
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca)
    return context

