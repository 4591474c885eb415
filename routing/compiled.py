"""What runs: the routing YAML compiled once into lookup tables (one immutable snapshot).

A reload compiles a new :class:`Snapshot` and swaps one reference; nothing here changes after
construction, so a request holding a snapshot sees one consistent config.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from routing.schema import CompareSpec, GuardSpec, RoutingConfig
from routing.units import parse_duration

PRIORITY_TIERS = ("high", "medium", "low")


@dataclass(frozen=True)
class Pool:
    """One vLLM cluster a model may be routed to."""

    cluster: str
    max_context: int


@dataclass(frozen=True)
class Canary:
    model: str
    cluster: str
    percent: float
    sticky: Literal["api_key", "tenant", "request"]
    max_context: int
    guard: GuardSpec | None = None
    compare: CompareSpec | None = None

    @property
    def threshold(self) -> int:
        """Sticky buckets below this (out of 10000) go to the canary."""
        return round(self.percent * 100)


@dataclass(frozen=True)
class CachePolicy:
    namespace: str
    ttl_s: int
    share_with_canary: bool = False
    scope: str = "shared"
    """``shared`` or ``tenant`` (each tenant a namespace of its own)."""


@dataclass(frozen=True)
class ModelRoute:
    """Everything extproc needs to route one model, pools sorted by ``max_context``."""

    name: str
    kind: Literal["chat", "embedding"]
    pools: tuple[Pool, ...]
    default_max_tokens: int
    tokenizer: str | None
    canary: Canary | None
    cache: CachePolicy | None
    media_tokens: tuple[int, int, int] = (0, 0, 0)
    """Prompt tokens per image, audio clip and video (the spec's ``media_tokens``)."""
    salts_by_tenant: bool = False
    """``prefix_cache_scope: tenant``: each request carries its tenant's vLLM ``cache_salt``."""

    @property
    def max_context(self) -> int:
        return self.pools[-1].max_context


@dataclass(frozen=True)
class KeyIdentity:
    """A listed API key: its configured name, tenant and public id."""

    name: str
    tenant: str
    key_id: str


@dataclass(frozen=True)
class Snapshot:
    config: RoutingConfig
    models: MappingProxyType[str, ModelRoute]
    keys_by_sha256: MappingProxyType[str, KeyIdentity]
    auth_required: bool
    tenant_header: str
    high_below: float
    low_from: float
    inject_priority: bool
    listed_tenants: frozenset[str]
    """The tenants of listed keys (a key without ``tenant`` is its own, by name): a tenant header
    naming one of these is not believed (docs: Identity, canaries and priority)."""
    known_tenants: frozenset[str]
    """The tenant values metric labels use (others become ``other``): ``default`` and the listed
    tenants. Both come from the config, so the label stays bounded whatever tenant headers
    callers send."""
    envoy_fingerprint: str = ""
    """:func:`routing.render.envoy.bootstrap_fingerprint` of ``config`` (extproc sets it when it
    loads the file: what the Envoy in front should run)."""


def listed_key_id(sha256_hex: str) -> str:
    """Public id of a listed key: derived from its sha256, so render and extproc agree.

    It is a hash of a hash of the secret: not reversible, and safe in headers and Redis keys.
    """
    return "k" + hashlib.sha256(b"llm-sidecar/key-id/" + sha256_hex.encode()).hexdigest()[:20]


def compile_config(config: RoutingConfig) -> Snapshot:
    """Build the runtime tables of a validated config."""
    models: dict[str, ModelRoute] = {}
    for name, spec in config.models.items():
        pools = sorted(
            (Pool(c, config.clusters[c].max_context) for c in spec.clusters),
            key=lambda pool: pool.max_context,
        )
        canary = None
        if spec.canary is not None:
            c = spec.canary
            canary = Canary(c.model, c.cluster, c.percent, c.sticky,
                            config.clusters[c.cluster].max_context, c.guard, c.compare)
        cache = None
        if spec.cache is not None:
            cache = CachePolicy(spec.cache.namespace, parse_duration(spec.cache.ttl),
                                spec.cache.share_with_canary, spec.cache.scope)
        models[name] = ModelRoute(
            name=name,
            kind=spec.kind,
            pools=tuple(pools),
            default_max_tokens=spec.default_max_tokens,
            tokenizer=spec.tokenizer,
            canary=canary,
            cache=cache,
            media_tokens=(spec.media_tokens.image, spec.media_tokens.audio,
                          spec.media_tokens.video),
            salts_by_tenant=spec.prefix_cache_scope == "tenant",
        )
    keys = {
        k.sha256: KeyIdentity(k.name, k.effective_tenant, listed_key_id(k.sha256))
        for k in config.api_keys
    }
    listed = frozenset(k.effective_tenant for k in config.api_keys)
    return Snapshot(
        config=config,
        models=MappingProxyType(models),
        keys_by_sha256=MappingProxyType(keys),
        auth_required=config.auth.required,
        tenant_header=config.auth.tenant_header,
        high_below=config.priority.high_below,
        low_from=config.priority.low_from,
        inject_priority=config.priority.inject,
        listed_tenants=listed,
        known_tenants=frozenset({"default"}) | listed,
    )
