"""Bucket keys: ``rl:<domain>:<entry keys>:{<digest>}``.

* ``<domain>`` and ``<entry keys>`` (descriptor keys such as ``kind.api_key``, joined by ``.``)
  come from the config; they are escaped to ``[A-Za-z0-9_.-]`` and cut to 48 characters so an
  operator can read ``redis-cli --scan`` output.
* Descriptor *values* never appear: they may be key ids or anything a client sent. The digest
  is SHA-256 over the length-prefixed domain, keys and values (first 24 hex digits, 96 bits).
* The digest is the Redis Cluster hash tag, so buckets spread over the cluster's slots
  instead of piling onto one node per domain.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

PREFIX = "rl"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_MAX_LABEL = 48


def _label(text: str) -> str:
    clean = _UNSAFE.sub("_", text)
    return clean if len(clean) <= _MAX_LABEL else clean[:_MAX_LABEL]


def bucket_key(domain: str, entries: Sequence[tuple[str, str]], salt: str = "") -> str:
    """The bucket of one request descriptor. ``salt`` separates buckets that share entries
    but not a limit (an override sent by Envoy)."""
    digest = hashlib.sha256()
    for part in (domain, salt, *(p for entry in entries for p in entry)):
        raw = part.encode("utf-8", "surrogatepass")
        digest.update(len(raw).to_bytes(4, "big"))
        digest.update(raw)
    keys = ".".join(key for key, _ in entries)
    return f"{PREFIX}:{_label(domain)}:{_label(keys)}:{{{digest.hexdigest()[:24]}}}"
