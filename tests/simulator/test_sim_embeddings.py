"""Embedding vectors: deterministic, unit length, float32-exact, base64 round trip."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.embeddings import decode_base64, embed, encode_base64, normalize, truncate
from simulator.tokens import TokenPrompt


def _is_float32(value: float) -> bool:
    return bool(struct.unpack("<f", struct.pack("<f", value))[0] == value)


@pytest.mark.parametrize("item", ["hello", "", "日本語", TokenPrompt((1, 2, 3)), TokenPrompt(())])
@pytest.mark.parametrize("dim", [1, 3, 256, 1024])
def test_vectors_are_unit_length_and_float32_exact(item: str | TokenPrompt, dim: int) -> None:
    vector = embed(item, dim)
    assert len(vector) == dim
    assert math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-6)
    assert all(_is_float32(v) for v in vector)


def test_same_input_same_vector_different_input_different_vector() -> None:
    assert embed("hello", 64) == embed("hello", 64)
    assert embed("hello", 64) != embed("hello!", 64)
    assert embed("1,2", 64) != embed(TokenPrompt((1, 2)), 64)


def test_vectors_do_not_depend_on_the_process() -> None:
    # Pinned values: a vector must be identical in every process and every release, since caches
    # (and other teams' tests) compare them across runs.
    assert embed("hello", 4) == [
        0.718254029750824,
        -0.14633037149906158,
        0.6305091381072998,
        0.25525814294815063,
    ]


@pytest.mark.parametrize("dimensions", [1, 2, 10, 256])
def test_truncation_renormalises_the_prefix(dimensions: int) -> None:
    full = embed("text", 256)
    short = truncate(full, dimensions)
    assert len(short) == dimensions
    assert math.isclose(math.fsum(v * v for v in short), 1.0, rel_tol=1e-6)
    scale = short[0] / full[0]
    assert all(
        math.isclose(s, f * scale, rel_tol=1e-5, abs_tol=1e-7)
        for s, f in zip(short, full[:dimensions], strict=True)
    )


def test_zero_vector_stays_zero() -> None:
    assert normalize([0.0, 0.0]) == [0.0, 0.0]


@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=64))
def test_base64_round_trips_float32_values_exactly(values: list[float]) -> None:
    assert decode_base64(encode_base64(values)) == values


def test_base64_is_little_endian_float32() -> None:
    assert encode_base64([1.0]) == "AACAPw=="
    assert encode_base64([]) == ""
