"""What both ends of an h2grpc HTTP/2 connection do alike (RFC 9113): :class:`H2Peer`.

The server's :class:`~.connection.Connection` and the client's
:class:`~.client_connection.ClientConnection` are each an :class:`H2Peer`; what a stream is and
what its frames do is theirs, the connection's mechanics are here, written once.
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import ClassVar, Generic, Protocol, TypeVar

import hpack

from sidecar_runtime.h2grpc import frames as f
from sidecar_runtime.h2grpc.frames import ConnectionError_
from sidecar_runtime.h2grpc.head import MAX_HEADER_LIST
from sidecar_runtime.h2grpc.limits import MAX_CONTINUATIONS

_unpack_header = f.HEADER.unpack_from


class _OpenBlock:
    """A header block begun by HEADERS and waiting for its CONTINUATION frames."""

    __slots__ = ("at", "block", "flags", "frames", "stream")

    def __init__(self, stream: int, flags: int, block: bytearray) -> None:
        self.stream = stream
        self.flags = flags
        self.block = block
        self.frames = 0
        self.at = time.monotonic()


class PeerStream(Protocol):
    """What the shared mechanics read and change of a stream."""

    id: int
    send_window: int


S = TypeVar("S", bound=PeerStream)


class H2Peer(asyncio.Protocol, Generic[S]):
    """One end of an HTTP/2 connection; ``S`` is that side's stream.

    Frames are parsed straight off ``data_received`` (a frame split across reads waits whole
    in ``_pending``) and dispatched by type. PING, CONTINUATION, SETTINGS and WINDOW_UPDATE
    are handled here; what a side does with DATA, a header block, RST_STREAM and GOAWAY are its
    hooks (``_on_data``, ``_on_header_block``, ``_on_rst``, ``_on_goaway``), as are which ids
    name its streams (``_known``), sending what a stream holds (``_flush``), a stream's bad
    WINDOW_UPDATE and what a connection error does (``_connection_error``). Anything the
    protocol forbids raises :class:`~.frames.ConnectionError_` inside the read, which ends it.
    Frames are written through ``_write``, one transport write per loop iteration.

    Hooks are methods on ``self``, called once per frame at most: this is the server's hot
    path (every ext_proc message), and it allocates nothing per frame the copies did not.
    """

    _PUSH_ERROR: ClassVar[str]
    """The message of the connection error a PUSH_PROMISE is."""
    _PROTOCOL_ERROR_PREFIX: ClassVar[str] = ""
    """Put before a protocol error's message for ``_connection_error``."""
    _PREFACE_SIZE: ClassVar[int] = len(f.PREFACE) + 9
    """The bytes ``_read_preface`` needs to judge the peer's preface: the client's string and
    the header of its first frame, which must be SETTINGS (RFC 9113 §3.4)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._pending = bytearray()  # bytes of a frame (or the preface) not yet whole
        self._need = self._PREFACE_SIZE
        self._preface = False  # the peer's preface was read
        self._headers_open: _OpenBlock | None = None  # CONTINUATION pending
        self._max_header_block = MAX_HEADER_LIST
        """The largest header block read (HEADERS and its CONTINUATIONs)."""
        self._max_continuations = MAX_CONTINUATIONS
        """CONTINUATION frames after one HEADERS: more is a flood."""
        self._last_stream = 0  # the last stream the peer opened that we took (a client: none)
        self._streams: dict[int, S] = {}  # the open streams
        self._blocked: dict[int, S] = {}  # streams whose data waits for window
        self._send_window = f.DEFAULT_WINDOW  # the connection's, for what we send
        self._peer_window = f.DEFAULT_WINDOW  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self._peer_max_frame = f.DEFAULT_MAX_FRAME
        self._out: list[bytes] = []  # frames to send at the end of this loop iteration
        self._reading = False
        self._reads = 0  # reads so far (the server's idle sweep compares)
        self._yield = False  # set by a side whose read did enough: the rest waits (server)
        self._write_paused = False  # the transport's buffer is full: reading is paused
        self._kept = 0  # times a read ended inside a frame (the sweep's partial-frame clock)

    # -- the side's hooks ------------------------------------------------------------------

    def _on_data(self, stream: int, flags: int, payload: bytes) -> None:
        """A DATA frame, its padding still in (the windows count it)."""
        raise NotImplementedError

    def _on_header_block(self, stream: int, flags: int, block: bytes) -> None:
        """A whole header block (HEADERS and its CONTINUATIONs), padding and priority cut."""
        raise NotImplementedError

    def _on_rst(self, stream: int, payload: bytes) -> None:
        """A well-formed RST_STREAM (``payload``: its 4-byte code) on a stream other than 0."""
        raise NotImplementedError

    def _on_goaway(self, stream: int, payload: bytes) -> None:
        """A GOAWAY frame, as it came (each side checks what it reads of it)."""
        raise NotImplementedError

    def _on_setting(self, key: int, value: int) -> None:
        """A setting other than the initial window and the frame size (applied here)."""

    def _on_settings_frame(self, entries: int) -> None:
        """A SETTINGS frame (not an ACK) of ``entries`` settings, before any is applied: the
        server's budget (raises for a flood)."""

    def _on_ping(self) -> None:
        """A PING to answer: the server's budget (raises for a flood)."""

    def _on_glitch(self) -> None:
        """A frame that does nothing (empty DATA or CONTINUATION ending nothing, PRIORITY, an
        unknown type, an unsolicited PING ack): the server's budget (raises for a flood)."""

    def _settings_applied(self) -> None:
        """The peer's SETTINGS were applied (and acknowledged): windows may have grown."""
        self._flush_blocked()

    def _known(self, stream: int) -> S | None:
        """The open stream ``stream`` names; None for one already over. Raises for an id the
        peer may not send a frame on."""
        raise NotImplementedError

    def _flush(self, stream: S) -> object:
        """Send what ``stream`` holds, as far as the windows allow; it stays (or goes) in
        ``_blocked`` while some of it waits."""
        raise NotImplementedError

    def _bad_window_update(self, stream: S, code: int) -> None:
        """A WINDOW_UPDATE of 0 (``code`` PROTOCOL_ERROR) or one taking ``stream``'s window above
        2^31-1 (FLOW_CONTROL_ERROR): a stream error, the stream ends."""
        raise NotImplementedError

    def _connection_error(self, code: int, message: str) -> None:
        """End the connection with GOAWAY ``code``: the read hit a protocol error (or a bug)."""
        raise NotImplementedError

    def _log_bug(self) -> None:
        """Log the exception being handled, a bug of ours met in a read."""
        raise NotImplementedError

    # -- reads -----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._reads += 1
        if self._pending:
            self._pending += data
            if len(self._pending) < self._need:
                return
            data = bytes(self._pending)
            self._pending = bytearray()
        self._reading = True
        try:
            self._frames(data)
        except ConnectionError_ as exc:
            self._connection_error(exc.code, self._PROTOCOL_ERROR_PREFIX + str(exc))
        except hpack.HPACKError as exc:
            self._connection_error(f.COMPRESSION_ERROR, f"bad header block: {type(exc).__name__}")
        except Exception:
            # A bug of ours (or of a generic handler's lookup): this connection ends with
            # GOAWAY, as a protocol error would; escaping, it would make asyncio drop the
            # connection without one.
            self._log_bug()
            self._connection_error(f.INTERNAL_ERROR, "internal error")
        finally:
            self._reading = False
            self._uncork()

    def _frames(self, data: bytes) -> None:
        offset, size = 0, len(data)
        if not self._preface:  # once a connection, not per frame: the server's hot path
            if size < self._PREFACE_SIZE:
                self._keep(data, self._PREFACE_SIZE)
                return
            offset = self._read_preface(data)
            self._preface = True
        unpack = _unpack_header
        while size - offset >= 9:
            high, low, kind, flags, stream = unpack(data, offset)
            length = (high << 16) | low
            if length > f.DEFAULT_MAX_FRAME:
                raise ConnectionError_(f.FRAME_SIZE_ERROR, "frame above SETTINGS_MAX_FRAME_SIZE")
            end = offset + 9 + length
            if end > size:
                self._keep(data[offset:], 9 + length)
                return
            stream &= f.MAX_WINDOW  # the reserved bit is ignored (RFC 9113 §4.1)
            payload = data[offset + 9:end]
            offset = end
            if self._headers_open is not None and kind != f.CONTINUATION:
                raise ConnectionError_(f.PROTOCOL_ERROR, "a header block was not continued")
            if kind == f.DATA:
                self._on_data(stream, flags, payload)
            elif kind == f.HEADERS:
                self._on_headers(stream, flags, payload)
            elif kind == f.CONTINUATION:
                self._on_continuation(stream, flags, payload)
            elif kind == f.RST_STREAM:
                if stream == 0:
                    raise ConnectionError_(f.PROTOCOL_ERROR, "RST_STREAM on stream 0")
                if length != 4:  # RFC 9113 §6.4
                    raise ConnectionError_(f.FRAME_SIZE_ERROR, "a malformed RST_STREAM")
                self._on_rst(stream, payload)
            elif kind == f.SETTINGS:
                self._on_settings(stream, flags, payload)
            elif kind == f.WINDOW_UPDATE:
                self._on_window_update(stream, payload)
            elif kind == f.PING:
                if stream != 0:
                    raise ConnectionError_(f.PROTOCOL_ERROR, "PING on a stream")
                if length != 8:  # RFC 9113 §6.7
                    raise ConnectionError_(f.FRAME_SIZE_ERROR, "a malformed PING")
                if not flags & f.ACK:
                    self._on_ping()
                    self._write(f.frame(f.PING, f.ACK, 0, payload))
                else:  # the server sends no PING: an ACK answers nothing (the client's probe
                    self._on_glitch()  # is alive: data_received saw the read)
            elif kind == f.GOAWAY:
                if stream != 0:  # RFC 9113 §6.8
                    raise ConnectionError_(f.PROTOCOL_ERROR, "GOAWAY on a stream")
                if length < 8:  # RFC 9113 §4.2: a frame too short for its fields
                    raise ConnectionError_(f.FRAME_SIZE_ERROR, "a malformed GOAWAY")
                self._on_goaway(stream, payload)
            elif kind == f.PUSH_PROMISE:
                raise ConnectionError_(f.PROTOCOL_ERROR, self._PUSH_ERROR)
            elif kind == f.PRIORITY:
                if stream == 0:  # RFC 9113 §6.3
                    raise ConnectionError_(f.PROTOCOL_ERROR, "PRIORITY on stream 0")
                if length != 5:
                    self._priority_size(stream)
                self._on_glitch()
            else:
                self._on_glitch()  # unknown frame types are ignored (RFC 9113 §5.5)
            if self.closed:
                return
            if self._yield:  # enough work for one read: the rest waits a loop iteration
                self._yield_rest(data[offset:])
                return
        if offset < size:
            self._keep(data[offset:], 9)

    def _yield_rest(self, rest: bytes) -> None:
        """Leave ``rest`` (whole frames and perhaps a partial one) for the next iteration of
        the event loop, reading nothing more until then: other connections' work goes first."""
        self._pending = bytearray(rest)
        self._need = 0
        if self.transport is not None:
            self.transport.pause_reading()
        asyncio.get_running_loop().call_soon(self._resume_frames)

    def _resume_frames(self) -> None:
        self._yield = False
        if self.closed:
            return
        if self.transport is not None and not self._write_paused:
            self.transport.resume_reading()
        self.data_received(b"")

    def _read_preface(self, data: bytes) -> int:
        """Check the peer's preface at the start of ``data`` (at least ``_PREFACE_SIZE`` bytes);
        where its frames start. The server reads the client's (RFC 9113 §3.4), the string
        that says HTTP/2 and a SETTINGS frame (its header is checked here, its body read as
        any frame's)."""
        size = len(f.PREFACE)
        if data[:size] != f.PREFACE:
            raise ConnectionError_(f.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
        if data[size + 3] != f.SETTINGS or data[size + 4] & f.ACK:
            raise ConnectionError_(f.PROTOCOL_ERROR, "the client preface is not SETTINGS")
        return size

    def _priority_size(self, stream: int) -> None:
        """A PRIORITY frame of the wrong size: a stream error (RFC 9113 §6.3); the server
        resets that stream, the client ignores it."""

    def _keep(self, rest: bytes, need: int) -> None:
        self._pending = bytearray(rest)
        self._need = need
        self._kept += 1

    # -- frames ----------------------------------------------------------------------------

    def _on_headers(self, stream: int, flags: int, payload: bytes) -> None:
        fields = 5 if flags & f.PRIORITY_FLAG else 0
        if flags & f.PADDED:
            payload = f.unpad(payload, fields)
        if fields:
            if len(payload) < 5:
                raise ConnectionError_(f.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            payload = payload[5:]
        if flags & f.END_HEADERS:
            self._on_header_block(stream, flags, payload)
        else:
            if len(payload) > self._max_header_block:
                raise ConnectionError_(f.ENHANCE_YOUR_CALM, "header block too large")
            self._headers_open = _OpenBlock(stream, flags, bytearray(payload))

    def _on_continuation(self, stream: int, flags: int, payload: bytes) -> None:
        opened = self._headers_open
        if opened is None or opened.stream != stream:
            raise ConnectionError_(f.PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        opened.frames += 1
        if opened.frames > self._max_continuations:
            raise ConnectionError_(f.ENHANCE_YOUR_CALM, "too many CONTINUATION frames")
        if not payload and not flags & f.END_HEADERS:
            self._on_glitch()
        opened.block.extend(payload)
        if len(opened.block) > self._max_header_block:
            raise ConnectionError_(f.ENHANCE_YOUR_CALM, "header block too large")
        if flags & f.END_HEADERS:
            self._headers_open = None
            self._on_header_block(stream, opened.flags, bytes(opened.block))

    def _on_settings(self, stream: int, flags: int, payload: bytes) -> None:
        if stream != 0:
            raise ConnectionError_(f.PROTOCOL_ERROR, "SETTINGS on a stream")
        if len(payload) % 6:  # RFC 9113 §6.5
            raise ConnectionError_(f.FRAME_SIZE_ERROR, "a malformed SETTINGS")
        if flags & f.ACK:
            if payload:
                raise ConnectionError_(f.FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            return
        self._on_settings_frame(len(payload) // 6)
        for at in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, at)
            if key == f.SETTINGS_INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise ConnectionError_(f.FLOW_CONTROL_ERROR, "window above 2^31-1")
                delta, self._peer_window = value - self._peer_window, value
                for open_stream in self._streams.values():
                    open_stream.send_window += delta
                    if open_stream.send_window > f.MAX_WINDOW:  # RFC 9113 §6.9.2
                        raise ConnectionError_(f.FLOW_CONTROL_ERROR,
                                               "a stream's window above 2^31-1")
            elif key == f.SETTINGS_MAX_FRAME_SIZE:
                if not f.DEFAULT_MAX_FRAME <= value <= 0xFFFFFF:
                    raise ConnectionError_(f.PROTOCOL_ERROR, "a bad SETTINGS_MAX_FRAME_SIZE")
                self._peer_max_frame = value
            else:
                self._on_setting(key, value)
        self._write(f.frame(f.SETTINGS, f.ACK, 0))
        self._settings_applied()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(f.FRAME_SIZE_ERROR, "a malformed WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & f.MAX_WINDOW
        if stream_id == 0:
            if increment == 0:
                raise ConnectionError_(f.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > f.MAX_WINDOW:
                raise ConnectionError_(f.FLOW_CONTROL_ERROR, "window above 2^31-1")
            self._flush_blocked()
            return
        stream = self._known(stream_id)
        if stream is None:
            return
        if increment == 0 or stream.send_window + increment > f.MAX_WINDOW:
            self._bad_window_update(stream, f.PROTOCOL_ERROR if increment == 0
                                    else f.FLOW_CONTROL_ERROR)
            return
        stream.send_window += increment
        if stream_id in self._blocked:
            self._flush(stream)

    def _data_frames(self, stream: S, out: bytes | bytearray,
                     end_stream: bool) -> tuple[list[bytes], int]:
        """DATA frames of as much of ``out`` as ``stream``'s and the connection's windows and the
        peer's frame size allow, the windows charged; with ``end_stream``, the frame that ends
        ``out`` ends the stream. And how many bytes of ``out`` they carry."""
        chunks: list[bytes] = []
        at, total = 0, len(out)
        while at < total:
            size = min(total - at, stream.send_window, self._send_window, self._peer_max_frame)
            if size <= 0:
                break
            last = end_stream and at + size == total
            chunks.append(f.frame(f.DATA, f.END_STREAM if last else 0, stream.id,
                                  bytes(out[at:at + size])))
            at += size
            stream.send_window -= size
            self._send_window -= size
        return chunks, at

    def _flush_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self._send_window <= 0:
                return
            self._flush(stream)

    # -- writes ----------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Queue ``data`` for one write at the end of this loop iteration: what the calls that
        woke in the same iteration send (several streams' messages arrive in one read under
        load; a batcher starts several calls at once) leaves in one ``send`` instead of one
        each, the syscall being a fifth of a message's CPU. Within a read, at the end of the
        read."""
        out = self._out
        out.append(data)
        if len(out) == 1 and not self._reading:
            asyncio.get_running_loop().call_soon(self._uncork)

    def _send_goaway(self, code: int, message: str = "") -> None:
        """GOAWAY with ``code``, ``message`` (its first 200 bytes) as its debug data."""
        self._write(f.goaway(self._last_stream, code, message.encode()[:200]))

    def _uncork(self) -> None:
        out = self._out
        if not out:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
