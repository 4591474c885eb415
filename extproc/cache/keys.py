"""Embedding-cache keys (docs: Embedding cache): which namespace a request reads, and one key per input.

Pure functions on plain values. A key is ``llm-sidecar:emb:v1:<namespace>:<sha256 hex>`` where
the hash covers the request's output-shaping options (``dimensions``, ``encoding_format`` and any
other body field that is not the model, the input or bookkeeping) and one canonical input. The
namespace stays readable so an operator can ``SCAN`` or drop one; the digest is fixed-length, so
a namespace containing ``:`` cannot make two keys collide. Keys carry no hash tag: on Redis Cluster
a namespace's vectors spread over every node instead of filling one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from routing.compiled import CachePolicy

KEY_PREFIX = "llm-sidecar:emb:v1:"
Item = str | tuple[int, ...]

# Fields that never change a vector: the model (the namespace stands for it), the input (hashed
# on its own), and the caller's bookkeeping. Every other field is part of the key, so an option
# this code has never heard of (``truncate_prompt_tokens``, ``normalize``...) cannot return a
# vector computed under different settings.
_NOT_OPTIONS = frozenset({"model", "input", "dimensions", "encoding_format", "user", "priority"})


def namespace_for(policy: CachePolicy, variant: str, upstream_model: str,
                  tenant: str = "") -> str:
    """The namespace a request reads and writes.

    A canary model gets a namespace of its own (``<namespace>@<canary model>``): its vectors may
    differ from the stable model's, and mixing them would hide exactly what the canary tests.
    ``share_with_canary: true`` opts out, for a canary that serves the same weights.
    With ``scope: tenant`` each tenant gets ``<namespace>#<tenant>``: a hit or miss then says
    nothing about what other tenants embedded (tenant names are ``[A-Za-z0-9._-]``, so the
    ``#`` cannot be forged by one).
    """
    namespace = policy.namespace
    if variant == "canary" and not policy.share_with_canary:
        namespace = f"{namespace}@{upstream_model}"
    if policy.scope == "tenant":
        namespace = f"{namespace}#{tenant}"
    return namespace


def request_salt(dimensions: int | None, encoding_format: str, doc: dict[str, Any]) -> bytes:
    """What every input of one request shares in its hash: the options that shape a vector."""
    options = {k: v for k, v in doc.items() if k not in _NOT_OPTIONS}
    return orjson.dumps([dimensions, encoding_format, options], option=orjson.OPT_SORT_KEYS)


def _item_bytes(item: Item) -> bytes:
    # Distinct prefixes keep the text "1,2" and the token ids [1, 2] apart.
    if isinstance(item, str):
        return b"s" + item.encode("utf-8", "surrogatepass")
    return b"t" + ",".join(map(str, item)).encode("ascii")


@dataclass(frozen=True)
class KeyPlan:
    """The cache keys of one request's inputs."""

    keys: tuple[str, ...]
    """One per input, in input order (duplicate inputs share a key)."""
    distinct: tuple[str, ...]
    """Each key once, in order of first appearance: what is looked up and stored."""
    items: Mapping[str, Item]
    """Key → its input, to rebuild a request body from missing keys."""


def plan_keys(namespace: str, salt: bytes, inputs: tuple[Item, ...]) -> KeyPlan:
    # The salt is JSON, which never holds a raw NUL, so the separator cannot be forged by it.
    base = hashlib.sha256(salt + b"\0")
    prefix = f"{KEY_PREFIX}{namespace}:"
    keys: list[str] = []
    items: dict[str, Item] = {}
    for item in inputs:
        digest = base.copy()
        digest.update(_item_bytes(item))
        key = prefix + digest.hexdigest()
        keys.append(key)
        items.setdefault(key, item)
    return KeyPlan(tuple(keys), tuple(items), items)
