"""``sidecar_runtime.wire.pb_write`` writes what upb writes, byte for byte, at the edges of its
types too (negative and 64-bit numbers, lone surrogates), and refuses, with upb's exception,
what upb refuses to write: never bytes upb would not write."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from envoy.config.core.v3 import base_pb2
from google.protobuf import duration_pb2, wrappers_pb2
from google.protobuf.message import Message

from sidecar_runtime.wire import pb_write

Written = bytes | type[BaseException]


def written(fn: Callable[[], bytes]) -> Written:
    try:
        return fn()
    except Exception as exc:
        return type(exc)


def upb(build: Callable[[], Message]) -> Written:
    return written(lambda: build().SerializeToString())


INT64 = (-1, -2, -127, -128, -129, -(2**31), -(2**31) - 1, -(2**63), -(2**63) - 1,
         1, 127, 128, 2**31 - 1, 2**63 - 1)
"""Within int64 and one below it (a field type's own range, 2**63 for an int64, is the caller's
to keep: the varint itself holds up to 2**64 - 1, as a uint64 does)."""
INT32 = (-1, -129, -(2**31), 1, 2**31 - 1)
UINT64 = (1, 2**63, 2**64 - 1, 2**64, 2**70)


@pytest.mark.parametrize("value", INT64)
def test_an_int64_is_written_as_upb_writes_it(value: int) -> None:
    # Duration.seconds: int64, field 1. A negative is ten bytes (its 64-bit two's complement).
    expected = upb(lambda: duration_pb2.Duration(seconds=value))
    assert written(lambda: pb_write.tag(1, 0) + pb_write.varint(value)) == expected
    if value < 0 and value >= -(2**63):
        assert len(pb_write.varint(value)) == 10


@pytest.mark.parametrize("value", INT32)
def test_an_int32_is_written_as_upb_writes_it(value: int) -> None:
    # Duration.nanos: int32, field 2; protobuf writes a negative int32 sign-extended to 64 bits.
    expected = upb(lambda: duration_pb2.Duration(nanos=value))
    assert written(lambda: pb_write.tag(2, 0) + pb_write.varint(value)) == expected


@pytest.mark.parametrize("value", (-1, -129, 1, 2))
def test_an_enum_is_written_as_upb_writes_it(value: int) -> None:
    # HeaderValueOption.append_action: an open (proto3) enum, field 3.
    expected = upb(lambda: base_pb2.HeaderValueOption(append_action=value))
    assert written(lambda: pb_write.enum(3, value)) == expected


@pytest.mark.parametrize("value", UINT64)
def test_a_uint64_is_written_as_upb_writes_it_and_past_64_bits_refused(value: int) -> None:
    expected = upb(lambda: wrappers_pb2.UInt64Value(value=value))
    assert written(lambda: pb_write.tag(1, 0) + pb_write.varint(value)) == expected
    if value >= 2**64:
        assert expected is ValueError


def test_below_the_smallest_int64_is_refused_as_upb_refuses_it() -> None:
    assert upb(lambda: duration_pb2.Duration(seconds=-(2**63) - 1)) is ValueError
    with pytest.raises(ValueError, match="below the smallest int64"):
        pb_write.varint(-(2**63) - 1)


SURROGATES = ("\ud800", "a\udcff", "\udfff", "é\ud83d", b"caf\xff".decode("utf-8", "surrogateescape"))
TEXT = ("", "a", "café-☕", "\U0001d11e", "\ud83d\ude00".encode("utf-16", "surrogatepass")
        .decode("utf-16"))


@pytest.mark.parametrize("text", SURROGATES + TEXT)
def test_a_string_is_written_as_upb_writes_it_and_a_lone_surrogate_refused(text: str) -> None:
    expected = upb(lambda: base_pb2.HeaderValue(key=text))
    assert written(lambda: pb_write.string(1, text)) == expected
    if text in SURROGATES:
        assert expected is UnicodeEncodeError
        with pytest.raises(ValueError):  # what a caller catches (extproc's RLS client does)
            pb_write.string(1, text)
