"""Protobuf wire format written by hand, for the few messages a hot path builds many of.

Building a message field by field through upb's Python API costs about a microsecond per field;
writing the bytes and handing them to upb in one ``MergeFromString`` (or sending them as they
are) costs a fraction of that. Only what those messages need: varints, length-delimited fields
(wire type 2), doubles (wire type 1). The callers' tests hold the bytes equal to upb's own.

What upb refuses to write is refused here, with the same exception: a varint outside 64 bits
(``ValueError``), a string UTF-8 cannot carry, one holding a lone surrogate (U+D800 to
U+DFFF, as ``"\\ud800"`` or ``surrogateescape`` decoding makes), ``UnicodeEncodeError``, a
``ValueError``. Nothing here writes bytes upb would not write.
"""

from __future__ import annotations

import struct

_SMALL = tuple(bytes((n,)) for n in range(0x80))
_double = struct.Struct("<d").pack
_INT64_MIN = -(2**63)
_UINT64_END = 2**64


def varint(value: int) -> bytes:
    """``value`` as upb writes an int32, int64, uint32, uint64, enum or bool field: base-128,
    a negative number as its 64-bit two's complement (always 10 bytes: -1 is ``ff .. ff 01``).
    ``ValueError`` below -2**63 or from 2**64 (no varint holds it; upb refuses it too). Which
    range a field's type allows (a uint32 is never negative) is the caller's to keep."""
    if 0 <= value < 0x80:
        return _SMALL[value]
    if value < 0:
        if value < _INT64_MIN:
            raise ValueError(f"{value} is below the smallest int64, -2**63")
        value += _UINT64_END
    elif value >= _UINT64_END:
        raise ValueError(f"{value} is above the largest uint64, 2**64 - 1")
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
    """A proto3 (implicit presence) string field: nothing when empty, as upb writes it.
    ``UnicodeEncodeError`` where ``text`` holds a lone surrogate, as upb raises."""
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
