"""HTTP/2 clients on asyncio streams for what grpcio cannot send or show.

:class:`H2Client` is a real client (``h2``'s state machine) whose flow control the test drives by
hand: ``h2`` raises if the server sends beyond a window or a frame above the client's maximum, so
every exchange through it checks the server's side of flow control. :class:`FrameClient` writes
frames as the test builds them (``hyperframe``), for what ``h2`` refuses to send.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
from hyperframe.frame import Frame, GoAwayFrame, HeadersFrame, SettingsFrame

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
WAIT_S = 10.0
"""How long a read waits before the test fails: a bound for a broken server only."""


def grpc_headers(path: str, **extra: str) -> list[tuple[str, str]]:
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path),
               (":authority", "test"), ("content-type", "application/grpc"), ("te", "trailers")]
    return headers + [(name.replace("_", "-"), value) for name, value in extra.items()]


def message(payload: bytes, compressed: bool = False) -> bytes:
    """One gRPC length-prefixed message."""
    return bytes((int(compressed),)) + len(payload).to_bytes(4, "big") + payload


def messages(body: bytes | bytearray) -> list[bytes]:
    """The gRPC messages in a response body."""
    out, at = [], 0
    while at < len(body):
        assert body[at] == 0, "the server sent a compressed message"
        length = int.from_bytes(body[at + 1:at + 5], "big")
        out.append(bytes(body[at + 5:at + 5 + length]))
        at += 5 + length
    assert at == len(body), "the body ends inside a message"
    return out


@dataclass
class Answer:
    """What the server sent on one stream."""

    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    trailers: dict[str, str] = field(default_factory=dict)
    ended: bool = False
    reset: int | None = None  # the RST_STREAM code, if the server reset the stream

    @property
    def grpc_status(self) -> int | None:
        value = self.trailers.get("grpc-status", self.headers.get("grpc-status"))
        return None if value is None else int(value)

    @property
    def grpc_message(self) -> str | None:
        return self.trailers.get("grpc-message", self.headers.get("grpc-message"))

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None


class H2Client:
    """An h2 client connection. Each DATA frame received is granted back (stream and
    connection) right away, one frame at a time, unless ``grant`` is False: the window never
    grows past what the client first offered."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 conn: h2.connection.H2Connection) -> None:
        self.reader, self.writer, self.conn = reader, writer, conn
        self.answers: dict[int, Answer] = {}
        self.grant = True
        self.terminated: h2.events.ConnectionTerminated | None = None
        self.pings: list[bytes] = []
        self._unsent: dict[int, tuple[bytearray, bool]] = {}  # stream: (data, end_stream)
        self.sent: dict[int, int] = {}  # DATA bytes sent on each stream

    @classmethod
    async def open(cls, port: int, *, window: int = 65_535, max_frame: int = 16_384,
                   ) -> H2Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: max_frame,
            h2.settings.SettingCodes.ENABLE_PUSH: 0})
        conn.initiate_connection()
        client = cls(reader, writer, conn)
        client.flush()
        return client

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.writer.write(data)

    def request(self, path: str, body: bytes | None = None, *, end: bool = True,
                headers: list[tuple[str, str]] | None = None) -> int:
        """Open a stream with ``headers`` (default: a gRPC call of ``path``) and queue
        ``body``; the stream half-closes after it when ``end``."""
        stream = self.conn.get_next_available_stream_id()
        self.answers[stream] = Answer()
        self.conn.send_headers(stream, headers or grpc_headers(path),
                               end_stream=end and body is None)
        if body is not None:
            self.send(stream, body, end=end)
        self.flush()
        return stream

    def send(self, stream: int, data: bytes, *, end: bool = False) -> None:
        """Queue DATA on ``stream``; it goes out as the server's windows allow."""
        queued, _ = self._unsent.get(stream, (bytearray(), False))
        self._unsent[stream] = (queued + data, end)
        self._pump()

    def _pump(self) -> None:
        for stream, (data, end) in list(self._unsent.items()):
            while data:
                size = min(len(data), self.conn.max_outbound_frame_size,
                           self.conn.local_flow_control_window(stream))
                if size <= 0:
                    break
                self.conn.send_data(stream, bytes(data[:size]))
                self.sent[stream] = self.sent.get(stream, 0) + size
                del data[:size]
            if not data:
                del self._unsent[stream]
                if end:
                    self.conn.end_stream(stream)
        self.flush()

    async def receive(self) -> list[h2.events.Event]:
        data = await asyncio.wait_for(self.reader.read(65_536), WAIT_S)
        if not data:
            raise ConnectionResetError("the server closed the connection")
        events = self.conn.receive_data(data)
        for event in events:
            self._on(event)
        self._pump()
        return events

    def _on(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            self.answers[event.stream_id].headers = dict(event.headers)  # type: ignore[arg-type]
        elif isinstance(event, h2.events.TrailersReceived):
            self.answers[event.stream_id].trailers = dict(event.headers)  # type: ignore[arg-type]
        elif isinstance(event, h2.events.DataReceived):
            self.answers[event.stream_id].body += event.data
            if self.grant and event.flow_controlled_length:
                self.conn.increment_flow_control_window(event.flow_controlled_length)
                # A stream the server reset or ended takes no more window.
                with contextlib.suppress(h2.exceptions.StreamClosedError):
                    self.conn.increment_flow_control_window(
                        event.flow_controlled_length, stream_id=event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            self.answers[event.stream_id].ended = True
        elif isinstance(event, h2.events.StreamReset):
            if event.stream_id in self.answers:
                self.answers[event.stream_id].reset = event.error_code
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.terminated = event
        elif isinstance(event, h2.events.PingAckReceived):
            self.pings.append(event.ping_data)

    async def until(self, condition: Callable[[], object]) -> None:
        while not condition():
            await self.receive()

    async def answer(self, stream: int) -> Answer:
        await self.until(lambda: self.answers[stream].done)
        return self.answers[stream]

    async def call(self, path: str, *payloads: bytes) -> Answer:
        stream = self.request(path, b"".join(message(p) for p in payloads))
        return await self.answer(stream)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


class FrameClient:
    """A connection on which the test writes frames of its choosing and reads the server's.
    Its own header blocks go through one HPACK encoder, so they stay decodable in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()

    @classmethod
    async def open(cls, port: int, *, preface: bytes = PREFACE) -> FrameClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer)
        writer.write(preface)
        if preface == PREFACE:
            client.send(SettingsFrame(0))
        return client

    def send(self, *frames: Frame | bytes) -> None:
        self.writer.write(b"".join(f if isinstance(f, bytes) else f.serialize() for f in frames))

    def block(self, headers: list[tuple[str, str]]) -> bytes:
        return self.encoder.encode(headers)

    def headers(self, stream: int, headers: list[tuple[str, str]], *,
                end: bool = False) -> HeadersFrame:
        frame = HeadersFrame(stream, self.block(headers))
        frame.flags.add("END_HEADERS")
        if end:
            frame.flags.add("END_STREAM")
        return frame

    async def read_frame(self) -> Frame | None:
        """The server's next frame (its SETTINGS acknowledged), None once it closed."""
        try:
            header = await asyncio.wait_for(self.reader.readexactly(9), WAIT_S)
            frame, length = Frame.parse_frame_header(memoryview(header))
            frame.parse_body(memoryview(await asyncio.wait_for(
                self.reader.readexactly(length), WAIT_S)))
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return None
        if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            self.send(SettingsFrame(0, flags=["ACK"]))
        return frame

    async def until_closed(self) -> list[Frame]:
        frames = []
        while (frame := await self.read_frame()) is not None:
            frames.append(frame)
        return frames

    async def until(self, condition: Callable[[Frame], bool]) -> Frame:
        while True:
            frame = await self.read_frame()
            assert frame is not None, "the server closed the connection"
            if condition(frame):
                return frame

    def decode(self, frame: HeadersFrame) -> dict[str, str]:
        return dict(cast(list[tuple[str, str]], self.decoder.decode(frame.data)))

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


def goaway(frames: list[Frame]) -> GoAwayFrame:
    """The one GOAWAY among ``frames``, the last frame the server sent."""
    found = [frame for frame in frames if isinstance(frame, GoAwayFrame)]
    assert len(found) == 1, f"expected one GOAWAY, got {frames}"
    assert frames[-1] is found[0], f"frames after GOAWAY: {frames}"
    return found[0]
