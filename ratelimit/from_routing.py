"""The routing YAML's ``rate_limits:`` compiled straight into the service's descriptor tree.

The tree is the one a descriptor file loads into (``ratelimit.loader``): ``kind=KIND`` at the
top, the level (``api_key``, ``tenant``, ``model``) below it, an exact entry per override and the
level's default for every other value. Full keys, and so the Redis bucket keys, are the ones the
``ratelimit.yaml`` that ``llm-sidecar render`` writes would give (both come from
:func:`routing.ratelimits.limit_entries`; a test holds them equal).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import MappingProxyType

from ratelimit.descriptors import KIND_KEY, Branch, DomainConfig, Limit, Node
from routing.ratelimits import DOMAIN, KINDS, LimitEntry, limit_entries
from routing.schema import RoutingConfig


def compile_rate_limits(config: RoutingConfig, source: str = "") -> DomainConfig:
    """The ``llm-sidecar`` domain of a validated routing YAML (``source`` names its file in a
    duplicate-domain error; a routing YAML's domain has no line of its own, so line 1)."""
    entries = limit_entries(config)
    kinds: dict[str, Node] = {}
    for kind in KINDS:
        of_kind = [e for e in entries if e.kind == kind]
        if of_kind:
            kinds[kind] = Node(None, _levels(f"{DOMAIN}.{KIND_KEY}_{kind}", of_kind))
    root = Node(None, MappingProxyType(
        {KIND_KEY: Branch(MappingProxyType(kinds), (), None)} if kinds else {}))
    policy = config.rate_limits.on_backend_error if config.rate_limits is not None else "allow"
    return DomainConfig(DOMAIN, root, policy, source, 1)


def _levels(parent: str, entries: Iterable[LimitEntry]) -> MappingProxyType[str, Branch]:
    exact: dict[str, dict[str, Node]] = {}
    defaults: dict[str, Node] = {}
    for entry in entries:
        leaf = Node(_limit(parent, entry), MappingProxyType({}))
        if entry.value is None:
            defaults[entry.level] = leaf
        else:
            exact.setdefault(entry.level, {})[entry.value] = leaf
    return MappingProxyType({
        level: Branch(MappingProxyType(exact.get(level, {})), (), defaults.get(level))
        for level in {**defaults, **exact}})


def _limit(parent: str, entry: LimitEntry) -> Limit:
    full_key = f"{parent}.{entry.level}" + (f"_{entry.value}" if entry.value else "")
    if entry.kind == "concurrent":
        return Limit(full_key, entry.amount, "second", name=entry.name, shadow_mode=entry.shadow,
                     concurrent=entry.amount)
    return Limit(full_key, entry.amount, entry.unit, entry.unit_multiplier, entry.burst,
                 entry.name, shadow_mode=entry.shadow)
