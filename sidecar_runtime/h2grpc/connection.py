"""One HTTP/2 connection of the gRPC server (RFC 9113, the server side, as gRPC uses it).

Frames are parsed straight off ``data_received`` by :class:`~.peer.H2Peer`, the mechanics the
client shares; here is what the server does with them. Each stream is a :class:`~.call.Call`.
Flow control both ways: the server grants a large window and tops a stream's up as its handler
takes the messages (a message above the service's limit is refused by the call, so one stream
holds at most its window and one message); what it sends waits for the client's windows and
frame size. Anything the protocol forbids ends the connection with GOAWAY and the error's code.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, cast

import grpc

from sidecar_runtime.h2grpc import frames as f
from sidecar_runtime.h2grpc.call import Call
from sidecar_runtime.h2grpc.frames import ConnectionError_
from sidecar_runtime.h2grpc.head import head_decoder
from sidecar_runtime.h2grpc.peer import H2Peer
from sidecar_runtime.logs import get_logger

if TYPE_CHECKING:
    from sidecar_runtime.h2grpc.server import Server

log = get_logger("sidecar_runtime.h2grpc")

RECEIVE_WINDOW = 4 * 1024 * 1024
"""Each stream's window, granted in SETTINGS and topped up when half is used."""
CONNECTION_WINDOW = 16 * 1024 * 1024
DRAIN_LINGER_S = 0.2
"""How long a drained connection is still read (new streams refused) before it closes."""


class Connection(H2Peer[Call]):
    """The server side of one HTTP/2 connection."""

    _PUSH_ERROR = "a client cannot push"

    def __init__(self, server: Server) -> None:
        super().__init__()
        self._server = server
        self.peer = ""
        self._heads = head_decoder(server.heads)
        self._tasks = 0
        self._received = 0  # connection-level bytes since the last WINDOW_UPDATE
        self._draining = False
        self._linger: asyncio.TimerHandle | None = None  # the close after a drain

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        self.peer = _peer_name(transport)
        self._server.connection_opened(self)
        self.transport.write(f.settings({f.SETTINGS_HEADER_TABLE_SIZE: 0,
                                         f.SETTINGS_ENABLE_PUSH: 0,
                                         f.SETTINGS_MAX_CONCURRENT_STREAMS:
                                             self._server.max_concurrent_streams,
                                         f.SETTINGS_INITIAL_WINDOW_SIZE: RECEIVE_WINDOW})
                             + f.window_update(0, CONNECTION_WINDOW - f.DEFAULT_WINDOW))

    def pause_writing(self) -> None:
        """The client stopped reading (the transport's buffer passed its high-water mark): stop
        reading from it too, so that what it sends (PINGs, new calls) cannot make the answers
        pile up here without bound. Calls in flight keep their buffered answers."""
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._linger is not None:
            self._linger.cancel()
        calls = list(self._streams.values())
        self._streams.clear()
        self._blocked.clear()
        for call in calls:
            call.reset()
        self._server.connection_closed(self)

    # -- frames ----------------------------------------------------------------------------

    def _on_data(self, stream: int, flags: int, payload: bytes) -> None:
        if stream == 0:
            raise ConnectionError_(f.PROTOCOL_ERROR, "DATA on stream 0")
        counted = len(payload)
        if flags & f.PADDED:
            payload = f.unpad(payload)
        self._received += counted
        if self._received >= CONNECTION_WINDOW // 2:
            self._write(f.window_update(0, self._received))
            self._received = 0
        call = self._streams.get(stream)
        if call is None or call.input_ended:
            if stream > self._last_stream:
                raise ConnectionError_(f.PROTOCOL_ERROR, "DATA on an idle stream")
            return  # a stream already answered or reset: its data is dropped
        if payload:
            problem = call.receive(payload)
            if problem is not None:
                call.fail(*problem)
                return
        if flags & f.END_STREAM:
            problem = call.end_input()
            if problem is not None:
                call.fail(*problem)
                return
        else:
            call.recv_unacked += counted
            if not call.has_message:  # else granted as the handler takes them (consumed)
                self.consumed(call)
        if call.task is None and (call.has_message or call.input_ended):
            self._start(call)

    def consumed(self, call: Call) -> None:
        """No whole message of ``call`` waits for its handler: give the client back the window
        its data used. Granted as the handler reads, not as data arrives, a stream holds at
        most its window (and one message) of data its handler has not taken."""
        if call.recv_unacked >= RECEIVE_WINDOW // 2 and not call.finished \
                and not call.input_ended:
            self._write(f.window_update(call.id, call.recv_unacked))
            call.recv_unacked = 0

    def _on_headers(self, stream: int, flags: int, payload: bytes) -> None:
        if stream == 0 or stream % 2 == 0:
            raise ConnectionError_(f.PROTOCOL_ERROR, "HEADERS on a server stream id")
        super()._on_headers(stream, flags, payload)

    def _on_header_block(self, stream: int, flags: int, block: bytes) -> None:
        head = self._heads.decode(block)
        call = self._streams.get(stream)
        if call is not None:  # trailers of the request
            if not flags & f.END_STREAM:
                raise ConnectionError_(f.PROTOCOL_ERROR, "trailers without END_STREAM")
            problem = call.end_input()
            if problem is not None:
                call.fail(*problem)
            elif call.task is None:
                self._start(call)
            return
        if stream <= self._last_stream:
            self._write(f.rst_stream(stream, f.STREAM_CLOSED))
            return
        self._last_stream = stream
        if self._draining or len(self._streams) >= self._server.max_concurrent_streams:
            # Past the advertised limit (RFC 9113 §5.1.2), e.g. sent before the client read
            # our SETTINGS: refused, which a client may retry (Envoy does, on another
            # connection). Each open call holds a task and up to a window of input.
            self._write(f.rst_stream(stream, f.REFUSED_STREAM))
            return
        if head.malformed:  # a stream error (RFC 9113 §8.2.1): this stream only
            self._write(f.rst_stream(stream, f.PROTOCOL_ERROR))
            return
        method, path, metadata = head.method, head.path, head.metadata
        ended = bool(flags & f.END_STREAM)
        if method != "POST" or not head.content_type.startswith("application/grpc"):
            status = "405" if method != "POST" else "415"
            self._write(f.headers(stream, f.literal(":status", status), end_stream=True))
            if not ended:
                self._write(f.rst_stream(stream, f.NO_ERROR))
            return
        handler = self._server.handler(path, metadata)
        if handler is None:
            self._write(f.headers(stream, f.RESPONSE_HEADERS + f.trailers(
                grpc.StatusCode.UNIMPLEMENTED.value[0], f"Method not found: {path}"),
                end_stream=True))
            if not ended:
                self._write(f.rst_stream(stream, f.NO_ERROR))
            return
        call = Call(stream, path, self, handler, metadata, head.timeout_s, self._peer_window,
                    self._server.max_receive_message_length)
        self._streams[stream] = call
        if ended:
            call.end_input()
        if handler.request_streaming or ended:
            self._start(call)

    def _on_rst(self, stream: int, payload: bytes) -> None:
        call = self._streams.pop(stream, None)
        self._blocked.pop(stream, None)
        if call is not None:
            call.reset()
            # Its handler may be done already (an answer that waited for window): no call_done
            # is coming to close a draining connection.
            self._close_if_drained()

    def _on_goaway(self, stream: int, payload: bytes) -> None:
        pass  # the client opens no new stream; the ones open finish

    def _known(self, stream: int) -> Call | None:
        return self._streams.get(stream)

    def _bad_window_update(self, call: Call, code: int) -> None:
        self.reset_stream(call, code)
        call.reset()

    # -- answers ---------------------------------------------------------------------------

    def send(self, call: Call, data: bytes, trailers: bytes | None) -> bool:
        """Send ``data`` (whole gRPC messages) on ``call``'s stream, then ``trailers`` (a header
        block) if given; False while some of it waits for the client's window."""
        if call.finished:
            return True
        stream = call.id
        head = b""
        if not call.headers_sent:
            call.headers_sent = True
            if not data and trailers is not None:  # trailers-only
                self._write(f.headers(stream, f.RESPONSE_HEADERS + trailers, end_stream=True))
                self._ended(call)
                return True
            head = f.frame(f.HEADERS, f.END_HEADERS, stream, f.RESPONSE_HEADERS)
        size = len(data)
        if not call.out and size <= call.send_window and size <= self._send_window \
                and size <= self._peer_max_frame:
            out = head
            if size:
                out += f.frame(f.DATA, 0, stream, data)
                call.send_window -= size
                self._send_window -= size
            if trailers is not None:
                out += f.headers(stream, trailers, end_stream=True)
            self._write(out)
            if trailers is not None:
                self._ended(call)
            return True
        if head:
            self._write(head)
        call.out += data
        if trailers is not None:
            call.trailers_out = trailers
        return self._flush(call)

    def _flush(self, call: Call) -> bool:
        out, stream = call.out, call.id
        chunks, taken = self._data_frames(call, out, end_stream=False)
        del out[:taken]
        ended = False
        if not out and call.trailers_out is not None:
            chunks.append(f.headers(stream, call.trailers_out, end_stream=True))
            call.trailers_out = None
            ended = True
        if chunks:
            self._write(b"".join(chunks))
        if out:
            self._blocked[stream] = call
            return False
        self._blocked.pop(stream, None)
        if ended:
            self._ended(call)
        call.flushed()
        return True

    def _ended(self, call: Call) -> None:
        """The answer's END_STREAM went out: the stream is done on our side."""
        call.finished = True
        if not call.input_ended:
            # The client has not half-closed: tell it to stop sending (what gRPC servers do).
            self._write(f.rst_stream(call.id, f.NO_ERROR))
        self._streams.pop(call.id, None)
        self._blocked.pop(call.id, None)
        self._close_if_drained()

    def reset_stream(self, call: Call, code: int) -> None:
        """Reset ``call``'s stream from our side (a call cut short)."""
        if call.finished:
            return
        call.finished = True
        self._write(f.rst_stream(call.id, code))
        self._streams.pop(call.id, None)
        self._blocked.pop(call.id, None)
        self._close_if_drained()

    # -- calls and the server --------------------------------------------------------------

    def _start(self, call: Call) -> None:
        self._tasks += 1
        self._server.call_started()
        task = asyncio.get_running_loop().create_task(call.run())
        call.task = task
        # Counted done by a callback, not in run(): a task cancelled before its first step (its
        # stream reset in the same read as its HEADERS) never runs any of run(), its finally
        # included, and would hold the drain (and the server's count of calls) for good.
        task.add_done_callback(call.task_done)

    def call_done(self, call: Call) -> None:
        self._tasks -= 1
        self._server.call_ended()
        self._close_if_drained()

    def _close_if_drained(self) -> None:
        # Open calls, not only tasks: a unary call whose HEADERS came without its message has
        # no task yet, and GOAWAY told the client it was taken. (A blocked answer's call is
        # open too, until its END_STREAM goes out.)
        if self._draining and self._tasks == 0 and not self._streams and self._linger is None:
            # Not at once: a HEADERS the client sent before it read our GOAWAY may be on its
            # way. Closing with it unread makes the kernel reset the connection, and the
            # client may lose the GOAWAY and fail that request; read for a moment, refusing
            # such streams (REFUSED_STREAM: the client may retry them elsewhere), then close.
            self._linger = asyncio.get_running_loop().call_later(DRAIN_LINGER_S, self._close)

    def drain(self) -> None:
        """GOAWAY: no new stream; the connection closes once its calls are done."""
        if self._draining or self.closed:
            return
        self._draining = True
        self._send_goaway(f.NO_ERROR)
        self._close_if_drained()

    def cancel_calls(self) -> None:
        """The grace period is over: cut every call still running."""
        for call in list(self._streams.values()):
            if call.task is not None and not call.task.done():
                call.task.cancel()
        self._close()

    def _log_bug(self) -> None:
        log.exception("h2_connection_error", peer=self.peer)

    def _connection_error(self, code: int, message: str) -> None:
        self._send_goaway(code, message)
        self._close()

    def _close(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
        self._uncork()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self.closed = True


def _peer_name(transport: asyncio.BaseTransport) -> str:
    """grpc's peer string: ``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5`` or ``unix:/path``."""
    address: Any = transport.get_extra_info("peername")
    if isinstance(address, tuple) and len(address) >= 2:
        host = str(address[0])
        return f"ipv6:[{host}]:{address[1]}" if ":" in host else f"ipv4:{host}:{address[1]}"
    sockname = transport.get_extra_info("sockname")
    return f"unix:{sockname}" if isinstance(sockname, str) else "unix:"
