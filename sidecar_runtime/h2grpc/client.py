"""A gRPC client channel for unary calls on asyncio: h2c, or TLS with ALPN ``h2``, on TCP or a
Unix socket; one connection multiplexing every call (:mod:`.client_connection`).

grpc.aio's client costs about 1 ms of CPU per call on this machine (its completion-queue
poller and event-engine threads, callbacks into the loop); this one parses frames on the event
loop's reads, as the server does (docs/decisions/0001-own-http2-server.md).

The connection opens on the first call and again after it is lost or the server sent GOAWAY.
A call waits at most until its deadline for everything (the connection, a free stream, the
answer) and fails with :class:`~.status.RpcError`: ``DEADLINE_EXCEEDED`` (its stream reset
with CANCEL), ``UNAVAILABLE`` when the server cannot be reached or the connection is lost, the
server's own status otherwise. A call the server never saw (refused, above a GOAWAY's last
stream) is sent once more on a new connection if its deadline allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from typing import Protocol, TypeVar

from sidecar_runtime.h2grpc import frames as f
from sidecar_runtime.h2grpc.client_connection import ClientConnection
from sidecar_runtime.h2grpc.status import RpcError, StatusCode
from sidecar_runtime.wire.names import UNIX_PREFIX

DEFAULT_MAX_RECEIVE = 4 * 1024 * 1024
"""grpc's default limit on one answer message."""
RECEIVE_WINDOW = 1024 * 1024
"""Each stream's receive window (the connection's is four times it)."""
CONNECT_TIMEOUT_S = 20.0
"""A connection attempt shared by the calls waiting for it gives up after this, whatever their
deadlines (each of them stops waiting at its own)."""
RETRY_CONNECT_S = 0.1
"""After a failed connection attempt, calls fail at once for this long instead of each trying
again: a server that is down costs at most ten attempts a second."""

Answer = TypeVar("Answer")


class Message(Protocol):
    def SerializeToString(self) -> bytes: ...


def tls_client_context(ca_file: str, cert_file: str | None = None,
                       key_file: str | None = None) -> ssl.SSLContext:
    """A client TLS context for gRPC: the server's certificate checked against ``ca_file``,
    ALPN ``h2``, TLS 1.2 or newer; with ``cert_file``/``key_file``, the client's certificate
    (mutual TLS). Raises ``OSError`` (``ssl.SSLError`` included) when a file cannot be used."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    context.set_alpn_protocols(["h2"])
    return context


class Channel:
    """Unary gRPC calls to ``target`` (``host:port``, ``[v6]:port`` or ``unix:/path``), with
    ``tls`` when given; ``server_name``: the name the certificate is checked against, sent as
    SNI and ``:authority`` (default: the target's host)."""

    def __init__(self, target: str, *, tls: ssl.SSLContext | None = None,
                 server_name: str | None = None, receive_window: int = RECEIVE_WINDOW,
                 max_receive_message_length: int = DEFAULT_MAX_RECEIVE) -> None:
        target = target.strip()  # as routing's address check reads it
        self.target = target
        self._tls = tls
        if target.startswith(UNIX_PREFIX):
            self._path: str | None = target[len(UNIX_PREFIX):]
            self._host, self._port = "localhost", 0
            authority = "localhost"
        else:
            self._path = None
            host, _, port = target.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"bad gRPC target {target!r}: use host:port or unix:/path")
            self._host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
            self._port = int(port)
            authority = target
        self._server_name = server_name or self._host
        self._authority = server_name or authority
        self._receive_window = receive_window
        self._max_receive = max_receive_message_length
        self._connection: ClientConnection | None = None
        self._connecting: asyncio.Task[ClientConnection] | None = None
        self._failed: tuple[float, RpcError] | None = None
        self._old: set[ClientConnection] = set()  # going away, answering their last calls
        self._heads: dict[str, bytes] = {}
        self._closed = False

    async def unary_unary(self, method: str, request: Message | bytes,
                          parse: Callable[[bytes], Answer], timeout_s: float) -> Answer:
        """Call ``method`` (``/package.Service/Method``) with ``request`` (a message, or one
        serialised already); the answer as ``parse`` (a message class's ``FromString``) reads
        it. Raises :class:`RpcError`."""
        payload = request if isinstance(request, bytes) else request.SerializeToString()
        raw = await self.unary(method, payload, timeout_s)
        try:
            return parse(raw)
        except Exception as exc:
            raise RpcError(StatusCode.INTERNAL, f"could not parse the answer: {exc}") from None

    async def unary(self, method: str, request: bytes, timeout_s: float) -> bytes:
        """Call ``method`` with the serialized ``request``; the serialized answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        head = self._heads.get(method)
        if head is None:
            head = self._heads[method] = self._head(method)
        data = f.length_prefixed(request)
        for attempt in range(2):
            connection = self._connection
            if connection is None or not connection.usable:
                connection = await self._connect(deadline)
            try:
                return await connection.call(head, data, deadline)
            except RpcError as exc:
                if not exc.retryable or attempt or loop.time() >= deadline:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _head(self, method: str) -> bytes:
        """The call's header block but ``grpc-timeout``: ``:method POST`` and ``:scheme`` from
        HPACK's static table (indices 3, 6 and 7), the rest literals."""
        return (b"\x83" + (b"\x87" if self._tls is not None else b"\x86")
                + f.literal(":path", method) + f.literal(":authority", self._authority)
                + f.literal("content-type", "application/grpc") + f.literal("te", "trailers"))

    async def _connect(self, deadline: float) -> ClientConnection:
        """The connection to call on: the current one, or one opened now (calls arriving
        meanwhile wait for the same attempt, each until its own deadline)."""
        if self._closed:
            raise RpcError(StatusCode.UNAVAILABLE, "the channel is closed")
        loop = asyncio.get_running_loop()
        old = self._connection
        if old is not None and not old.usable:
            self._connection = None
            if not old.closed:  # GOAWAY: it closes itself once its calls are answered
                self._old.add(old)
                old.done.add_done_callback(lambda _: self._old.discard(old))
        if self._failed is not None:
            failed_at, error = self._failed
            if loop.time() - failed_at < RETRY_CONNECT_S:
                raise RpcError(error.code, error.details)
            self._failed = None
        if self._connecting is None:
            self._connecting = loop.create_task(self._open())
            # Its error is the waiters' to raise; when every one of them gave up first, it
            # is read here, or asyncio would log it as never retrieved.
            self._connecting.add_done_callback(
                lambda task: None if task.cancelled() else task.exception())
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(self._connecting)
        except TimeoutError:
            raise RpcError(StatusCode.DEADLINE_EXCEEDED,
                           f"Deadline Exceeded (connecting to {self.target})") from None

    async def _open(self) -> ClientConnection:
        loop = asyncio.get_running_loop()

        def factory() -> ClientConnection:
            return ClientConnection(receive_window=self._receive_window,
                                    max_receive=self._max_receive)

        tls, name = self._tls, self._server_name if self._tls is not None else None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                if self._path is not None:
                    transport, connection = await loop.create_unix_connection(
                        factory, self._path, ssl=tls, server_hostname=name)
                else:
                    transport, connection = await loop.create_connection(
                        factory, self._host, self._port, ssl=tls, server_hostname=name)
            if tls is not None:
                alpn = transport.get_extra_info("ssl_object").selected_alpn_protocol()
                if alpn != "h2":
                    transport.abort()
                    raise OSError(f"the server did not agree to HTTP/2 (ALPN {alpn!r})")
        except (OSError, TimeoutError) as exc:
            error = RpcError(StatusCode.UNAVAILABLE,
                             f"cannot connect to {self.target}: {exc or type(exc).__name__}")
            self._failed = (loop.time(), error)
            raise error from None
        finally:
            self._connecting = None
        if self._closed:
            connection.close()
            raise RpcError(StatusCode.UNAVAILABLE, "the channel is closed")
        self._connection = connection
        return connection

    async def aclose(self) -> None:
        """Close the connections: calls still open fail CANCELLED; later calls UNAVAILABLE."""
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            await asyncio.wait([self._connecting])
        connections = [c for c in (self._connection, *self._old) if c is not None]
        self._connection = None
        for connection in connections:
            connection.close(RpcError(StatusCode.CANCELLED, "the channel was closed"))
        for connection in connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(connection.done), 1.0)
            if not connection.done.done() and connection.transport is not None:
                connection.transport.abort()
