"""HTTP/2 at the frame level: what the protocol forbids ends that connection with GOAWAY and
the error's code, and nothing else (a fresh connection is served); what it allows but grpcio
never sends (CONTINUATION, padding, priority, unknown frames, PING) works."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from urllib.parse import unquote

import grpc
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
)

from sidecar_runtime.h2grpc.limits import Limits, Rate
from tests.harness.waits import until
from tests.sidecar_runtime.h2grpc.clients import (
    PREFACE,
    FrameClient,
    H2Client,
    goaway,
    grpc_headers,
    message,
    messages,
)
from tests.sidecar_runtime.h2grpc.servicers import channel, path, running_server, unary

PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, COMPRESSION_ERROR = 0x1, 0x3, 0x6, 0x9


def raw(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big")
            + payload)


def literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal without indexing, new name (short strings only)."""
    return b"\x00" + bytes((len(name),)) + name + bytes((len(value),)) + value


def _request_block(client: FrameClient) -> bytes:
    return client.block(grpc_headers(path("Echo")))


# Each: what the client sends after a good preface and SETTINGS, and the GOAWAY code.
VIOLATIONS: dict[str, tuple[Callable[[FrameClient], bytes], int]] = {
    "DATA on stream 0": (lambda c: raw(0x0, 0x1, 0, b"x"), PROTOCOL_ERROR),
    "frame above 16384 bytes": (lambda c: raw(0x0, 0x0, 1, b"x" * 16_385), FRAME_SIZE_ERROR),
    "PUSH_PROMISE": (lambda c: raw(0x5, 0x4, 1, b"\0\0\0\2" + _request_block(c)),
                     PROTOCOL_ERROR),
    "CONTINUATION without HEADERS": (lambda c: raw(0x9, 0x4, 1, _request_block(c)),
                                     PROTOCOL_ERROR),
    "HEADERS not continued": (lambda c: raw(0x1, 0x0, 1, _request_block(c))
                              + raw(0x0, 0x0, 1, message(b"x")), PROTOCOL_ERROR),
    "CONTINUATION of another stream": (lambda c: raw(0x1, 0x0, 1, _request_block(c))
                                       + raw(0x9, 0x4, 3, b""), PROTOCOL_ERROR),
    "HEADERS on an even stream": (lambda c: raw(0x1, 0x5, 2, _request_block(c)),
                                  PROTOCOL_ERROR),
    "DATA on an idle stream": (lambda c: raw(0x0, 0x0, 5, message(b"x")), PROTOCOL_ERROR),
    "HPACK index 0": (lambda c: raw(0x1, 0x5, 1, b"\x80"), COMPRESSION_ERROR),
    "HPACK index past the tables": (lambda c: raw(0x1, 0x5, 1, b"\xff\xff\x7f"),
                                    COMPRESSION_ERROR),
    "HPACK string past the block": (lambda c: raw(0x1, 0x5, 1, b"\x00\x05ab"),
                                    COMPRESSION_ERROR),
    "header value not UTF-8": (lambda c: raw(0x1, 0x5, 1, _request_block(c)
                                             + literal(b"x-bad", b"\xff\xfe")),
                               COMPRESSION_ERROR),
    "padding longer than the frame": (lambda c: raw(0x1, 0x5 | 0x8, 1, b"\x09abc"),
                                      PROTOCOL_ERROR),
    "WINDOW_UPDATE of 0 on the connection": (lambda c: raw(0x8, 0, 0, b"\0\0\0\0"),
                                             PROTOCOL_ERROR),
    "connection window past 2^31-1": (lambda c: raw(0x8, 0, 0, b"\x7f\xff\xff\xff"),
                                      FLOW_CONTROL_ERROR),
    "INITIAL_WINDOW_SIZE past 2^31-1": (lambda c: raw(0x4, 0, 0, b"\0\x04\x80\0\0\0"),
                                        FLOW_CONTROL_ERROR),
    "MAX_FRAME_SIZE below 16384": (lambda c: raw(0x4, 0, 0, b"\0\x05\0\0\x10\0"),
                                   PROTOCOL_ERROR),
    "SETTINGS of odd length": (lambda c: raw(0x4, 0, 0, b"\0\x04\0"), FRAME_SIZE_ERROR),
    "PING on a stream": (lambda c: raw(0x6, 0, 1, b"12345678"), PROTOCOL_ERROR),
    "RST_STREAM on stream 0": (lambda c: raw(0x3, 0, 0, b"\0\0\0\x08"), PROTOCOL_ERROR),
    "header block above 64 KiB": (lambda c: raw(0x1, 0x0, 1, _request_block(c))
                                  + b"".join(raw(0x9, 0, 1, b"\0" * 16_384) for _ in range(4))
                                  + raw(0x9, 0x4, 1, b""), 0xB),
}


async def _fresh_connection_works(address: str) -> None:
    async with channel(address) as ch:
        assert await unary(ch, "Echo", b"fresh") == b"fresh"


@pytest.mark.parametrize("case", list(VIOLATIONS))
async def test_protocol_violation_ends_the_connection_with_goaway(case: str) -> None:
    build, code = VIOLATIONS[case]
    async with running_server() as running:
        client = await FrameClient.open(running.port)
        client.send(build(client))
        frames = await client.until_closed()
        assert goaway(frames).error_code == code
        await client.close()
        await _fresh_connection_works(running.address)


async def test_not_an_http2_preface() -> None:
    async with running_server() as running:
        client = await FrameClient.open(
            running.port, preface=b"GET / HTTP/1.1\r\nHost: sidecar\r\n\r\n")
        assert goaway(await client.until_closed()).error_code == PROTOCOL_ERROR
        await client.close()
        await _fresh_connection_works(running.address)


async def test_violation_cuts_the_calls_on_that_connection_only() -> None:
    async with running_server() as running, channel(running.address) as ch:
        seen = running.servicer.seen
        bystander = ch.unary_unary(path("Hold"))(b"elsewhere")
        client = await FrameClient.open(running.port)
        client.send(client.headers(1, grpc_headers(path("HoldStream"))))
        await until(seen.started.is_set, timeout_s=5, what="the handler to start")
        client.send(raw(0x0, 0x0, 0, b"x"))
        assert goaway(await client.until_closed()).error_code == PROTOCOL_ERROR
        assert seen.cancelled == 1  # HoldStream, cut with its connection
        seen.release.set()
        assert await bystander == b"elsewhere"
        await client.close()


async def test_empty_header_name_resets_only_its_stream() -> None:
    async with running_server() as running:
        client = await FrameClient.open(running.port)
        client.send(raw(0x1, 0x5, 1, _request_block(client) + literal(b"", b"v")))
        frame = await client.until(lambda f: f.stream_id == 1)
        assert isinstance(frame, RstStreamFrame) and frame.error_code == PROTOCOL_ERROR
        client.send(client.headers(3, grpc_headers(path("Echo"))),
                    DataFrame(3, message(b"ok"), flags=["END_STREAM"]))
        frame = await client.until(lambda f: isinstance(f, DataFrame) and f.stream_id == 3)
        assert isinstance(frame, DataFrame)
        assert messages(frame.data) == [b"ok"]
        await client.close()


async def test_the_reserved_bit_of_a_stream_id_is_ignored() -> None:
    """RFC 9113 §4.1: a frame's stream id is 31 bits; the bit above is the sender's to set
    and ours to ignore, on HEADERS and DATA alike."""
    async with running_server() as running:
        client = await FrameClient.open(running.port)
        reserved = 0x8000_0000
        # Set on one frame of a stream and not the other: still one stream.
        client.send(raw(0x1, 0x4, reserved | 1, _request_block(client)),
                    raw(0x0, 0x1, 1, message(b"one")),
                    raw(0x1, 0x4, 3, _request_block(client)),
                    raw(0x0, 0x1, reserved | 3, message(b"three")))
        for stream, expected in ((1, b"one"), (3, b"three")):
            body, trailers = await _answer(client, stream)
            assert body == [expected] and trailers["grpc-status"] == "0"
        await client.close()


async def test_ping_is_answered() -> None:
    async with running_server() as running:
        client = await FrameClient.open(running.port)
        client.send(PingFrame(0, opaque_data=b"8 bytes!"))
        pong = await client.until(lambda frame: isinstance(frame, PingFrame))
        assert isinstance(pong, PingFrame)
        assert "ACK" in pong.flags and pong.opaque_data == b"8 bytes!"
        # An ACK from the client is not answered: the next frame is the next PING's ACK.
        client.send(PingFrame(0, opaque_data=b"its ack!", flags=["ACK"]),
                    PingFrame(0, opaque_data=b"second!!"))
        pong = await client.until(lambda frame: isinstance(frame, PingFrame))
        assert isinstance(pong, PingFrame) and pong.opaque_data == b"second!!"
        await client.close()


async def _answer(client: FrameClient, stream: int) -> tuple[list[bytes], dict[str, str]]:
    body = bytearray()
    while True:
        frame = await client.until(lambda f: f.stream_id == stream)
        if isinstance(frame, DataFrame):
            body += frame.data
        elif isinstance(frame, HeadersFrame) and "END_STREAM" in frame.flags:
            return messages(bytes(body)), client.decode(frame)
        elif isinstance(frame, HeadersFrame):
            client.decode(frame)


async def test_headers_split_over_continuation_frames() -> None:
    async with running_server() as running:
        client = await FrameClient.open(running.port)
        block = client.block(grpc_headers(path("Echo"), x_pad="p" * 3000, x_more="m" * 3000))
        third = len(block) // 3
        first = HeadersFrame(1, block[:third])
        client.send(first, ContinuationFrame(1, block[third:2 * third]),
                    ContinuationFrame(1, block[2 * third:], flags=["END_HEADERS"]),
                    DataFrame(1, message(b"split"), flags=["END_STREAM"]))
        answered, trailers = await _answer(client, 1)
        assert answered == [b"split"] and trailers["grpc-status"] == "0"
        assert ("x-pad", "p" * 3000) in running.servicer.seen.metadata
        await client.close()


async def test_padded_and_prioritized_frames() -> None:
    async with running_server() as running:
        client = await FrameClient.open(running.port)
        headers = HeadersFrame(1, client.block(grpc_headers(path("Echo"))),
                               flags=["END_HEADERS", "PADDED", "PRIORITY"], pad_length=17,
                               depends_on=0, stream_weight=200)
        body = message(b"padded")
        client.send(headers,
                    PriorityFrame(1, depends_on=0, stream_weight=3),
                    raw(0xFA, 0x0, 1, b"unknown frame type"),
                    DataFrame(1, body[:4], flags=["PADDED"], pad_length=200),
                    DataFrame(1, body[4:], flags=["PADDED", "END_STREAM"], pad_length=0))
        answered, trailers = await _answer(client, 1)
        assert answered == [b"padded"] and trailers["grpc-status"] == "0"
        await client.close()


async def test_request_trailers_end_the_request() -> None:
    async with running_server() as running:
        client = await FrameClient.open(running.port)
        client.send(client.headers(1, grpc_headers(path("Chat"))),
                    DataFrame(1, message(b"a") + message(b"b")),
                    client.headers(1, [("x-trailer", "t")], end=True))
        answered, trailers = await _answer(client, 1)
        assert answered == [b"A", b"B"] and trailers["grpc-status"] == "0"
        await client.close()


async def test_trailers_above_the_frame_size_are_continued() -> None:
    """A status message that percent-encodes past 16 KiB reaches the client whole, in frames
    no larger than its SETTINGS_MAX_FRAME_SIZE (h2 raises on a larger one)."""
    details = "é" * 4000 + "%" * 1000  # 27,000 bytes once encoded
    async with running_server() as running:
        client = await H2Client.open(running.port, max_frame=16_384)
        answer = await client.call(path("Abort"), details.encode())
        assert answer.grpc_status == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert unquote(answer.grpc_message or "") == details
        await client.close()


class _BrokenLookup(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> None:
        raise RuntimeError("a bug in a method lookup")


async def test_a_bug_while_reading_frames_ends_that_connection_with_goaway() -> None:
    async with running_server() as running:
        running.server.add_generic_rpc_handlers((_BrokenLookup(),))
        client = await FrameClient.open(running.port)
        client.send(client.headers(1, grpc_headers("/no.Such/Method"), end=True))
        assert goaway(await client.until_closed()).error_code == 0x2  # INTERNAL_ERROR
        await client.close()
        await _fresh_connection_works(running.address)


async def test_unimplemented_for_a_long_path_is_continued() -> None:
    """The path is the client's to choose and comes back in ``grpc-message``: 6 KB of '%'
    (within the 16 KiB header list) percent-encode to 18 KB, above one frame."""
    long_path = "/x.Y/" + "%" * 6_000
    async with running_server() as running:
        client = await H2Client.open(running.port, max_frame=16_384)
        answer = await client.call(long_path, b"x")
        assert answer.grpc_status == grpc.StatusCode.UNIMPLEMENTED.value[0]
        assert long_path in unquote(answer.grpc_message or "")
        assert messages((await client.call(path("Echo"), b"next")).body) == [b"next"]
        await client.close()


async def test_a_client_that_does_not_read_cannot_make_the_server_buffer_without_bound() -> None:
    # A client floods PINGs and never reads the ACKs. Once the server's unsent bytes pass the
    # transport's high-water mark it stops reading that client, so what it holds stays bounded
    # (before: every ACK that did not fit the kernel's buffers was kept). The PING budget is
    # lifted for it (else the flood ends at the 101st PING: test_attacks.py).
    unlimited = Limits(pings=Rate(10**9, 1e9))
    async with running_server(limits=unlimited) as running:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
        sock.connect(("127.0.0.1", running.port))
        sock.setblocking(False)
        flood = PingFrame(0, opaque_data=b"12345678").serialize() * 60_000  # ~1 MB of PINGs
        loop = asyncio.get_running_loop()
        sent = 0
        try:
            await loop.sock_sendall(sock, PREFACE + SettingsFrame(0).serialize())
            for _ in range(8):
                try:
                    await asyncio.wait_for(loop.sock_sendall(sock, flood), 1.0)
                    sent += len(flood)
                except TimeoutError:
                    break  # the server stopped reading: the kernel's buffers are full
            connection = next(iter(running.server._connections))
            assert connection.transport is not None
            held = connection.transport.get_write_buffer_size()
            # Held: at most the high-water mark plus the ACKs of one read (~0.3 MB measured;
            # 2.1 MB, and growing with the flood, without the pause).
            assert held < 1024 * 1024, (held, sent)
        finally:
            sock.close()
