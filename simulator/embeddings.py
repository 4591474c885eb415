"""Deterministic embedding vectors and their base64 wire form.

A vector depends only on the input item (a text, or a list of token ids), never on the model or
the process: its components come from SHAKE-256 of the item, are L2-normalised, and each is rounded
to the nearest float32, so the JSON floats and the base64 float32 bytes decode to identical values.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct

from simulator.tokens import TokenPrompt

_SCALE = 2.0**31


def embed(item: str | TokenPrompt, dim: int) -> list[float]:
    """The unit-length, float32-exact vector of ``dim`` components for ``item``."""
    raw = hashlib.shake_256(_item_bytes(item)).digest(4 * dim)
    values = [(n - _SCALE) / _SCALE for n in struct.unpack(f"<{dim}I", raw)]
    return normalize(values)


def truncate(vector: list[float], dimensions: int) -> list[float]:
    """The first ``dimensions`` components, renormalised (matryoshka-style, as vLLM does)."""
    return normalize(vector[:dimensions])


def normalize(values: list[float]) -> list[float]:
    """``values`` scaled to unit L2 norm, each rounded to float32; a zero vector stays zero."""
    norm = math.sqrt(math.fsum(v * v for v in values))
    if norm == 0.0:
        return [0.0] * len(values)
    return to_float32([v / norm for v in values])


def to_float32(values: list[float]) -> list[float]:
    """Each value rounded to the nearest float32 (and back to a Python float, exactly)."""
    count = len(values)
    return list(struct.unpack(f"<{count}f", struct.pack(f"<{count}f", *values)))


def encode_base64(vector: list[float]) -> str:
    """OpenAI's ``encoding_format: base64``: little-endian float32 bytes, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def decode_base64(encoded: str) -> list[float]:
    """The inverse of ``encode_base64``."""
    raw = base64.b64decode(encoded)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def _item_bytes(item: str | TokenPrompt) -> bytes:
    # Distinct prefixes keep the text "1,2" and the token ids [1, 2] from sharing a vector.
    if isinstance(item, str):
        return b"text\0" + item.encode("utf-8")
    return b"ids\0" + ",".join(map(str, item.ids)).encode("ascii")
