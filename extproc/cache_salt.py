"""vLLM's ``cache_salt`` per tenant: ``models.X.prefix_cache_scope: tenant``.

vLLM's automatic prefix caching reuses the KV blocks of any earlier prompt that starts the same
way, whoever sent it. A prompt that shares its start with one another tenant sent recently is
answered measurably sooner (its prefill skips those blocks), so one tenant can test whether
another sent a given document: the timing side channel vLLM's ``cache_salt`` exists for. vLLM
mixes the salt into a prompt's first block, so blocks are reused only among requests of one salt.

extproc writes the salt of every request of such a model. A client's own ``cache_salt`` never
reaches vLLM as sent, on any model (vLLM's block hash does not cover the model's name, so a
shared model on the same pool would otherwise let a client name a tenant's salt): it is folded
into a salt of its own kind, which no tenant's can equal. Under a tenant scope it is folded
into its tenant's, so a client can still keep parts of its own traffic apart, never join
another tenant's. The salt is a hash of the tenant (and the client's salt): the same in every
extproc replica and across restarts, so a tenant's blocks are shared between replicas; 256 bits
in base64url, as vLLM recommends.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from extproc.errors import bad_request

FIELD = "cache_salt"
_DOMAIN = b"llm-sidecar/cache-salt/v1\0"


def upstream_salt(by_tenant: bool, tenant: str, doc: dict[str, Any]) -> str | None:
    """The ``cache_salt`` vLLM gets for a request of ``tenant`` whose body is ``doc`` (None:
    none, the body's field absent or null on a model without ``prefix_cache_scope: tenant``).

    A client's own salt must be what vLLM accepts (a non-empty string; null is none): anything
    else is the 400 vLLM would give it, not silently dropped."""
    client = doc.get(FIELD)
    if client is not None and (not isinstance(client, str) or not client):
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.",
                          param=FIELD)
    own = b"\1" + client.encode() if client else b"\0"
    if by_tenant:
        return _text(_DOMAIN + b"tenant\0" + tenant.encode() + b"\0" + own)
    return None if client is None else _text(_DOMAIN + b"client\0" + own)


def _text(material: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(material).digest()).rstrip(b"=").decode("ascii")
