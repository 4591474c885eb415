"""What extproc hands the rate limiter when a request is routed (docs: Rate limits).

The reservation is charged to every token bucket at admission; the lease names this request's
reservation and concurrency slots in the ratelimit store, so the stream-done call can settle
and release exactly them. The lease is random (not the client's ``x-request-id``): a client
must not be able to name, and so settle or release, another request's lease.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from extproc.hit_limits import limit_applies
from routing.schema import RoutingConfig
from sidecar_runtime.wire.names import (
    CAP_METADATA_KEY,
    DONE_METADATA_KEY,
    LEASE_METADATA_KEY,
    RESERVATION_METADATA_KEY,
    TOKENS_METADATA_KEY,
)

_LEASE_BYTES = 12
_POOL_BYTES = _LEASE_BYTES * 256
_pool = b""
_taken = 0


def new_lease() -> str:
    """96 random bits, hex: unguessable, and inside the service's accepted lease alphabet.

    The bits are the OS's CSPRNG (what ``secrets.token_hex`` reads), drawn 256 leases at a
    time: one ``getrandom`` call per lease was most of its cost (issue 16). A forked child
    forgets what its parent drew (:func:`_forget`), so no two processes hand out one lease.
    Called on the event loop's thread only, as every caller is (the pool is not locked)."""
    global _pool, _taken
    start = _taken
    if start + _LEASE_BYTES > len(_pool):
        _pool, start = os.urandom(_POOL_BYTES), 0
    _taken = start + _LEASE_BYTES
    return _pool[start:_taken].hex()


def _forget() -> None:
    global _pool, _taken
    _pool, _taken = b"", 0


os.register_at_fork(after_in_child=_forget)


MAX_RESERVATION = 2**32 - 1
"""Envoy reads ``hits_addend`` as a uint32 and drops a descriptor whose value does not parse,
which would admit the request unchecked. 32K output x 128 choices x 2048 prompts is 8.6e9: such
a request reserves this much instead, more than any bucket holds, and is refused."""


def admission_metadata(config: RoutingConfig, route: Mapping[str, str], reservation: int,
                       lease: str | None = None) -> dict[str, Any]:
    """Dynamic metadata for the request-body answer of a request that goes upstream, routed
    with the ``x-llm-*`` headers ``route`` (``lease``: the one extproc settles under itself; a
    new one when not given). ``llm_cap`` when a concurrency cap of ``config`` applies to it:
    only then does Envoy take a slot for it and free it at the end."""
    out: dict[str, Any] = {RESERVATION_METADATA_KEY: min(max(0, reservation), MAX_RESERVATION),
                           LEASE_METADATA_KEY: lease if lease is not None else new_lease()}
    if limit_applies(config, route, "concurrent", enforcing=False):
        out[CAP_METADATA_KEY] = "1"
    return out


def usage_metadata(used: int) -> dict[str, Any]:
    """Dynamic metadata for the answer that ends a response whose usage is known. A string:
    Envoy's rate-limit ``metadata`` action reads only string values into a descriptor; the
    settle descriptor needs both keys."""
    return {TOKENS_METADATA_KEY: str(max(0, used)), DONE_METADATA_KEY: "1"}
