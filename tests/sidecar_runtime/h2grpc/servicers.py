"""Small servicers for the h2grpc server's tests, registered the way generated code does
(``grpc.*_rpc_method_handler`` + ``method_handlers_generic_handler``), and a running server.

Messages are raw bytes (no serializers) except on ``Parse``, whose request is a protobuf.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from sidecar_runtime.h2grpc import Context, Server
from sidecar_runtime.h2grpc.limits import Limits

SERVICE = "test.H2"
MAX_RECEIVE = 1024 * 1024
"""The test server's limit on one request message."""


def path(method: str) -> str:
    return f"/{SERVICE}/{method}"


@dataclass
class Seen:
    """What the handlers went through, for a test to wait on."""

    started: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: int = 0
    in_flight: int = 0
    metadata: list[tuple[str, str]] = field(default_factory=list)
    requests: list[bytes] = field(default_factory=list)  # what Echo was asked
    deadline: float | None = None


class Servicer:
    """The test methods; ``seen`` records what the blocking ones saw."""

    def __init__(self) -> None:
        self.seen = Seen()
        self.gate_at = 0  # Gate answers once this many calls wait at it
        self._gate = asyncio.Event()

    async def echo(self, request: bytes, context: Context) -> bytes:
        self.seen.metadata = list(context.invocation_metadata())
        self.seen.requests.append(request)
        return request

    async def abort(self, request: bytes, context: Context) -> bytes:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, request.decode())

    async def fail(self, request: bytes, context: Context) -> bytes:
        raise RuntimeError("secret internals: password=hunter2")

    async def parse(self, request: health_pb2.HealthCheckRequest,
                    context: Context) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING if request.service == "up"
            else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def big(self, request: bytes, context: Context) -> bytes:
        """An answer of the size the request names (decimal), each byte its offset mod 251."""
        return pattern(int(request))

    async def hold(self, request: bytes, context: Context) -> bytes:
        """Waits until released (or cut); records its start, end and any cancellation."""
        seen = self.seen
        seen.in_flight += 1
        seen.deadline = context.time_remaining()
        seen.started.set()
        try:
            await seen.release.wait()
            return request
        except asyncio.CancelledError:
            seen.cancelled += 1
            raise
        finally:
            seen.in_flight -= 1
            seen.ended.set()

    async def gate(self, request: bytes, context: Context) -> bytes:
        """Answers only once ``gate_at`` calls are waiting here at the same time."""
        self.seen.in_flight += 1
        if self.seen.in_flight >= self.gate_at:
            self._gate.set()
        await self._gate.wait()
        return request

    async def chat(self, requests: AsyncIterator[bytes],
                   context: Context) -> AsyncIterator[bytes]:
        """Bidi echo as an async generator: each message back, upper-cased."""
        async for message in requests:
            yield message.upper()

    async def read_write(self, requests: Any, context: Context) -> None:
        """Bidi through ``context.read``/``context.write``: each message reversed, then the
        count of messages read once the client half-closed."""
        count = 0
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                break
            count += 1
            await context.write(bytes(reversed(message)))
        await context.write(str(count).encode())

    async def hold_stream(self, requests: AsyncIterator[bytes],
                          context: Context) -> AsyncIterator[bytes]:
        """Bidi that echoes and records a cancellation, for cuts mid-stream."""
        seen = self.seen
        seen.started.set()
        try:
            async for message in requests:
                yield message
            await seen.release.wait()
        except asyncio.CancelledError:
            seen.cancelled += 1
            raise
        finally:
            seen.ended.set()

    async def stall(self, requests: AsyncIterator[bytes],
                    context: Context) -> AsyncIterator[bytes]:
        """Reads nothing until released, then counts the messages."""
        self.seen.started.set()
        await self.seen.release.wait()
        count = 0
        async for _ in requests:
            count += 1
        yield str(count).encode()

    def count(self, request: bytes, context: Context) -> Iterator[bytes]:
        """Server streaming as a plain generator: 0 up to the number asked (decimal)."""
        for i in range(int(request)):
            yield str(i).encode()


def pattern(size: int) -> bytes:
    return bytes(i % 251 for i in range(251)) * (size // 251) + bytes(range(size % 251))


def register(server: Server, servicer: Servicer) -> None:
    unary = grpc.unary_unary_rpc_method_handler
    bidi = grpc.stream_stream_rpc_method_handler
    handlers = {
        "Echo": unary(servicer.echo),
        "Abort": unary(servicer.abort),
        "Fail": unary(servicer.fail),
        "Parse": unary(servicer.parse,
                       request_deserializer=health_pb2.HealthCheckRequest.FromString,
                       response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
        "Big": unary(servicer.big),
        "Hold": unary(servicer.hold),
        "Gate": unary(servicer.gate),
        "Chat": bidi(servicer.chat),
        "ReadWrite": bidi(servicer.read_write),
        "HoldStream": bidi(servicer.hold_stream),
        "Stall": bidi(servicer.stall),
        "Count": grpc.unary_stream_rpc_method_handler(servicer.count),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@dataclass
class Running:
    server: Server
    servicer: Servicer
    health: HealthServicer
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def running_server(*, max_receive: int = MAX_RECEIVE,
                         address: str = "127.0.0.1:0", max_streams: int | None = None,
                         limits: Limits | None = None,
                         **port_options: Any) -> AsyncIterator[Running]:
    """A started server with the test methods and grpc.health.v1, stopped on the way out
    (``max_streams``: its streams per connection, else the server's default; ``limits``: else
    the defaults)."""
    server = Server(max_receive_message_length=max_receive, limits=limits) \
        if max_streams is None else \
        Server(max_receive_message_length=max_receive, max_concurrent_streams=max_streams,
               limits=limits)
    servicer, health = Servicer(), HealthServicer()
    register(server, servicer)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = await server.add_port(address, **port_options)
    await server.start()
    try:
        yield Running(server, servicer, health, port)
    finally:
        servicer.seen.release.set()
        await server.stop(1.0)


@contextlib.asynccontextmanager
async def channel(target: str, options: list[tuple[str, Any]] | None = None,
                  ) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(target, options=options) as opened:
        yield opened


async def unary(ch: grpc.aio.Channel, method: str, request: bytes, **kwargs: Any) -> bytes:
    answer: bytes = await ch.unary_unary(path(method))(request, **kwargs)
    return answer
