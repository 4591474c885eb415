"""One HTTP/2 connection of the gRPC server (RFC 9113, the server side, as gRPC uses it).

Frames are parsed straight off ``data_received`` by :class:`~.peer.H2Peer`, the mechanics the
client shares; here is what the server does with them. Each stream is a :class:`~.call.Call`.

Flow control both ways. Receiving, both windows are enforced (DATA past a stream's window
resets it, past the connection's ends the connection, FLOW_CONTROL_ERROR) and given back only
as bytes are released: a stream's as its handler takes the messages (or while it has no whole
message waiting, so a message larger than the window can arrive), the connection's as the
bytes its calls hold (messages waiting for handlers, each with its overhead, and partial ones)
drop, so one connection never holds more than its buffer (:meth:`.limits.Limits.buffer_for`).
Should partial messages alone fill it (no handler can make progress), the call holding the
largest is failed RESOURCE_EXHAUSTED. What the server sends waits for the client's windows and
frame size.

Anything the protocol forbids ends the connection with GOAWAY and the error's code; a flood
(PING, SETTINGS, premature RST_STREAM, frames that do nothing: :mod:`.limits`) with GOAWAY
``ENHANCE_YOUR_CALM``. The server's sweep (:meth:`tick`) ends connections that do not finish
their handshake or a header block in time, and idle ones.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, cast

import grpc

from sidecar_runtime.h2grpc import frames as f
from sidecar_runtime.h2grpc.call import Call
from sidecar_runtime.h2grpc.frames import ConnectionError_
from sidecar_runtime.h2grpc.head import head_decoder
from sidecar_runtime.h2grpc.limits import Budget
from sidecar_runtime.h2grpc.peer import H2Peer
from sidecar_runtime.process.logs import get_logger

if TYPE_CHECKING:
    from sidecar_runtime.h2grpc.server import Server

log = get_logger("sidecar_runtime.h2grpc")

SKIPPED_RANGES = 64
"""Ranges of stream ids the client skipped (never opened) remembered: HEADERS on one of them is
a connection error; on a lower id it did open (it ended: the client had not seen our
END_STREAM or RST_STREAM yet) it resets that stream. Older gaps count as opened."""
FIELDS_PER_READ = 2_000
"""Header fields decoded before a read yields the event loop (a few ms of hpack)."""
DRAIN_LINGER_S = 0.2
"""How long a drained connection is still read (new streams refused) before it closes."""


class Connection(H2Peer[Call]):
    """The server side of one HTTP/2 connection."""

    _PUSH_ERROR = "a client cannot push"

    def __init__(self, server: Server) -> None:
        super().__init__()
        self._server = server
        self.peer = ""
        limits = self._limits = server.limits
        self._max_header_block = limits.max_header_list
        self._max_continuations = limits.max_continuations
        self._max_fields = limits.max_header_fields
        self._max_head_bytes = limits.header_bytes
        self._heads = head_decoder(server.heads, server.heads_bytes,
                                   max_list=limits.max_header_list,
                                   max_bytes=limits.heads_cache_bytes)
        self._tasks = 0
        self._window = limits.stream_window  # each stream's receive window
        self._buffer = server.connection_buffer  # the most the calls may hold
        self._refill_at = max(1, self._buffer // 4)
        self._refill_below = self._buffer - self._refill_at
        """The client's window at or below which what the calls released is given back."""
        self.starved = False
        """The client's window is low and was not refilled: released bytes refill it."""
        self.grant_at = self._window // 2
        """A stream's window is given back once this much of it was used and taken."""
        self._recv_window = f.DEFAULT_WINDOW  # what the client may still send, all streams
        self._head_bytes = 0  # what the open calls' request heads hold
        self._fields_read = 0  # header fields decoded since the last yield
        self._calls = 0  # calls this connection has carried
        self._skipped: list[tuple[int, int]] = []  # ids never opened: [low, high) ranges
        self._premature = 0  # of which the client reset before their answer began
        self._pings = Budget(limits.pings)
        self._settings_budget = Budget(limits.settings)
        self._resets = Budget(limits.premature_resets)
        self._glitches = Budget(limits.glitches)
        self._draining = False
        self._linger: asyncio.TimerHandle | None = None  # the close after a drain
        now = time.monotonic()
        self._opened_at = now
        self._active_at = now  # the last sweep that saw a frame or an open stream
        self._reads_seen = 0
        self._kept_seen = 0
        self._partial_since = now  # when the sweep first saw the frame now partial

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        self.peer = _peer_name(transport)
        accepted = self._server.connection_opened(self)
        self._recv_window = self._buffer
        self.transport.write(f.settings({f.SETTINGS_HEADER_TABLE_SIZE: 0,
                                         f.SETTINGS_ENABLE_PUSH: 0,
                                         f.SETTINGS_MAX_CONCURRENT_STREAMS:
                                             self._server.max_concurrent_streams,
                                         f.SETTINGS_INITIAL_WINDOW_SIZE: self._window,
                                         f.SETTINGS_MAX_HEADER_LIST_SIZE:
                                             self._limits.max_header_list})
                             + f.window_update(0, self._buffer - f.DEFAULT_WINDOW))
        if not accepted:
            log.warning("h2_connection_refused", peer=self.peer, reason="too many connections",
                        limit=self._limits.max_connections)
            self._end(f.ENHANCE_YOUR_CALM, "too many connections", "too_many_connections")

    def pause_writing(self) -> None:
        """The client stopped reading (the transport's buffer passed its high-water mark): stop
        reading from it too, so that what it sends (PINGs, new calls) cannot make the answers
        pile up here without bound. Calls in flight keep their buffered answers."""
        self._write_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self.transport is not None and not self.closed and not self._yield:
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
        window = self._recv_window - counted
        if window < 0:  # RFC 9113 §6.9.1
            raise ConnectionError_(f.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._recv_window = window
        if flags & f.PADDED:
            payload = f.unpad(payload)
        call = self._streams.get(stream)
        if call is None or call.input_ended:
            if stream > self._last_stream:
                raise ConnectionError_(f.PROTOCOL_ERROR, "DATA on an idle stream")
            if window <= self._refill_below:  # dropped: a stream already answered or reset
                self._refill()
            return
        unacked = call.recv_unacked + counted
        if unacked > self._window:  # a stream error (RFC 9113 §6.9.1): that stream ends
            self.reset_stream(call, f.FLOW_CONTROL_ERROR)
            call.reset()
            if window <= self._refill_below:
                self._refill()
            return
        if payload:
            problem = call.receive(payload)
            if problem is not None:
                call.fail(*problem)
                return
        elif not flags & f.END_STREAM:
            self._on_glitch()
        if flags & f.END_STREAM:
            problem = call.end_input()
            if problem is not None:
                call.fail(*problem)
                return
        else:
            call.recv_unacked = unacked
            if not call.has_message:  # else granted as the handler takes them (taken)
                self._grant(call)
        if window <= self._refill_below:
            self._refill()
        if not call.started and (call.has_message or call.input_ended):
            self._start(call)

    def taken(self, call: Call) -> None:
        """``call``'s handler took the last message waiting, and its stream has window to give
        back or the connection is short of it (:attr:`starved`)."""
        if call.finished:
            return  # forgotten: what it held went with it
        self._grant(call)
        if self.starved:
            self._refill()

    def _grant(self, call: Call) -> None:
        """No whole message of ``call`` waits for its handler: give the client back the window
        its data used. Granted as the handler reads, not as data arrives, a stream holds at
        most its window (and one message) of data its handler has not taken."""
        if call.recv_unacked >= self.grant_at and not call.finished \
                and not call.input_ended:
            self._write(f.window_update(call.id, call.recv_unacked))
            call.recv_unacked = 0

    def held(self) -> int:
        """What the calls hold for their handlers: messages waiting (each with its overhead)
        and partial ones. Summed when asked (the window runs low), not kept per message."""
        return sum(call.held for call in self._streams.values())

    def _refill(self) -> None:
        """The client's connection window ran low: give it back what the calls released, so
        that what they hold plus what the client may still send stays within the buffer."""
        held = self.held()
        grant = self._buffer - held - self._recv_window
        if grant >= self._refill_at or (grant > 0 and self._recv_window < f.DEFAULT_MAX_FRAME):
            self._recv_window += grant
            self._write(f.window_update(0, grant))
        self.starved = self._recv_window <= self._refill_below
        if self._recv_window < f.DEFAULT_MAX_FRAME and held:
            self._unjam()

    def _unjam(self) -> None:
        """The connection's buffer is (nearly) full. Held by whole messages, their handlers
        free it as they read; held by partial messages alone, nothing ever would (their rest
        cannot arrive): the call holding the largest fails, RESOURCE_EXHAUSTED."""
        largest: Call | None = None
        for call in self._streams.values():
            if call.has_message:
                return
            if largest is None or call.held > largest.held:
                largest = call
        if largest is not None and largest.held:
            largest.fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"the connection's receive buffer ({self._buffer} bytes) is full of "
                         "partial messages")

    def _forget(self, call: Call) -> None:
        """``call`` is over: what it held is released."""
        self._streams.pop(call.id, None)
        self._blocked.pop(call.id, None)
        self._head_bytes -= call.head_held
        if self.starved:
            self._refill()

    def _on_headers(self, stream: int, flags: int, payload: bytes) -> None:
        if stream == 0 or stream % 2 == 0:
            raise ConnectionError_(f.PROTOCOL_ERROR, "HEADERS on a server stream id")
        super()._on_headers(stream, flags, payload)

    def _on_header_block(self, stream: int, flags: int, block: bytes) -> None:
        head = self._heads.decode(block)
        self._fields_read += head.fields
        if self._fields_read > FIELDS_PER_READ:
            # Decoding is the costliest thing a peer can ask for (~3 µs a field): after this
            # many in one read, the rest of it waits for the next loop iteration.
            self._fields_read = 0
            self._yield = True
        call = self._streams.get(stream)
        if call is not None:  # trailers of the request
            if call.input_ended:  # half-closed (remote): a stream error (RFC 9113 §5.1)
                self.reset_stream(call, f.STREAM_CLOSED)
                call.reset()
                return
            if not flags & f.END_STREAM:
                raise ConnectionError_(f.PROTOCOL_ERROR, "trailers without END_STREAM")
            problem = call.end_input()
            if problem is not None:
                call.fail(*problem)
            elif not call.started:
                self._start(call)
            return
        last = self._last_stream
        if stream <= last:
            if any(low <= stream < high for low, high in self._skipped):
                # Never opened (skipped, so closed): an id a new stream may not take (RFC 9113
                # §5.1.1). (Gaps are remembered as ranges; clients skip none.)
                raise ConnectionError_(f.PROTOCOL_ERROR, "HEADERS on a stream below the last")
            self._write(f.rst_stream(stream, f.STREAM_CLOSED))  # one that ended
            return
        expected = last + 2 if last else 1
        if stream != expected:
            skipped = self._skipped
            if len(skipped) >= SKIPPED_RANGES:
                del skipped[0]
            skipped.append((expected, stream))
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
        ended = bool(flags & f.END_STREAM)
        if head.fields > self._max_fields:
            self._refuse(stream, ended, f"a header block of {head.fields} fields is above the "
                                        f"limit ({self._max_fields})")
            return
        if self._head_bytes + head.held > self._max_head_bytes:
            # The open calls' heads already hold what a connection may: this one waits for
            # some to end (REFUSED_STREAM: the client may retry it).
            self._write(f.rst_stream(stream, f.REFUSED_STREAM))
            return
        method, path, metadata = head.method, head.path, head.metadata
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
        call.head_held = head.held
        self._head_bytes += head.held
        self._calls += 1
        self._streams[stream] = call
        if ended:
            call.end_input()
        if handler.request_streaming or ended:
            self._start(call)

    def _refuse(self, stream: int, ended: bool, details: str) -> None:
        """Answer a stream RESOURCE_EXHAUSTED before it became a call."""
        self._write(f.headers(stream, f.RESPONSE_HEADERS + f.trailers(
            grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], details), end_stream=True))
        if not ended:
            self._write(f.rst_stream(stream, f.NO_ERROR))

    def _on_rst(self, stream: int, payload: bytes) -> None:
        call = self._streams.get(stream)
        if call is not None:
            if not call.headers_sent:
                self._premature += 1
                # Rapid Reset (CVE-2023-44487): streams opened and reset before any answer,
                # each a call set up and torn down for nothing. Counted against the budget
                # only while they are half the connection's calls or more (Envoy's premature
                # reset rule): Envoy resets its ext_proc stream when a client goes away, and
                # a storm of those on a connection that served many calls is not an attack.
                if 2 * self._premature >= self._calls and not self._resets.spend():
                    raise ConnectionError_(f.ENHANCE_YOUR_CALM,
                                           "too many streams reset before their answer")
            self._forget(call)
            call.reset()
            # Its handler may be done already (an answer that waited for window): no call_done
            # is coming to close a draining connection.
            self._close_if_drained()
        elif stream > self._last_stream:  # RFC 9113 §6.4: an idle stream
            raise ConnectionError_(f.PROTOCOL_ERROR, "RST_STREAM on an idle stream")

    def _priority_size(self, stream: int) -> None:
        if stream > self._last_stream or stream % 2 == 0:
            return  # no RST_STREAM for an idle stream (RFC 9113 §6.4); a glitch all the same
        call = self._streams.get(stream)
        if call is not None:
            self.reset_stream(call, f.FRAME_SIZE_ERROR)
            call.reset()
        else:
            self._write(f.rst_stream(stream, f.FRAME_SIZE_ERROR))

    def _on_setting(self, key: int, value: int) -> None:
        if key == f.SETTINGS_ENABLE_PUSH and value > 1:  # RFC 9113 §6.5.2
            raise ConnectionError_(f.PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH above 1")

    def _on_settings_frame(self, entries: int) -> None:
        if entries > self._limits.max_settings_entries:
            raise ConnectionError_(f.ENHANCE_YOUR_CALM, "too many settings in one frame")
        if not self._settings_budget.spend():
            raise ConnectionError_(f.ENHANCE_YOUR_CALM, "too many SETTINGS frames")

    def _on_ping(self) -> None:
        if not self._pings.spend():
            raise ConnectionError_(f.ENHANCE_YOUR_CALM, "too_many_pings")

    def _on_glitch(self) -> None:
        if not self._glitches.spend():
            raise ConnectionError_(f.ENHANCE_YOUR_CALM, "too many frames that do nothing")

    def _on_goaway(self, stream: int, payload: bytes) -> None:
        pass  # the client opens no new stream; the ones open finish

    def _known(self, stream: int) -> Call | None:
        if stream % 2 == 0 or stream > self._last_stream:  # RFC 9113 §5.1: idle
            raise ConnectionError_(f.PROTOCOL_ERROR, f"a frame on idle stream {stream}")
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
        self._forget(call)
        self._close_if_drained()

    def reset_stream(self, call: Call, code: int) -> None:
        """Reset ``call``'s stream from our side (a call cut short)."""
        if call.finished:
            return
        call.finished = True
        self._write(f.rst_stream(call.id, code))
        self._forget(call)
        self._close_if_drained()

    # -- calls and the server --------------------------------------------------------------

    def _start(self, call: Call) -> None:
        call.started = True
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

    def tick(self, now: float) -> None:
        """The server's sweep (every :attr:`.limits.Limits.sweep_s`): end the connection that
        has not finished its handshake, has left a frame or header block unfinished, or has
        been idle (no open stream, no frame at all) longer than its limit allows."""
        if self.closed:
            return
        limits = self._limits
        if not self._preface:
            if now - self._opened_at > limits.handshake_timeout_s:
                self._timed_out("no HTTP/2 preface and SETTINGS in time", "handshake_timeout")
            return
        opened = self._headers_open
        if opened is not None and now - opened.at > limits.incomplete_timeout_s:
            self._timed_out("a header block was not finished in time", "incomplete_timeout")
            return
        if self._pending:
            if self._kept != self._kept_seen:  # a new partial frame since the last sweep
                self._kept_seen = self._kept
                self._partial_since = now
            elif now - self._partial_since > limits.incomplete_timeout_s:
                self._timed_out("a frame was not finished in time", "incomplete_timeout")
                return
        if self._streams or self._tasks or self._reads != self._reads_seen:
            self._reads_seen = self._reads
            self._active_at = now
        elif now - self._active_at > limits.idle_timeout_s and not self._draining:
            log.info("h2_connection_idle", peer=self.peer, idle_s=limits.idle_timeout_s)
            self._server.closed_by_us("idle")
            self.drain()

    def _timed_out(self, message: str, reason: str) -> None:
        log.warning("h2_connection_timeout", peer=self.peer, reason=message)
        self._end(f.NO_ERROR, message, reason)

    def _log_bug(self) -> None:
        log.exception("h2_connection_error", peer=self.peer)

    def _connection_error(self, code: int, message: str) -> None:
        if code == f.ENHANCE_YOUR_CALM:
            log.warning("h2_connection_calm", peer=self.peer, reason=message)
        self._end(code, message, f.ERROR_NAMES.get(code, "other"))

    def _end(self, code: int, message: str, reason: str) -> None:
        """GOAWAY ``code`` with ``message``, close, and count the close under ``reason``."""
        if self.closed:
            return
        self._server.closed_by_us(reason)
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
