"""HTTP/2 at the frame level (h2c, prior knowledge), for what a well-behaved client library
refuses to send: more streams than the server allows. ``h2`` checks the server's
``SETTINGS_MAX_CONCURRENT_STREAMS`` before opening a stream; an attacker's client does not.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import hpack
from hyperframe.frame import Frame, HeadersFrame, SettingsFrame, WindowUpdateFrame

from routing.units import parse_hostport

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class RawH2:
    """One h2c connection on which the test writes frames and reads the server's frames."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.encoder = hpack.Encoder()
        self._pending = b""
        self.server_settings: dict[int, int] = {}
        self.connection_window_increments = 0
        """Sum of the server's WINDOW_UPDATE increments on stream 0 read so far."""

    def send(self, *frames: Frame) -> None:
        self.sock.sendall(b"".join(f.serialize() for f in frames))

    def open_stream(self, stream_id: int, headers: list[tuple[str, str]]) -> None:
        """HEADERS without END_STREAM: the stream stays open, waiting for its body."""
        frame = HeadersFrame(stream_id, self.encoder.encode(headers))
        frame.flags.add("END_HEADERS")
        self.send(frame)

    def read_frame(self) -> Frame:
        """The server's next frame (SETTINGS are acknowledged and remembered on the way)."""
        while True:
            header = self._read(9)
            frame, length = Frame.parse_frame_header(memoryview(header))
            frame.parse_body(memoryview(self._read(length)))
            if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                self.server_settings.update(frame.settings)
                self.send(SettingsFrame(0, flags=["ACK"]))
            if isinstance(frame, WindowUpdateFrame) and frame.stream_id == 0:
                self.connection_window_increments += frame.window_increment
            return frame

    def read_until_closed(self) -> list[Frame]:
        """Every frame the server sends until it closes the connection."""
        frames = []
        while True:
            try:
                frames.append(self.read_frame())
            except ConnectionError:
                return frames

    def _read(self, size: int) -> bytes:
        while len(self._pending) < size:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self._pending += chunk
        out, self._pending = self._pending[:size], self._pending[size:]
        return out


@contextmanager
def raw_h2(address: str, timeout_s: float = 15.0) -> Iterator[RawH2]:
    """A connection to ``address`` whose preface and (empty) SETTINGS are sent, and whose
    server SETTINGS have been read and acknowledged."""
    with socket.create_connection(parse_hostport(address), timeout=timeout_s) as sock:
        conn = RawH2(sock)
        sock.sendall(PREFACE)
        conn.send(SettingsFrame(0))
        while not isinstance(conn.read_frame(), SettingsFrame) or not conn.server_settings:
            pass
        yield conn
