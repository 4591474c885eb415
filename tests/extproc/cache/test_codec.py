"""Stored vectors give back exactly what vLLM sent, in fewer bytes."""

from __future__ import annotations

import base64
import struct

import orjson
import pytest

from extproc.cache.codec import decode_vector, encode_vector
from simulator.embeddings import embed, encode_base64

FLOAT32 = embed("some text", 256)  # float32-exact, as vLLM's tensors are


def test_float32_values_are_stored_as_4_bytes_each_and_come_back_equal() -> None:
    stored = encode_vector(FLOAT32)
    assert stored is not None and stored[:1] == b"f" and len(stored) == 1 + 4 * 256
    assert decode_vector(stored) == FLOAT32
    # Same JSON numbers once serialised: the client parses the very same floats.
    assert orjson.loads(orjson.dumps(decode_vector(stored))) == orjson.loads(orjson.dumps(FLOAT32))
    assert len(stored) < len(orjson.dumps(FLOAT32)) / 4


def test_values_that_are_not_float32_keep_all_64_bits() -> None:
    values = [0.1, -1e-300, 1e300, 3]
    stored = encode_vector(values)
    assert stored is not None and stored[:1] == b"d" and len(stored) == 1 + 8 * 4
    assert decode_vector(stored) == values


def test_integers_in_a_float_list_keep_their_value() -> None:
    stored = encode_vector([0, 1, -2])
    assert stored is not None and decode_vector(stored) == [0.0, 1.0, -2.0]


def test_base64_is_stored_decoded_and_given_back_as_the_same_string() -> None:
    text = encode_base64(FLOAT32)
    stored = encode_vector(text)
    assert stored is not None and stored[:1] == b"b" and len(stored) == 1 + 4 * 256
    assert decode_vector(stored) == text
    # Not only float32 payloads: any canonical base64 (say float16 from embed_dtype) round-trips.
    half = base64.b64encode(struct.pack("<4e", 0.5, 1.0, -2.0, 0.25)).decode()
    again = encode_vector(half)
    assert again is not None and decode_vector(again) == half


@pytest.mark.parametrize("value", [
    "not base64!", "QUJD\n", "QUI", None, {"x": 1}, [1.0, "2"], [1.0, None], [[1.0]], [10**400],
])
def test_what_cannot_be_given_back_exactly_is_not_stored(value: object) -> None:
    assert encode_vector(value) is None


@pytest.mark.parametrize("stored", [b"", b"x123", b"f123", b"d1234567"])
def test_foreign_or_truncated_bytes_decode_to_nothing(stored: bytes) -> None:
    assert decode_vector(stored) is None


def test_empty_vector_round_trips() -> None:
    stored = encode_vector([])
    assert stored is not None and decode_vector(stored) == []
