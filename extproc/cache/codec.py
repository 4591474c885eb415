"""How one embedding is stored: compact bytes that give back exactly what vLLM sent.

A stored value is a one-byte tag and a payload:

* ``f`` + little-endian float32: a JSON float list whose every value is a float32 (what vLLM
  sends: its tensors are float32), 4 bytes a value instead of ~20 characters of JSON;
* ``d`` + little-endian float64: any other float list, so no value is ever rounded;
* ``b`` + the decoded bytes of an ``encoding_format: base64`` string, kept only when encoding them
  again gives the very same string (a canonical base64), so the client gets vLLM's string back.

Decoding gives the same floats (JSON text may differ in spelling, e.g. ``1e-05`` vs ``1e-5``, never
in value) or the same base64 string. Anything else is not cached.
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array

Vector = list[float] | str
"""An embedding as it appears in the response JSON: floats, or a base64 string."""

_FLOAT32, _FLOAT64, _BASE64 = b"f", b"d", b"b"


def _little_endian(values: array[float]) -> bytes:
    if sys.byteorder == "big":
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _floats(payload: bytes, values: array[float]) -> list[float] | None:
    if len(payload) % values.itemsize:
        return None
    values.frombytes(payload)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def encode_vector(value: object) -> bytes | None:
    """The stored form of one response embedding, or None when it cannot be kept exactly."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return None
        if base64.b64encode(raw).decode("ascii") != value:
            return None
        return _BASE64 + raw
    if not isinstance(value, list):
        return None
    try:
        narrow = array("f", value)  # TypeError for anything but numbers: not an embedding
        # Equal as Python floats means every value survives float32 exactly (JSON has no NaN
        # to spoil the comparison); otherwise keep all 64 bits.
        if narrow.tolist() == value:
            return _FLOAT32 + _little_endian(narrow)
        return _FLOAT64 + _little_endian(array("d", value))
    except (TypeError, OverflowError):
        return None


def decode_vector(stored: bytes) -> Vector | None:
    """The response embedding a stored value stands for; None for bytes this code did not write."""
    tag, payload = stored[:1], stored[1:]
    if tag == _FLOAT32:
        return _floats(payload, array("f"))
    if tag == _FLOAT64:
        return _floats(payload, array("d"))
    if tag == _BASE64:
        return base64.b64encode(payload).decode("ascii")
    return None
