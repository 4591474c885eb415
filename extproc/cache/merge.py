"""Answering ``/v1/embeddings`` from the cache: a lookup sorted into hit, partial or miss; the body
that asks vLLM only for what is missing; the answer merged back in input order. Pure functions.

Duplicate inputs share one key: they are looked up, sent upstream and stored once, and every
position that holds them gets the vector in the merged answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from extproc.cache.codec import Vector, decode_vector, encode_vector
from extproc.cache.keys import KeyPlan

Outcome = Literal["hit", "partial", "miss"]


class MergeError(ValueError):
    """vLLM's answer cannot be matched to the inputs it was sent."""


@dataclass(frozen=True)
class Resolution:
    """What a lookup found for one request."""

    plan: KeyPlan
    cached: Mapping[str, Vector]
    missing: tuple[str, ...]
    """Keys with no usable cached vector, once each, in input order: what goes upstream."""

    @property
    def outcome(self) -> Outcome:
        if not self.missing:
            return "hit"
        return "miss" if not self.cached else "partial"


def outcome_of(found: Sequence[bytes | None]) -> Outcome:
    """hit / partial / miss from the raw values of a lookup (for metrics, before decoding)."""
    present = sum(1 for value in found if value is not None)
    if present == len(found):
        return "hit"
    return "miss" if present == 0 else "partial"


def resolve(plan: KeyPlan, found: Sequence[bytes | None]) -> Resolution:
    """Pair the looked-up values (in ``plan.distinct`` order) with their keys.

    A value this code cannot decode counts as missing: it is fetched again and overwritten.
    """
    cached: dict[str, Vector] = {}
    missing: list[str] = []
    for key, stored in zip(plan.distinct, found, strict=True):
        vector = decode_vector(stored) if stored is not None else None
        if vector is None:
            missing.append(key)
        else:
            cached[key] = vector
    return Resolution(plan, cached, tuple(missing))


def missing_body(doc: Mapping[str, Any], resolution: Resolution) -> bytes:
    """The request body with ``input`` cut down to the missing inputs (always a list)."""
    items = resolution.plan.items
    rewritten = dict(doc)
    rewritten["input"] = [
        item if isinstance(item, str) else list(item)
        for item in (items[key] for key in resolution.missing)
    ]
    return orjson.dumps(rewritten)


def _data(keys: Sequence[str], vectors: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"object": "embedding", "index": index, "embedding": vectors[key]}
            for index, key in enumerate(keys)]


def hit_body(resolution: Resolution, model: str, response_id: str) -> bytes:
    """The whole answer from the cache. ``usage`` is zero: no tokens were computed or charged."""
    return orjson.dumps({
        "id": response_id,
        "object": "list",
        "model": model,
        "data": _data(resolution.plan.keys, resolution.cached),
        "usage": {"prompt_tokens": 0, "total_tokens": 0},
    })


def parse_response(body: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MergeError(f"the upstream answer is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise MergeError("the upstream answer is not a JSON object")
    return doc


def upstream_vectors(doc: Mapping[str, Any], sent: Sequence[str]) -> dict[str, Any]:
    """Key → embedding (as the JSON held it) from vLLM's answer to the inputs ``sent``.

    ``sent`` is the key of each input in the order it went upstream; vLLM's ``index`` points
    into it. A missing, repeated or out-of-range index is an error, never a guess.
    """
    data = doc.get("data")
    if not isinstance(data, list) or len(data) != len(sent):
        raise MergeError(f"the upstream answer has {len(data) if isinstance(data, list) else 'no'}"
                         f" embeddings for {len(sent)} inputs")
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for entry in data:
        index = entry.get("index") if isinstance(entry, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(sent) \
                or index in seen or "embedding" not in entry:
            raise MergeError(f"the upstream answer has a bad embedding entry (index {index!r})")
        seen.add(index)
        out.setdefault(sent[index], entry["embedding"])
    return out


def merged_body(doc: Mapping[str, Any], resolution: Resolution, fresh: Mapping[str, Any]) -> bytes:
    """vLLM's answer with ``data`` holding every input, cached or fresh, at its own index.

    Everything else vLLM sent (``id``, ``model``, ``usage`` for the inputs it computed) is kept.
    """
    vectors = {**resolution.cached, **fresh}
    merged = dict(doc)
    merged["data"] = _data(resolution.plan.keys, vectors)
    return orjson.dumps(merged)


def entries_to_store(fresh: Mapping[str, Any]) -> tuple[tuple[str, bytes], ...]:
    """The stored form of each fresh vector; one that cannot be kept exactly is left out."""
    out: list[tuple[str, bytes]] = []
    for key, vector in fresh.items():
        stored = encode_vector(vector)
        if stored is not None:
            out.append((key, stored))
    return tuple(out)


def usage_tokens(doc: Mapping[str, Any]) -> int | None:
    """The tokens vLLM reports it embedded (``total_tokens``, else ``prompt_tokens``)."""
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return None
    for name in ("total_tokens", "prompt_tokens"):
        value = usage.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None
