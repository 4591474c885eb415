"""What the client sends and says when the server breaks HTTP/2: the GOAWAY's code and debug
data on the wire, and the status of the call it fails. Pinned exactly, so that a change to the
frame loop both ends share (:mod:`sidecar_runtime.h2grpc.peer`) cannot change either unseen:
the first frame must be SETTINGS (but an oversized one is a FRAME_SIZE_ERROR first), and each
frame type's checks keep their own code."""

from __future__ import annotations

import asyncio

import pytest

from sidecar_runtime.h2grpc import frames as f
from sidecar_runtime.h2grpc.client import Channel
from sidecar_runtime.h2grpc.status import RpcError, StatusCode
from tests.sidecar_runtime.h2grpc.peers import scripted

WAIT_S = 20.0
"""A bound for a client that hangs, not a performance figure."""

SETTINGS = f.settings({})

CASES = {
    "HTTP/1.1 instead of HTTP/2 (its first bytes read as an oversized frame)": (
        b"HTTP/1.1 400 Bad Request\r\n\r\n", f.FRAME_SIZE_ERROR,
        "frame above SETTINGS_MAX_FRAME_SIZE"),
    "a PING before SETTINGS": (
        f.frame(f.PING, 0, 0, b"\0" * 8), f.PROTOCOL_ERROR, "the server preface is not SETTINGS"),
    "a first frame not SETTINGS, refused before the rest of it comes": (
        f.window_update(0, 1)[:11], f.PROTOCOL_ERROR, "the server preface is not SETTINGS"),
    "a SETTINGS ACK carrying settings": (
        SETTINGS + f.frame(f.SETTINGS, f.ACK, 0, b"\0\x04\0\0\0\1"), f.PROTOCOL_ERROR,
        "a malformed SETTINGS"),
    "a frame size below 16384": (
        f.settings({f.SETTINGS_MAX_FRAME_SIZE: 1}), f.PROTOCOL_ERROR,
        "a bad SETTINGS_MAX_FRAME_SIZE"),
    "an initial window above 2^31-1": (
        f.settings({f.SETTINGS_INITIAL_WINDOW_SIZE: f.MAX_WINDOW + 1}), f.FLOW_CONTROL_ERROR,
        "window above 2^31-1"),
    "a connection window above 2^31-1": (
        SETTINGS + f.window_update(0, f.MAX_WINDOW), f.FLOW_CONTROL_ERROR,
        "window above 2^31-1"),
    "a WINDOW_UPDATE of 0": (
        SETTINGS + f.window_update(0, 0), f.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0"),
    "a WINDOW_UPDATE on a stream not opened": (
        SETTINGS + f.window_update(4, 1), f.PROTOCOL_ERROR, "a frame on stream 4, not opened"),
    "DATA on a server stream": (
        SETTINGS + f.frame(f.DATA, 0, 2, b"x"), f.PROTOCOL_ERROR,
        "a frame on stream 2, not opened"),
    "a PING on a stream": (
        SETTINGS + f.frame(f.PING, 0, 1, b"\0" * 8), f.PROTOCOL_ERROR, "PING on a stream"),
    "RST_STREAM on stream 0": (
        SETTINGS + f.rst_stream(0, f.CANCEL), f.PROTOCOL_ERROR, "RST_STREAM on stream 0"),
    "a short GOAWAY": (
        SETTINGS + f.frame(f.GOAWAY, 0, 0, b"\0\0\0\1"), f.FRAME_SIZE_ERROR,
        "a malformed GOAWAY"),
    "a push": (
        SETTINGS + f.frame(f.PUSH_PROMISE, f.END_HEADERS, 1, b"\0\0\0\2\x88"),
        f.PROTOCOL_ERROR, "a push, which the client disabled"),
    "CONTINUATION without HEADERS": (
        SETTINGS + f.frame(f.CONTINUATION, f.END_HEADERS, 1, b"\x88"), f.PROTOCOL_ERROR,
        "CONTINUATION without HEADERS"),
    "a header block not continued": (
        SETTINGS + f.frame(f.HEADERS, 0, 1, b"\x88") + f.frame(f.DATA, 0, 1, b""),
        f.PROTOCOL_ERROR, "a header block was not continued"),
    "a header block that never ends": (
        SETTINGS + f.frame(f.HEADERS, 0, 1, b"\x88")
        + f.frame(f.CONTINUATION, 0, 1, b"\0" * 16_000) * 5, f.ENHANCE_YOUR_CALM,
        "header block too large"),
}


def _goaways(data: bytes) -> list[tuple[int, int, bytes]]:
    """The (last stream, code, debug data) of each GOAWAY the client sent in ``data``."""
    assert data.startswith(f.PREFACE)
    at, found = len(f.PREFACE), []
    while at + 9 <= len(data):
        length = int.from_bytes(data[at:at + 3], "big")
        payload = data[at + 9:at + 9 + length]
        if data[at + 3] == f.GOAWAY:
            found.append((int.from_bytes(payload[:4], "big"),
                          int.from_bytes(payload[4:8], "big"), payload[8:]))
        at += 9 + length
    return found


@pytest.mark.parametrize("case", list(CASES))
async def test_a_protocol_error_is_a_goaway_with_its_code_and_an_internal_status(
        case: str) -> None:
    reply, code, message = CASES[case]
    received = bytearray()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while b"/t.S/M" not in received:  # the client's call is on the connection
            received.extend(await reader.read(1000))
        writer.write(reply)
        while chunk := await reader.read(65_536):
            received.extend(chunk)

    async with scripted(script) as (address, _):
        channel = Channel(address)
        with pytest.raises(RpcError) as failed:
            await asyncio.wait_for(channel.unary("/t.S/M", b"request", 10), WAIT_S)
        details = f"HTTP/2 protocol error: {message}"
        assert (failed.value.code, failed.value.details) == (StatusCode.INTERNAL, details)
        await channel.aclose()
    assert _goaways(bytes(received)) == [(0, code, details.encode())]
