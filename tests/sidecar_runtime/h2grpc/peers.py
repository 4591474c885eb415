"""Servers the client's tests talk to besides ours: one whose every connection runs a script
(raw bytes, for what no HTTP/2 library sends), and :class:`H2Peer`, a server connection on
``h2``'s state machine, which raises if the client breaks the server's flow control, frame size
or stream limit, so every exchange through it checks the client's side of them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.settings

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Accepted:
    """What the scripted server saw."""

    connections: int = 0
    errors: list[BaseException] = field(default_factory=list)


@contextlib.asynccontextmanager
async def scripted(script: Script) -> AsyncIterator[tuple[str, Accepted]]:
    """A TCP server on 127.0.0.1 running ``script`` for each connection; its address."""
    accepted = Accepted()
    tasks: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.connections += 1
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: what several scripts expect
        except Exception as exc:
            accepted.errors.append(exc)
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}", accepted
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert accepted.errors == [], accepted.errors


async def read_until_closed(reader: asyncio.StreamReader) -> None:
    while await reader.read(65_536):
        pass


@dataclass
class Request:
    stream: int
    headers: dict[str, str]
    body: bytearray = field(default_factory=bytearray)


class H2Peer:
    """The server side of one connection; :meth:`requests` yields each whole request."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 settings: dict[h2.settings.SettingCodes, int] | None = None) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        if settings:
            self.conn.local_settings = h2.settings.Settings(client=False, initial_values=settings)
        self.conn.initiate_connection()
        self.open: dict[int, Request] = {}
        self.most_open = 0  # the most streams the client had open at once
        self.flush()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.writer.write(data)

    async def requests(self) -> AsyncIterator[Request]:
        """Whole requests (END_STREAM seen) as they arrive, until the client closes."""
        while data := await self.reader.read(65_536):
            done = []
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    self.open[event.stream_id] = Request(event.stream_id,
                                                         dict(event.headers))  # type: ignore[arg-type]
                    self.most_open = max(self.most_open, len(self.open))
                elif isinstance(event, h2.events.DataReceived):
                    self.open[event.stream_id].body += event.data
                    self.conn.acknowledge_received_data(event.flow_controlled_length,
                                                        event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    done.append(self.open[event.stream_id])
                elif isinstance(event, h2.events.StreamReset):
                    self.open.pop(event.stream_id, None)
            self.flush()
            for request in done:
                yield request

    def answer(self, request: Request, payload: bytes, status: int = 0,
               message: str = "") -> None:
        """A whole gRPC answer: headers, one message, trailers."""
        stream = request.stream
        self.open.pop(stream, None)
        self.conn.send_headers(stream, [(":status", "200"),
                                        ("content-type", "application/grpc")])
        self.conn.send_data(stream, b"\0" + len(payload).to_bytes(4, "big") + payload)
        trailers = [("grpc-status", str(status))]
        if message:
            trailers.append(("grpc-message", message))
        self.conn.send_headers(stream, trailers, end_stream=True)
        self.flush()
