"""Who is calling: API key → key id and tenant (CONTRACT §3 ``auth``/``api_keys``, §4).

The raw key never leaves this module: listed keys are matched by sha256, unlisted ones become a
keyed hash (HMAC) so ids are stable across replicas but not reversible.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.errors import invalid_api_key
from routing.compiled import Snapshot

ANONYMOUS = "anonymous"
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Identity:
    key_id: str
    tenant: str
    key_name: str | None
    """The configured name of a listed key; None for unlisted and anonymous callers."""


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key from ``Authorization: Bearer KEY`` or ``x-api-key``, if any."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None


def unlisted_key_id(secret: bytes, key_sha256: str) -> str:
    return "u" + hmac.new(secret, key_sha256.encode(), hashlib.sha256).hexdigest()[:20]


def _clean_tenant(value: str | None) -> str:
    if not value:
        return DEFAULT_TENANT
    text = value.strip()[:64]
    # Tenants end up in headers, metric labels and Redis keys: keep them to a safe alphabet.
    if text and all(c.isalnum() or c in "._-" for c in text):
        return text
    return DEFAULT_TENANT


def identify(snapshot: Snapshot, headers: Mapping[str, str], secret: bytes) -> Identity:
    """The caller's identity; raises the 401 when ``auth.required`` and the key is not listed."""
    key = presented_key(headers)
    if key is not None:
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        listed = snapshot.keys_by_sha256.get(digest)
        if listed is not None:
            return Identity(listed.key_id, listed.tenant, listed.name)
    if snapshot.auth_required:
        raise invalid_api_key()
    tenant = _clean_tenant(headers.get(snapshot.tenant_header))
    if key is None:
        return Identity(ANONYMOUS, tenant, None)
    return Identity(unlisted_key_id(secret, digest), tenant, None)
