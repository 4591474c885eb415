"""The compiled, immutable descriptor config and its matching rules.

Matching follows envoyproxy/ratelimit: a request descriptor is a list of ``(key, value)``
entries, walked level by level through the nested config. At each level the exact
``key=value`` entry wins, then a ``value: prefix*`` wildcard (first in file order), then the
key-only default. A limit applies only when it sits at the level of the descriptor's *last*
entry; a descriptor that matches no limit is not limited and not counted. Lookups are dict
lookups, so matching costs O(entries) whatever the size of the config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from ratelimit.bucket import BucketSpec
from sidecar_runtime.wire.names import KEY_ID_HEADER, MODEL_HEADER, TENANT_HEADER

OnBackendError = Literal["allow", "deny"]

UNIT_SECONDS: Mapping[str, int] = MappingProxyType(
    {
        "second": 1,
        "minute": 60,
        "hour": 3600,
        "day": 86400,
        "week": 7 * 86400,
        "month": 30 * 86400,
        "year": 365 * 86400,
    }
)
"""Envoy's RateLimitResponse units; a token bucket needs a fixed length, so a month is 30 days."""

LEVEL_KEYS: tuple[tuple[str, frozenset[str]], ...] = (
    ("api_key", frozenset({"api_key", "api_key_id", "key_id", KEY_ID_HEADER})),
    ("tenant", frozenset({"tenant", TENANT_HEADER})),
    ("model", frozenset({"model", MODEL_HEADER})),
)
"""Descriptor entry keys that name a level, most specific first (messages and metrics)."""

KIND_KEY = "kind"
TOKENS = "tokens"
REQUESTS = "requests"
CONCURRENT = "concurrent"



@dataclass(frozen=True)
class Limit:
    """One ``rate_limit`` block as it runs.

    ``window_s`` is the unit times ``unit_multiplier`` (``unit: 5m`` is minute x 5). The bucket
    holds ``burst`` tokens and refills ``requests_per_unit`` per window, continuously.
    """

    full_key: str
    requests_per_unit: int
    unit: str
    unit_multiplier: int = 1
    burst: int | None = None
    name: str = ""
    unlimited: bool = False
    shadow_mode: bool = False
    debt: bool = False
    detailed_metric: bool = False
    replaces: tuple[str, ...] = ()
    concurrent: int = 0
    """A concurrency cap (requests in flight) instead of a rate: ``requests_per_unit`` unused."""

    @property
    def window_s(self) -> int:
        return UNIT_SECONDS[self.unit] * self.unit_multiplier

    @property
    def capacity(self) -> int:
        return self.requests_per_unit if self.burst is None else self.burst

    @property
    def spec(self) -> BucketSpec:
        if self.concurrent:
            return BucketSpec(float(self.concurrent), 0.0, shadow=self.shadow_mode, concurrent=True)
        return BucketSpec(
            capacity=float(self.capacity),
            rate=self.requests_per_unit / self.window_s,
            debt=self.debt,
            shadow=self.shadow_mode,
        )


@dataclass(frozen=True)
class Branch:
    """The config entries of one descriptor key at one level."""

    exact: Mapping[str, Node]
    wildcards: tuple[tuple[str, Node], ...]
    default: Node | None

    def pick(self, value: str) -> Node | None:
        node = self.exact.get(value)
        if node is not None:
            return node
        for prefix, candidate in self.wildcards:
            if value.startswith(prefix):
                return candidate
        return self.default


@dataclass(frozen=True)
class Node:
    """One descriptor of the config: its limit (if any) and the level below it, by key."""

    limit: Limit | None
    children: Mapping[str, Branch]


@dataclass(frozen=True)
class DomainConfig:
    name: str
    root: Node
    on_backend_error: OnBackendError
    source: str
    line: int = 1
    """Line of ``domain:`` in ``source``."""

    def match(self, entries: Sequence[tuple[str, str]]) -> Limit | None:
        """The limit for one request descriptor, or None (not limited)."""
        node = self.root
        found: Limit | None = None
        last = len(entries) - 1
        for index, (key, value) in enumerate(entries):
            branch = node.children.get(key)
            nxt = branch.pick(value) if branch is not None else None
            if nxt is None:
                break
            if nxt.limit is not None and index == last:
                found = nxt.limit
            if not nxt.children:
                break
            node = nxt
        return found


@dataclass(frozen=True)
class RateLimitConfig:
    """One immutable snapshot of every loaded domain; reloads swap the whole object."""

    domains: Mapping[str, DomainConfig]
    sources: tuple[str, ...] = ()

    def domain(self, name: str) -> DomainConfig | None:
        return self.domains.get(name)


EMPTY_CONFIG = RateLimitConfig(MappingProxyType({}))


def level_of(entries: Sequence[tuple[str, str]]) -> str:
    """``api_key``, ``tenant`` or ``model`` (most specific present), else ``other``."""
    keys = {key for key, _ in entries}
    for level, names in LEVEL_KEYS:
        if keys & names:
            return level
    return "other"


def kind_of(entries: Sequence[tuple[str, str]], limit: Limit) -> str:
    """``concurrent`` for a concurrency cap; ``tokens`` for a ``debt`` limit or a descriptor
    with ``kind=tokens``; else ``requests``."""
    if limit.concurrent:
        return CONCURRENT
    if limit.debt or any(k == KIND_KEY and v == TOKENS for k, v in entries):
        return TOKENS
    return REQUESTS
