"""One gRPC call on one HTTP/2 stream: its messages in, its handler, its answer out.

The handler is grpc's own ``RpcMethodHandler`` (what ``add_*Servicer_to_server`` registers), run
on the event loop as one task per call, with :class:`Context` standing in for grpc.aio's
``ServicerContext`` (the part of it servicers use: ``abort``, ``read``/``write``,
``invocation_metadata``, ``peer``, ``time_remaining``, ``cancelled``).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from sidecar_runtime.h2grpc import frames
from sidecar_runtime.h2grpc.limits import MESSAGE_OVERHEAD
from sidecar_runtime.process.logs import get_logger

if TYPE_CHECKING:
    from sidecar_runtime.h2grpc.connection import Connection

log = get_logger("sidecar_runtime.h2grpc")

Metadata = tuple[tuple[str, str], ...]


_COMPRESSED = (grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported")


class Aborted(Exception):
    """Raised by :meth:`Context.abort`: the call ends with the status set on its context."""


class Context:
    """What a servicer sees of its call (grpc.aio ``ServicerContext``, the part used here)."""

    def __init__(self, call: Call) -> None:
        self._call = call
        self._code = grpc.StatusCode.OK
        self._details = ""

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Metadata = ()) -> NoReturn:
        if code is grpc.StatusCode.OK:
            raise ValueError("abort() needs an error status")
        self._code, self._details = code, details
        raise Aborted(details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def invocation_metadata(self) -> Metadata:
        return self._call.metadata

    def peer(self) -> str:
        return self._call.connection.peer

    def time_remaining(self) -> float | None:
        deadline = self._call.deadline
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def cancelled(self) -> bool:
        return self._call.cancelled

    def done(self) -> bool:
        return self._call.finished

    async def read(self) -> Any:
        """The next request message, or ``grpc.aio.EOF`` once the client half-closed."""
        try:
            return await self._call.__anext__()
        except StopAsyncIteration:
            return grpc.aio.EOF

    async def write(self, message: Any) -> None:
        await self._call.send(message)


class Call:
    """A call from its HEADERS frame to its end. The connection feeds it (``receive``,
    ``end_input``, ``reset``); its task runs the handler and answers through the connection."""

    __slots__ = (
        "_buffer",
        "_drained",
        "_expired",
        "_max_receive",
        "_messages",
        "_queued",
        "_timer",
        "_waiter",
        "cancelled",
        "connection",
        "deadline",
        "finished",
        "handler",
        "head_held",
        "headers_sent",
        "id",
        "input_ended",
        "metadata",
        "out",
        "path",
        "recv_unacked",
        "send_window",
        "started",
        "task",
        "trailers_out",
    )

    def __init__(self, stream_id: int, path: str, connection: Connection,
                 handler: grpc.RpcMethodHandler, metadata: Metadata, timeout_s: float | None,
                 send_window: int, max_receive: int) -> None:
        self.id = stream_id
        self.path = path
        self.connection = connection
        self.handler = handler
        self.metadata = metadata
        self.cancelled = False
        self.finished = False  # the answer's END_STREAM went out, or the stream was reset
        self.headers_sent = False
        self.out = bytearray()  # DATA bytes waiting for flow-control window
        self.trailers_out: bytes | None = None  # trailers waiting behind them
        self.send_window = send_window
        self.recv_unacked = 0
        self.input_ended = False
        self._buffer = bytearray()  # the start of a message whose rest has not come yet
        self._messages: deque[bytes] = deque()
        self._queued = 0  # the bytes of _messages, each with its overhead
        self.head_held = 0  # what its request head holds (the connection counts it)
        self.started = False  # its handler's task was started
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None
        self._max_receive = max_receive
        self._expired = False
        self._timer: asyncio.TimerHandle | None = None
        self.deadline: float | None = None
        if timeout_s is not None:
            self.deadline = time.monotonic() + timeout_s
            self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)

    # -- fed by the connection ------------------------------------------------------------

    def receive(self, data: bytes) -> tuple[grpc.StatusCode, str] | None:
        """DATA bytes of the request; a problem (a status and its message) ends the call."""
        if self.input_ended:
            return grpc.StatusCode.INTERNAL, "data after the end of the request"
        buffer = self._buffer
        # Read from the frame itself when nothing is left over (the common case: whole
        # messages in one frame, no copy); else from the leftover with the frame appended, so a
        # large message arriving over many frames is copied once, not once per frame.
        source: bytes | bytearray = data
        if buffer:
            buffer += data
            source = buffer
        position, size = 0, len(source)
        queued = self._queued
        while size - position >= 5:
            if source[position] != 0:
                return _COMPRESSED
            length = int.from_bytes(source[position + 1:position + 5], "big")
            if length > self._max_receive:
                return self._too_large(length)
            if size - position - 5 < length:
                break
            self._messages.append(bytes(source[position + 5:position + 5 + length]))
            queued += length + MESSAGE_OVERHEAD
            position += 5 + length
        if source is buffer:
            del buffer[:position]
        elif position < size:
            buffer += data[position:]
        self._queued = queued
        self._wake()
        return None

    def _too_large(self, length: int) -> tuple[grpc.StatusCode, str]:
        return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a message of {length} bytes is above the limit ({self._max_receive})")

    def end_input(self) -> tuple[grpc.StatusCode, str] | None:
        self.input_ended = True
        self._wake()
        if self._buffer:
            return grpc.StatusCode.INTERNAL, "the request ended inside a message"
        return None

    @property
    def held(self) -> int:
        """What this call holds of the connection's buffer: its messages waiting (each with its
        overhead; released once the queue empties) and the start of one not yet whole."""
        return self._queued + len(self._buffer)

    @property
    def has_message(self) -> bool:
        return bool(self._messages)

    def reset(self) -> None:
        """The client reset the stream (or the connection went): stop the handler."""
        self.cancelled = True
        self.finished = True
        self._stop_timer()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def flushed(self) -> None:
        """The connection sent what waited in ``out``."""
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _expire(self) -> None:
        self._timer = None
        if not self.started:
            # Still waiting for its request message: end it now, or it would hold its stream
            # until the connection closes and run its handler past the deadline.
            self.fail(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        elif self.task is not None and not self.task.done():
            self._expired = True
            self.task.cancel()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- the request stream, as the handler reads it --------------------------------------

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> Any:
        raw = await self._next_raw()
        if raw is None:
            raise StopAsyncIteration
        return self._parse(raw)

    async def _next_raw(self) -> bytes | None:
        messages = self._messages
        while not messages:
            if self.input_ended or self.cancelled:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        raw = messages.popleft()
        if not messages:
            # Released once the queue is empty, not per message: bytes taken from a queue
            # that is not yet empty are counted a little longer, which delays the connection's
            # window, never widens it. The connection is told only when there is window to
            # give back (a method call a message was a tenth of the server's CPU per message).
            self._queued = 0
            connection = self.connection
            if self.recv_unacked >= connection.grant_at or connection.starved:
                connection.taken(self)
        return raw

    def _parse(self, raw: bytes) -> Any:
        deserialize = self.handler.request_deserializer
        if deserialize is None:
            return raw
        try:
            return deserialize(raw)
        except Exception:
            raise _BadRequest("could not parse the request message") from None

    # -- the answer ------------------------------------------------------------------------

    def _encode(self, message: Any) -> bytes:
        serialize = self.handler.response_serializer
        raw: bytes = message if serialize is None else serialize(message)
        return frames.length_prefixed(raw)

    async def send(self, message: Any) -> None:
        """Send one answer message; waits while flow control holds it back."""
        if self.finished:
            raise asyncio.CancelledError
        if not self.connection.send(self, self._encode(message), None):
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await self._drained
            finally:
                self._drained = None
            if self.cancelled:
                raise asyncio.CancelledError

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        """End the call now with an error status (bad input), whatever its handler does."""
        self._finish(code.value[0], details)
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def _finish(self, code: int, details: str = "", message: Any = None) -> None:
        self._stop_timer()
        if self.finished:
            return
        data = b"" if message is None else self._encode(message)
        block = frames.TRAILERS_OK if code == 0 and not details else \
            frames.trailers(code, details)
        self.connection.send(self, data, block)

    async def run(self) -> None:
        """Run the handler to its end and send the status."""
        context = Context(self)
        handler = self.handler
        try:
            if handler.request_streaming:
                requests: Any = self
            else:
                raw = await self._next_raw()
                if raw is None:
                    raise _BadRequest("the request has no message")
                requests = self._parse(raw)
            if handler.response_streaming:
                method = handler.stream_stream if handler.request_streaming \
                    else handler.unary_stream
                assert method is not None
                result = method(requests, context)
                if inspect.isasyncgen(result):
                    try:
                        async for message in result:
                            await self.send(message)
                    finally:
                        # Cut while its answer was being sent (a reset, the drain), the
                        # generator waits at its yield: close it now, so its cleanup
                        # (extproc records an aborted request there) runs before the call
                        # counts as done, not whenever the loop finalizes it.
                        await result.aclose()
                elif inspect.isawaitable(result):
                    await result  # writes through context.write
                else:
                    # A plain generator (grpc.aio runs one on its thread pool), run here
                    # on the loop; anything else not iterable is a TypeError, UNKNOWN,
                    # rather than an OK without a message.
                    for message in result:
                        await self.send(message)
                self._finish(context.code().value[0], context.details())
            else:
                method = handler.stream_unary if handler.request_streaming \
                    else handler.unary_unary
                assert method is not None
                answer = await method(requests, context)
                code = context.code()
                if code is grpc.StatusCode.OK and answer is not None:
                    self._finish(0, context.details(), answer)
                else:
                    self._finish(code.value[0] if code is not grpc.StatusCode.OK else 2,
                                 context.details() or "the handler returned no answer")
        except Aborted:
            self._finish(context.code().value[0], context.details())
        except _BadRequest as exc:
            self._finish(grpc.StatusCode.INTERNAL.value[0], str(exc))
        except asyncio.CancelledError:
            if self._expired:
                self._finish(grpc.StatusCode.DEADLINE_EXCEEDED.value[0], "Deadline Exceeded")
                self.connection.reset_stream(self, frames.CANCEL)
            elif not self.cancelled:  # the server is stopping
                self.connection.reset_stream(self, frames.CANCEL)
        except Exception:
            log.exception("grpc_handler_error", method=self.path)
            self._finish(grpc.StatusCode.UNKNOWN.value[0], "Unexpected error")

    def task_done(self, task: asyncio.Task[None]) -> None:
        """The handler's task is over, however it ended (cancelled before it began too). The
        call lets go of it: a cancelled task keeps its CancelledError, whose traceback holds
        the call's frames, and a call holding its task would make a cycle only the garbage
        collector frees (Rapid Reset made tens of MB of them)."""
        self.task = None
        self._stop_timer()
        self.connection.call_done(self)


class _BadRequest(Exception):
    """The request cannot be handed to the handler: INTERNAL, with this message."""


def first_handler(generic: Sequence[grpc.GenericRpcHandler], method: str,
                  metadata: Metadata) -> grpc.RpcMethodHandler | None:
    """Ask each generic handler for ``method`` (grpc's ``HandlerCallDetails`` protocol)."""
    details = _CallDetails(method, metadata)
    for candidate in generic:
        found = candidate.service(details)
        if found is not None:
            return found
    return None


class _CallDetails(grpc.HandlerCallDetails):  # type: ignore[misc]
    def __init__(self, method: str, metadata: Metadata) -> None:
        self.method = method
        self.invocation_metadata = metadata

