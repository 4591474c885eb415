"""HTTP/2 frames (RFC 9113) as the gRPC server and client write them: types, flags, settings, and the
header blocks of a gRPC answer.

The server's header blocks use only HPACK literals "without indexing" (RFC 7541 §6.2.2) and the
static table, so it keeps no encoder state: every block decodes the same at any time.
"""

from __future__ import annotations

import struct
from urllib.parse import quote

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6

NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

ERROR_NAMES = {NO_ERROR: "no_error", PROTOCOL_ERROR: "protocol_error",
               INTERNAL_ERROR: "internal_error", FLOW_CONTROL_ERROR: "flow_control_error",
               STREAM_CLOSED: "stream_closed", FRAME_SIZE_ERROR: "frame_size_error",
               REFUSED_STREAM: "refused_stream", CANCEL: "cancel",
               COMPRESSION_ERROR: "compression_error", ENHANCE_YOUR_CALM: "enhance_your_calm"}
"""RFC 9113 §7's names of the error codes the server sends, lower case (metric labels)."""

DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = 0x7FFF_FFFF


class ConnectionError_(Exception):
    """A connection error (RFC 9113 §5.4.1): GOAWAY with ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def length_prefixed(message: bytes) -> bytes:
    """One gRPC message on the wire: uncompressed flag, 4-byte length, the message."""
    return b"\0" + len(message).to_bytes(4, "big") + message


def unpad(payload: bytes, fields: int = 0) -> bytes:
    """The payload of a PADDED frame without its pad length and padding (RFC 9113 §6.1, §6.2):
    a frame too short for its Pad Length is a FRAME_SIZE_ERROR, padding that covers the rest
    (or the ``fields`` bytes that must follow the Pad Length, a HEADERS' priority) a
    PROTOCOL_ERROR."""
    if not payload:
        raise ConnectionError_(FRAME_SIZE_ERROR, "a PADDED frame without its Pad Length")
    if payload[0] >= len(payload) - fields:
        raise ConnectionError_(PROTOCOL_ERROR, "bad padding")
    return payload[1:len(payload) - payload[0]]


HEADER = struct.Struct(">BHBBI")
"""The 9-byte frame header: length (24 bits, as its high byte and low 16 bits), type, flags,
stream. One ``pack``/``unpack_from`` per frame costs half of building or slicing its fields one
by one, on the path every message takes."""


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One frame: the 9-byte header, then ``payload``."""
    size = len(payload)
    return HEADER.pack(size >> 16, size & 0xFFFF, kind, flags, stream) + payload


def headers(stream: int, block: bytes, end_stream: bool) -> bytes:
    """A header block as one HEADERS frame, or HEADERS then CONTINUATION frames when it is
    above 16 KiB, the frame size every peer accepts (a long ``grpc-message`` can be)."""
    flags = END_STREAM if end_stream else 0
    if len(block) <= DEFAULT_MAX_FRAME:
        return frame(HEADERS, flags | END_HEADERS, stream, block)
    parts = [block[at:at + DEFAULT_MAX_FRAME] for at in range(0, len(block), DEFAULT_MAX_FRAME)]
    return (frame(HEADERS, flags, stream, parts[0])
            + b"".join(frame(CONTINUATION, 0, stream, part) for part in parts[1:-1])
            + frame(CONTINUATION, END_HEADERS, stream, parts[-1]))


def settings(pairs: dict[int, int]) -> bytes:
    """A SETTINGS frame (not an ACK) carrying ``pairs``."""
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in pairs.items()))


def window_update(stream: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream, increment.to_bytes(4, "big"))


def rst_stream(stream: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream, code.to_bytes(4, "big"))


def goaway(last_stream: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, last_stream.to_bytes(4, "big") + code.to_bytes(4, "big") + debug)


def _length(value: int) -> bytes:
    """An HPACK string length (7-bit prefix, Huffman bit off)."""
    if value < 0x7F:
        return bytes((value,))
    out = bytearray((0x7F,))
    value -= 0x7F
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: str, value: str) -> bytes:
    """A header field as a literal without indexing, with a literal name (RFC 7541 §6.2.2)."""
    raw_name, raw_value = name.encode("ascii"), value.encode("ascii")
    return b"\x00" + _length(len(raw_name)) + raw_name + _length(len(raw_value)) + raw_value


STATUS_200 = b"\x88"  # static table index 8: ":status: 200"
RESPONSE_HEADERS = STATUS_200 + literal("content-type", "application/grpc")
"""The header block that starts every gRPC answer."""


def grpc_message(details: str) -> str:
    """``grpc-message``: percent-encoded UTF-8, as the gRPC HTTP/2 protocol says."""
    return quote(details, safe=" !\"#$&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ"
                             "[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~")


def trailers(code: int, details: str = "") -> bytes:
    """The header block that ends a gRPC answer."""
    block = literal("grpc-status", str(code))
    if details:
        block += literal("grpc-message", grpc_message(details))
    return block


TRAILERS_OK = trailers(0)
