"""One unary call of the gRPC client on its HTTP/2 stream: what the server's frames on it mean
(:class:`ClientStream`), the server's header blocks decoded (:func:`block_decoder`), and the
``grpc-timeout`` the call carries. No I/O: :mod:`.client_connection` acts on the outcomes.
"""

from __future__ import annotations

import asyncio

from sidecar_runtime.h2grpc import frames as f
from sidecar_runtime.h2grpc.head import BlockCache
from sidecar_runtime.h2grpc.status import RpcError, StatusCode, from_trailers, http_error

Outcome = tuple[int | None, bytes | RpcError] | None
"""What a frame did to a call: None, it goes on; else the RST_STREAM code to send (None:
none, the stream is over) and the call's result."""

_BLOCKS_CACHED = 256
_BLOCK_CACHED_MAX_BYTES = 1024


class ClientStream:
    """A call from its HEADERS to its result."""

    __slots__ = ("body", "headers", "id", "max_receive", "out", "recv_credit", "recv_unacked",
                 "send_window", "started", "timer", "waiter")

    def __init__(self, stream_id: int, waiter: asyncio.Future[bytes], send_window: int,
                 recv_credit: int, max_receive: int, started: float) -> None:
        self.id = stream_id
        self.waiter = waiter
        self.send_window = send_window
        self.recv_credit = recv_credit
        """What the server may still send on the stream before a WINDOW_UPDATE of ours."""
        self.recv_unacked = 0
        self.max_receive = max_receive
        self.out = b""  # request bytes waiting for window; END_STREAM goes with the last
        self.headers: dict[str, str] | None = None
        self.body = bytearray()
        self.started = started
        self.timer: asyncio.TimerHandle | None = None

    def on_data(self, payload: bytes, counted: int, ended: bool) -> Outcome:
        """A DATA frame: ``payload`` without padding, ``counted`` bytes of window."""
        self.recv_credit -= counted
        if self.headers is None:
            return f.PROTOCOL_ERROR, RpcError(StatusCode.INTERNAL,
                                              "DATA before the answer's headers")
        if self.recv_credit < 0:
            return f.FLOW_CONTROL_ERROR, RpcError(StatusCode.INTERNAL,
                                                  "DATA beyond the stream window")
        self.body += payload
        if len(self.body) > self.max_receive + 5:
            return f.CANCEL, RpcError(StatusCode.RESOURCE_EXHAUSTED,
                                      f"an answer above the limit ({self.max_receive} bytes)")
        if ended:
            return None, RpcError(StatusCode.INTERNAL, "the answer ended without trailers")
        self.recv_unacked += counted
        return None

    def on_block(self, fields: dict[str, str], ended: bool) -> Outcome:
        """A header block: the answer's headers, its trailers, or both (trailers-only)."""
        if self.headers is None:
            self.headers = fields
            status = fields.get(":status", "")
            if ended:  # trailers-only
                if status != "200" and "grpc-status" not in fields:
                    return None, http_error(status)
                return None, self._answer(fields)
            if status != "200" \
                    or not fields.get("content-type", "").startswith("application/grpc"):
                return f.CANCEL, http_error(status)
            return None
        if not ended:
            return f.PROTOCOL_ERROR, RpcError(StatusCode.INTERNAL, "trailers without END_STREAM")
        return None, self._answer(fields)

    def _answer(self, trailers: dict[str, str]) -> bytes | RpcError:
        error = from_trailers(trailers)
        if error is not None:
            return error
        body = self.body
        if len(body) >= 5 and body[0] == 0 and int.from_bytes(body[1:5], "big") == len(body) - 5:
            return bytes(body[5:])
        if bytes(body[:1]) not in (b"", b"\0"):
            return RpcError(StatusCode.INTERNAL,
                            "a compressed answer (the client accepts identity only)")
        return RpcError(StatusCode.INTERNAL, "an answer that is not one whole message")


def block_decoder() -> BlockCache[dict[str, str]]:
    """A client connection's decoder of the server's header blocks (a gRPC answer is two, the
    same every time: looked up rather than decoded, which costs ``hpack`` ~6 µs a block)."""
    return BlockCache(dict, {}, _BLOCKS_CACHED, _BLOCK_CACHED_MAX_BYTES)


def timeout_value(seconds: float) -> str:
    """``grpc-timeout`` for ``seconds``: whole milliseconds rounded up, so that a call sent at
    once carries its configured timeout and its header block repeats from call to call."""
    millis = max(1, int(seconds * 1000 + 0.999))  # rounded up, but 250.0000001 is 250
    if millis < 100_000_000:
        return f"{millis}m"
    return f"{min(99_999_999, int(seconds + 0.999))}S"
