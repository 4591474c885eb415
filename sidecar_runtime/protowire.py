"""Protobuf wire format written by hand, for the few messages a hot path builds many of.

Building a message field by field through upb's Python API costs about a microsecond per field;
writing the bytes and handing them to upb in one ``MergeFromString`` (or sending them as they
are) costs a fraction of that. Only what those messages need: varints, length-delimited fields
(wire type 2), doubles (wire type 1). The callers' tests hold the bytes equal to upb's own.
"""

from __future__ import annotations

import struct

_SMALL = tuple(bytes((n,)) for n in range(0x80))
_double = struct.Struct("<d").pack


def varint(value: int) -> bytes:
    """A non-negative int as a base-128 varint."""
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field: a string, bytes, a message or one element of a repeated one.
    Written even when empty (a repeated element, a message that is present)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def string(number: int, text: str) -> bytes:
    """A proto3 (implicit presence) string field: nothing when empty, as upb writes it."""
    return field(number, text.encode()) if text else b""


def blob(number: int, data: bytes) -> bytes:
    """A proto3 (implicit presence) bytes field: nothing when empty."""
    return field(number, data) if data else b""


def double(number: int, value: float) -> bytes:
    """A double field that is written whatever its value (a oneof member)."""
    return varint(number << 3 | 1) + _double(value)


def enum(number: int, value: int) -> bytes:
    """An enum or bool field that is written whatever its value (a oneof member, or a value
    known not to be 0)."""
    return varint(number << 3) + varint(value)
