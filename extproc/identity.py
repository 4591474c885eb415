"""Who is calling: API key → key id and tenant (docs: Identity, canaries and priority; Headers).

The raw key never leaves this module: listed keys are matched by sha256, unlisted ones become a
keyed hash (HMAC) so ids are stable across replicas but not reversible.

Trust model: a listed key's tenant comes from the config. Anyone else (open mode only) names its
own tenant with ``auth.tenant_header``, which is believed unless it names a listed key's tenant:
an unlisted caller can neither spend a customer's tenant buckets nor hide in them.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.errors import bad_request, invalid_api_key
from extproc.quick_init import quick_init
from routing.compiled import Snapshot
from routing.schema import TENANT_RULE, is_tenant

ANONYMOUS = "anonymous"
DEFAULT_TENANT = "default"


@quick_init
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


_KEY_IDS = 4096
"""Unlisted keys' ids kept (by secret and key digest, never the key): an HMAC is ~1.7 µs, and
an open-mode gateway computes one per request of the same few keys. Past this many the
cache starts afresh, so a client sending endless made-up keys grows nothing."""
_key_ids: dict[tuple[bytes, str], str] = {}


def unlisted_key_id(secret: bytes, key_sha256: str) -> str:
    cached = _key_ids.get((secret, key_sha256))
    if cached is not None:
        return cached
    if len(_key_ids) >= _KEY_IDS:
        _key_ids.clear()
    key_id = _key_ids[secret, key_sha256] = \
        "u" + hmac.new(secret, key_sha256.encode(), hashlib.sha256).hexdigest()[:20]
    return key_id


def claimed_tenant(snapshot: Snapshot, value: str | None) -> str:
    """The tenant of an unlisted or anonymous caller from its tenant header's ``value``.

    Absent or blank: ``default``. A listed key's tenant: ``default`` too (only that key may
    spend it). Outside the tenant alphabet (Unicode letters, over 64 characters, a repeated
    header joined with ","): a 400 naming the header, rather than a silent ``default`` the
    client would not notice, and never a truncated value that could be a real tenant.
    """
    text = (value or "").strip()
    if not text:
        return DEFAULT_TENANT
    if not is_tenant(text):
        header = snapshot.tenant_header
        raise bad_request(f"The {header} header must name a tenant: {TENANT_RULE}.",
                          param=header, code="invalid_tenant")
    return DEFAULT_TENANT if text in snapshot.listed_tenants else text


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
    tenant = claimed_tenant(snapshot, headers.get(snapshot.tenant_header))
    if key is None:
        return Identity(ANONYMOUS, tenant, None)
    return Identity(unlisted_key_id(secret, digest), tenant, None)
