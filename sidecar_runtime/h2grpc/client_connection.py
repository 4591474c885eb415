"""One HTTP/2 connection of the gRPC client (RFC 9113, the client side, unary calls only).

Frames are parsed straight off ``data_received`` by :class:`~.peer.H2Peer`, as the server's
are (:mod:`.connection`); each call is a :class:`ClientStream` whose answer resolves one future.
The client honours the server's SETTINGS (frame size, initial window, concurrent streams: a call
waits for a free stream rather than exceed them), sends within the server's stream and connection windows and
grants back what it receives. Its header blocks are HPACK literals without indexing
(:func:`.frames.literal`), so it keeps no encoder state; the server's blocks are decoded with
``hpack``, and a block that cannot depend on the dynamic table is looked up once decoded.

A protocol error by the server, or the connection's loss, fails every call on it at once;
calls above a GOAWAY's last stream fail ``retryable`` (the server never saw them).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import cast

from sidecar_runtime.h2grpc import frames as f
from sidecar_runtime.h2grpc.client_stream import ClientStream, block_decoder, timeout_value
from sidecar_runtime.h2grpc.frames import ConnectionError_
from sidecar_runtime.h2grpc.head import MAX_HEADER_LIST
from sidecar_runtime.h2grpc.peer import H2Peer
from sidecar_runtime.h2grpc.status import RpcError, StatusCode, reset_error
from sidecar_runtime.process.logs import get_logger

log = get_logger("sidecar_runtime.h2grpc")

MAX_STREAM_ID = 0x7FFF_FFFF
PROBE_TIMEOUT_S = 2.0
"""A call expired while the server sent nothing at all: it is PINGed, and the connection is
given up (its calls fail UNAVAILABLE) if it sends nothing in this time. Else a server host
that vanished without a reset (a pod gone behind a service address) would hold the connection,
and every later call would miss its deadline."""
_TABLE_SIZE_ZERO = b"\x20"
"""An HPACK dynamic table size update to 0 (RFC 7541 §6.3), first in the connection's first
block: our blocks never use the table, and a server (ours) that caches decoded blocks needs to
see the table at 0 to trust a repeated block."""


class ClientConnection(H2Peer[ClientStream]):
    """The client side of one HTTP/2 connection; :meth:`call` runs one unary call on it."""

    _PUSH_ERROR = "a push, which the client disabled"
    _PROTOCOL_ERROR_PREFIX = "HTTP/2 protocol error: "
    _PREFACE_SIZE = 9

    def __init__(self, *, receive_window: int, max_receive: int) -> None:
        super().__init__()
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Resolved once the transport is closed."""
        self._loop = asyncio.get_running_loop()
        self._window = receive_window
        self._connection_window = max(f.DEFAULT_WINDOW, 4 * receive_window)
        self._max_receive = max_receive
        self._decoder = block_decoder()
        self._waiting: deque[asyncio.Future[None]] = deque()  # calls waiting for a stream
        self._next_id = 1
        self._max_streams = MAX_STREAM_ID
        self._received = 0  # connection-level bytes not yet granted back
        self._recv_credit = self._connection_window
        self._goaway = False
        self._first_block = True
        self._last_read = self._loop.time()
        self._probe: asyncio.TimerHandle | None = None

    @property
    def usable(self) -> bool:
        """New calls may start here (not closed, no GOAWAY, stream ids left)."""
        return not self.closed and not self._goaway and self._next_id <= MAX_STREAM_ID

    # -- calls -----------------------------------------------------------------------------

    async def call(self, head: bytes, data: bytes, deadline: float) -> bytes:
        """Send ``head`` (the call's header block, ``grpc-timeout`` added here) and ``data``
        (its message, framed); the answer's message. Raises :class:`RpcError`."""
        loop = self._loop
        while len(self._streams) >= self._max_streams and self.usable:
            waiter = loop.create_future()
            self._waiting.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                raise RpcError(StatusCode.DEADLINE_EXCEEDED,
                               "Deadline Exceeded (waiting for a free stream)") from None
            finally:
                if not waiter.done():
                    self._waiting.remove(waiter)
        if not self.usable:
            raise RpcError(StatusCode.UNAVAILABLE, "the connection is going away",
                           retryable=True)
        now = loop.time()
        if now >= deadline:
            raise RpcError(StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        stream = ClientStream(self._next_id, loop.create_future(), self._peer_window,
                              self._window, self._max_receive, now)
        self._next_id += 2
        self._streams[stream.id] = stream
        block = head + f.literal("grpc-timeout", timeout_value(deadline - now))
        if self._first_block:
            self._first_block = False
            block = _TABLE_SIZE_ZERO + block
        self._write(f.headers(stream.id, block, end_stream=False))
        stream.out = data
        self._flush(stream)
        stream.timer = loop.call_at(deadline, self._expire, stream)
        try:
            return await stream.waiter
        except asyncio.CancelledError:
            if self._streams.get(stream.id) is stream:  # the caller was cancelled
                self._reset(stream, f.CANCEL, None)
            raise

    def _flush(self, stream: ClientStream) -> None:
        chunks, taken = self._data_frames(stream, stream.out, end_stream=True)
        out = stream.out = stream.out[taken:]
        if chunks:
            self._write(b"".join(chunks))
        if out:
            self._blocked[stream.id] = stream
        else:
            self._blocked.pop(stream.id, None)

    def _end(self, stream: ClientStream, result: bytes | RpcError) -> None:
        """The call is over: its stream leaves, its waiter gets ``result``."""
        if self._streams.pop(stream.id, None) is None:
            return
        self._blocked.pop(stream.id, None)
        if stream.timer is not None:
            stream.timer.cancel()
        waiter = stream.waiter
        if not waiter.done():
            if isinstance(result, RpcError):
                waiter.set_exception(result)
            else:
                waiter.set_result(result)
        self._wake(everyone=False)
        if self._goaway and not self._streams:
            self.close()

    def _wake(self, everyone: bool) -> None:
        """Let the first call waiting for a stream go (one stream is free), or all of them
        (each checks again whether it may start)."""
        waiting = self._waiting
        while waiting:
            waiter = waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                if not everyone:
                    return

    def _reset(self, stream: ClientStream, code: int, error: RpcError | None) -> None:
        self._write(f.rst_stream(stream.id, code))
        self._end(stream, error or RpcError(StatusCode.CANCELLED, "cancelled"))

    def _expire(self, stream: ClientStream) -> None:
        stream.timer = None
        self._reset(stream, f.CANCEL, RpcError(StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
        if self._last_read < stream.started and self._probe is None and not self.closed:
            self._write(f.frame(f.PING, 0, 0, b"\0" * 8))
            self._probe = self._loop.call_later(PROBE_TIMEOUT_S, self._unresponsive)

    def _unresponsive(self) -> None:
        self._probe = None
        self._fail(f.NO_ERROR, RpcError(StatusCode.UNAVAILABLE,
                                        "the server stopped answering (PING unanswered)"),
                   abort=True)

    # -- the transport ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(
            f.PREFACE
            + f.settings({f.SETTINGS_ENABLE_PUSH: 0, f.SETTINGS_HEADER_TABLE_SIZE: 0,
                          f.SETTINGS_INITIAL_WINDOW_SIZE: self._window,
                          f.SETTINGS_MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST})
            + f.window_update(0, self._connection_window - f.DEFAULT_WINDOW))

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc else ""
        self._close_calls(RpcError(StatusCode.UNAVAILABLE, f"the connection was lost{reason}"))
        if not self.done.done():
            self.done.set_result(None)

    def _close_calls(self, error: RpcError) -> None:
        self.closed = True
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        for stream in list(self._streams.values()):
            self._end(stream, error)
        self._wake(everyone=True)  # they see the connection unusable: retryable

    def close(self, error: RpcError | None = None) -> None:
        """Close (GOAWAY, then the transport); calls still open fail with ``error``."""
        if self.closed:
            return
        self._send_goaway(f.NO_ERROR)
        self._uncork()
        self._close_calls(error or RpcError(StatusCode.UNAVAILABLE, "the connection was closed"))
        if self.transport is not None:
            self.transport.close()

    def _fail(self, code: int, error: RpcError, abort: bool = False) -> None:
        """A connection error: GOAWAY with ``code``, then close (``abort``: without waiting to
        send what is buffered, for a peer that reads nothing)."""
        if self.closed:
            return
        self._send_goaway(code, error.details)
        self._uncork()
        self._close_calls(error)
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._last_read = self._loop.time()
        if self._probe is not None:  # it answered: alive
            self._probe.cancel()
            self._probe = None
        super().data_received(data)

    def _read_preface(self, data: bytes) -> int:
        """The server's preface is a SETTINGS frame: its first frame must be one (an oversized
        one is the frame loop's FRAME_SIZE_ERROR, as any frame's)."""
        if int.from_bytes(data[:3], "big") <= f.DEFAULT_MAX_FRAME and data[3] != f.SETTINGS:
            raise ConnectionError_(f.PROTOCOL_ERROR, "the server preface is not SETTINGS")
        return 0

    def _connection_error(self, code: int, message: str) -> None:
        self._fail(code, RpcError(StatusCode.INTERNAL, message))

    def _log_bug(self) -> None:  # this connection's calls fail, the loop goes on
        log.exception("h2_client_connection_error")

    # -- frames ----------------------------------------------------------------------------

    def _known(self, stream: int) -> ClientStream | None:
        """The open call on ``stream``; None for one already over. A stream the client never
        opened is a connection error."""
        if stream == 0 or stream % 2 == 0 or stream >= self._next_id:
            raise ConnectionError_(f.PROTOCOL_ERROR, f"a frame on stream {stream}, not opened")
        return self._streams.get(stream)

    def _on_data(self, stream_id: int, flags: int, payload: bytes) -> None:
        counted = len(payload)
        self._recv_credit -= counted
        if self._recv_credit < 0:
            raise ConnectionError_(f.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._received += counted
        if self._received >= self._connection_window // 2:
            self._write(f.window_update(0, self._received))
            self._recv_credit += self._received
            self._received = 0
        stream = self._known(stream_id)
        if stream is None:
            return  # a call already over (expired, cancelled): its data is dropped
        if flags & f.PADDED:
            payload = f.unpad(payload)
        outcome = stream.on_data(payload, counted, bool(flags & f.END_STREAM))
        if outcome is not None:
            self._outcome(stream, outcome)
        elif stream.recv_unacked >= self._window // 2:
            self._write(f.window_update(stream.id, stream.recv_unacked))
            stream.recv_credit += stream.recv_unacked
            stream.recv_unacked = 0

    def _on_header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        fields = self._decoder.decode(block)  # first: decoding may change the HPACK table
        stream = self._known(stream_id)
        if stream is not None:
            outcome = stream.on_block(fields, bool(flags & f.END_STREAM))
            if outcome is not None:
                self._outcome(stream, outcome)

    def _outcome(self, stream: ClientStream, outcome: tuple[int | None, bytes | RpcError]) -> None:
        code, result = outcome
        if code is not None:
            self._write(f.rst_stream(stream.id, code))
        self._end(stream, result)

    def _on_rst(self, stream: int, payload: bytes) -> None:
        found = self._streams.get(stream)
        if found is not None:
            self._end(found, reset_error(int.from_bytes(payload, "big")))

    def _on_settings(self, stream: int, flags: int, payload: bytes) -> None:
        if flags & f.ACK and payload:
            raise ConnectionError_(f.PROTOCOL_ERROR, "a malformed SETTINGS")
        super()._on_settings(stream, flags, payload)

    def _on_setting(self, key: int, value: int) -> None:
        if key == f.SETTINGS_MAX_CONCURRENT_STREAMS:
            self._max_streams = value

    def _settings_applied(self) -> None:
        self._wake(everyone=True)
        self._flush_blocked()

    def _bad_window_update(self, stream: ClientStream, code: int) -> None:
        self._reset(stream, code, RpcError(StatusCode.INTERNAL,
                                           "a bad WINDOW_UPDATE from the server"))

    def _on_goaway(self, stream: int, payload: bytes) -> None:
        """No new call here; those above the last stream it names were not seen (retryable),
        the others end as the server answers them."""
        if stream != 0 or len(payload) < 8:
            raise ConnectionError_(f.PROTOCOL_ERROR, "a malformed GOAWAY")
        last = int.from_bytes(payload[:4], "big") & MAX_STREAM_ID
        self._goaway = True
        for unseen in [s for s in self._streams.values() if s.id > last]:
            self._end(unseen, RpcError(StatusCode.UNAVAILABLE,
                                       "the server is going away (GOAWAY)", retryable=True))
        self._wake(everyone=True)
        if not self._streams:
            self.close()
