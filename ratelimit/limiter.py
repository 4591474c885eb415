"""From a rate-limit request (plain types, no protobuf) to an outcome.

``plan`` (pure) matches each descriptor against the config snapshot, applies ``replaces`` and
``unlimited``, and names the buckets to hit. The :class:`Limiter` hands those hits to the
bucket store in one call, then ``resolve`` (pure) turns the store's per-bucket results into
per-descriptor outcomes, or ``fallback`` applies ``on_backend_error`` when the store failed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from ratelimit.bucket import BucketResult, BucketSpec, Hit, Settle, report
from ratelimit.descriptors import (
    CONCURRENT,
    KIND_KEY,
    REQUESTS,
    TOKENS,
    DomainConfig,
    Limit,
    OnBackendError,
    RateLimitConfig,
    kind_of,
    level_of,
)
from ratelimit.errors import BackendError
from ratelimit.keys import bucket_key
from ratelimit.metrics import RateLimitMetrics
from ratelimit.store import BucketStore, StoreResult
from sidecar_runtime.process.metric_children import Children

RELEASE_ONLY = BucketSpec(0.0, 0.0, concurrent=True)
"""The spec of a slot release whose cap is gone: a release reads no capacity or rate."""
MAX_HITS = 2**53
UNLIMITED_REMAINING = 2**32 - 1
Code = Literal["ok", "over_limit"]

# What one call carries from the wire to the store and back (requests, plans, outcomes) are
# NamedTuples, not frozen dataclasses: as immutable, built in a third of the time, and a call
# makes several per descriptor (bench/JOURNAL.md, "The rate-limit decision's Python").


class Override(NamedTuple):
    """A limit Envoy sent inside the descriptor, used instead of the config's."""

    requests_per_unit: int
    unit: str


Phase = Literal["admit", "settle", "release"]


class DescriptorRequest(NamedTuple):
    entries: tuple[tuple[str, str], ...]
    """The entries matched against the config (control entries already taken out)."""
    hits: int | None = None
    """The descriptor's own ``hits_addend`` when Envoy set one (0 = check only)."""
    override: Override | None = None
    lease: str | None = None
    """The request's lease (``llm_sidecar.lease`` entry), when Envoy sent one."""
    phase: Phase = "admit"
    """``settle``: the stream-done call reporting ``used`` tokens; ``release``: it frees the
    lease's concurrency slot; ``admit``: an ordinary decision."""
    used: int | None = None
    """Tokens the response used (``settle``); None when the value was not a count."""


class LimitRequest(NamedTuple):
    domain: str
    descriptors: tuple[DescriptorRequest, ...]
    hits_addend: int = 0
    """The request's ``hits_addend``; 0 (unset in proto3) means 1."""


class Planned(NamedTuple):
    """One descriptor after matching: its limit (None: not limited) and its bucket hit, or
    the settlement it asks for (a stream-done descriptor)."""

    limit: Limit | None
    level: str
    kind: str
    hit: Hit | None
    settle: Settle | None = None


class Plan(NamedTuple):
    domain: DomainConfig | None
    items: tuple[Planned, ...]
    hits: tuple[Hit, ...] = ()
    """The items' hits, in order (what the store decides)."""
    settles: tuple[Settle, ...] = ()
    """The items' settlements, in order."""


class DescriptorOutcome(NamedTuple):
    code: Code
    limit: Limit | None = None
    remaining: int | None = None
    reset_s: float | None = None
    retry_after_s: float | None = None
    level: str = "other"
    kind: str = REQUESTS
    result: str = "ok"
    """Metric result: ok, over_limit, shadow_over_limit, unlimited, backend_allow,
    backend_deny; ``none`` for a descriptor that matched no limit."""


class LimitOutcome(NamedTuple):
    ok: bool
    statuses: tuple[DescriptorOutcome, ...]
    retry_after_s: int = 0
    """Whole seconds (at least 1) when denied, else 0."""
    cause: DescriptorOutcome | None = None
    """The denial the client is told about (the one that lasts longest)."""
    backend_failed: bool = False
    never: bool = False
    """The request asks a bucket for more than it can ever hold: waiting will not help."""
    needed: int = 0
    """With ``never``: what the request asked of the ``cause`` bucket."""


@dataclass(frozen=True)
class Match:
    """What one descriptor's entries come to in a domain config: its limit (None: not
    limited), level, kind, and the bucket it charges (with its spec) when limited."""

    limit: Limit | None
    level: str
    kind: str
    key: str | None = None
    spec: BucketSpec | None = None


MAX_MATCHES = 4096
"""Entries whose :class:`Match` a :class:`Matches` remembers: the values are the client's (key
ids, tenants, models), so a flood of new ones must not grow it without bound."""
_MAX_REMEMBERED_TEXT = 512
"""Entries longer than this (in characters, keys and values) are matched but not remembered."""


class Matches:
    """Remembers :func:`match` per domain and entries: a request's descriptors repeat (the same
    key, tenant and model), and matching one costs a config walk and a SHA-256 for its bucket
    key (bench/JOURNAL.md, "The rate-limit decision's Python"). A reload brings new domain
    objects: meeting one starts afresh."""

    def __init__(self, limit: int = MAX_MATCHES) -> None:
        self._domains: dict[str, DomainConfig] = {}
        self._seen: dict[tuple[str, tuple[tuple[str, str], ...]], Match] = {}
        self._limit = limit

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, entries: object) -> bool:
        return any(seen == entries for _, seen in self._seen)

    def get(self, domain: DomainConfig, entries: tuple[tuple[str, str], ...]) -> Match:
        known = self._domains.get(domain.name)
        if known is not domain:
            if known is not None:  # a reload: every domain afresh
                self._domains, self._seen = {}, {}
            self._domains[domain.name] = domain
        key = (domain.name, entries)
        found = self._seen.get(key)
        if found is not None:
            return found
        found = match(domain, entries)
        if sum(len(k) + len(v) for k, v in entries) <= _MAX_REMEMBERED_TEXT:
            if len(self._seen) >= self._limit:
                self._seen.clear()  # amortised: rebuilt by the next few requests
            self._seen[key] = found
        return found


def match(domain: DomainConfig, entries: Sequence[tuple[str, str]], salt: str = "",
          limit: Limit | None = None) -> Match:
    """The :class:`Match` of ``entries`` (``limit``: an override Envoy sent, used instead of
    the config's, whose bucket ``salt`` keeps apart)."""
    if limit is None and not salt:
        limit = domain.match(entries)
    level = level_of(entries)
    if limit is None:
        return Match(None, level, REQUESTS)
    kind = kind_of(entries, limit)
    if limit.unlimited:
        return Match(limit, level, kind)
    return Match(limit, level, kind, bucket_key(domain.name, entries, salt), limit.spec)


def plan(config: RateLimitConfig, request: LimitRequest, matches: Matches | None = None) -> Plan:
    domain = config.domain(request.domain)
    default_hits = request.hits_addend or 1
    if domain is None:
        return Plan(None, tuple(Planned(None, "other", REQUESTS, None) for _ in request.descriptors))
    found: list[Match] = []
    for descriptor in request.descriptors:
        if descriptor.override is not None:
            o = descriptor.override
            found.append(match(domain, descriptor.entries, f"{o.requests_per_unit}/{o.unit}",
                               Limit(f"{domain.name}.override", o.requests_per_unit, o.unit)))
        elif matches is not None:
            found.append(matches.get(domain, descriptor.entries))
        else:
            found.append(match(domain, descriptor.entries))
    replaced = {name for m in found if m.limit is not None for name in m.limit.replaces}
    items: list[Planned] = []
    hits: list[Hit] = []
    settles: list[Settle] = []
    for descriptor, m in zip(request.descriptors, found, strict=True):
        if replaced and m.limit is not None and m.limit.name and m.limit.name in replaced:
            m = Match(None, m.level, REQUESTS)
        if m.key is None and descriptor.phase == "release" and descriptor.lease is not None \
                and (KIND_KEY, CONCURRENT) in descriptor.entries:
            # A slot taken under a cap a reload has since removed (or renamed): freed all the
            # same (its key is the entries'), or it would count again if the cap came back.
            settles.append(Settle(bucket_key(domain.name, descriptor.entries), RELEASE_ONLY,
                                  descriptor.lease, None))
            items.append(Planned(None, m.level, CONCURRENT, None))
            continue
        item = _planned(descriptor, m, default_hits)
        items.append(item)
        if item.hit is not None:
            hits.append(item.hit)
        elif item.settle is not None:
            settles.append(item.settle)
    return Plan(domain, tuple(items), tuple(hits), tuple(settles))


def _planned(descriptor: DescriptorRequest, m: Match, default_hits: int) -> Planned:
    limit, level, kind, key, spec = m.limit, m.level, m.kind, m.key, m.spec
    if limit is None or key is None or spec is None:  # not limited, or unlimited
        return Planned(limit, level, kind, None)
    lease = descriptor.lease
    if descriptor.phase != "admit":
        # The end of a request: settle its reservation or free its slot, never a new charge.
        settle = None
        if lease is not None and kind == TOKENS and descriptor.phase == "settle" \
                and descriptor.used is not None and not limit.debt:
            settle = Settle(key, spec, lease, min(descriptor.used, MAX_HITS))
        elif lease is not None and kind == CONCURRENT and descriptor.phase == "release":
            settle = Settle(key, spec, lease, None)
        return Planned(None, level, kind, None, settle)
    if kind == CONCURRENT:
        # A slot nobody could release would leak: without a lease the cap is not applied.
        if lease is None:
            return Planned(None, level, kind, None)
        return Planned(limit, level, kind, Hit(key, spec, 1, lease))
    hits = descriptor.hits if descriptor.hits is not None else default_hits
    return Planned(limit, level, kind, Hit(key, spec, min(hits, MAX_HITS),
                                           lease if kind == TOKENS and not limit.debt else None))


def resolve(planned: Plan, stored: StoreResult) -> LimitOutcome:
    results = iter(stored.results)
    statuses = [_status(item, next(results) if item.hit is not None else None) for item in planned.items]
    if stored.admitted:
        return LimitOutcome(True, tuple(statuses))
    denied = [(s, item.hit) for s, item in zip(statuses, planned.items, strict=True)
              if s.code == "over_limit"]
    never = [(s, hit) for s, hit in denied if s.retry_after_s is None]
    if never:
        # A reservation above a bucket's capacity: no wait admits it (docs: Rate limits).
        never_cause, hit = never[0]
        return LimitOutcome(False, tuple(statuses), 0, never_cause, never=True,
                            needed=hit.hits if hit is not None else 0)
    waits = [_wait(s) for s, _ in denied]
    cause = denied[waits.index(max(waits))][0] if denied else None
    return LimitOutcome(False, tuple(statuses), _whole_seconds(max(waits, default=1.0)), cause)


def fallback(planned: Plan, policy: OnBackendError) -> LimitOutcome:
    """The outcome when the store could not answer: ``allow`` admits, ``deny`` refuses every
    limited descriptor (unlimited and unmatched ones stay OK)."""
    statuses: list[DescriptorOutcome] = []
    for item in planned.items:
        if item.hit is None:
            statuses.append(_status(item, None))
        elif policy == "allow":
            statuses.append(_outcome(item, "ok", "backend_allow"))
        else:
            statuses.append(_outcome(item, "over_limit", "backend_deny"))
    if policy == "allow":
        return LimitOutcome(True, tuple(statuses), backend_failed=True)
    cause = next((s for s in statuses if s.code == "over_limit"), None)
    return LimitOutcome(False, tuple(statuses), 1, cause, backend_failed=True)


def _outcome(item: Planned, code: Code, result: str) -> DescriptorOutcome:
    return DescriptorOutcome(code, item.limit, level=item.level, kind=item.kind, result=result)


_NOT_LIMITED: dict[tuple[str, str], DescriptorOutcome] = {}
"""The outcome of a descriptor no limit applies to, by level and kind (a dozen at most: both
come from fixed sets). Outcomes are immutable, so one may be shared; a settlement batch has
one such per descriptor."""


def _status(item: Planned, result: BucketResult | None) -> DescriptorOutcome:
    if item.limit is None:
        found = _NOT_LIMITED.get((item.level, item.kind))
        if found is None:
            found = _NOT_LIMITED[item.level, item.kind] = _outcome(item, "ok", "none")
        return found
    if result is None or item.hit is None:
        return DescriptorOutcome(
            "ok", item.limit, UNLIMITED_REMAINING, None, None, item.level, item.kind, "unlimited"
        )
    verdict = report(item.hit.spec, result, item.hit.hits)
    if result.admitted:
        code: Code = "ok"
        label = "ok"
    elif item.hit.spec.shadow:
        code, label = "ok", "shadow_over_limit"
    else:
        code, label = "over_limit", "over_limit"
    return DescriptorOutcome(
        code,
        item.limit,
        verdict.remaining,
        verdict.reset_s,
        verdict.retry_after_s,
        item.level,
        item.kind,
        label,
    )


def _whole_seconds(wait: float) -> int:
    """``retry-after``: whole seconds, at least 1; a millisecond over does not add a second."""
    return max(1, math.ceil(wait - 0.001))


def _wait(status: DescriptorOutcome) -> float:
    if status.retry_after_s is not None:
        return status.retry_after_s
    return float(status.limit.window_s) if status.limit is not None else 1.0


class Limiter:
    """Decides requests against the current snapshot (read once per request) and a store."""

    def __init__(
        self,
        config: Callable[[], RateLimitConfig],
        store: BucketStore,
        metrics: RateLimitMetrics,
        on_unknown_domain: Callable[[str], None] | None = None,
    ) -> None:
        self._config = config
        self.store = store
        self._metrics = metrics
        self._on_unknown_domain = on_unknown_domain
        self._matches = Matches()
        # Levels, kinds, results and codes come from fixed sets: a few dozen children.
        self._decisions = Children(metrics.decisions)
        self._requests = Children(metrics.requests)
        self._settled = Children(metrics.settlements)

    async def check(self, request: LimitRequest) -> LimitOutcome:
        planned = plan(self._config(), request, self._matches)
        settles = planned.settles
        if settles:
            await self._settle(settles)
        if planned.domain is None:
            self._metrics.unknown_domains.inc()
            if self._on_unknown_domain is not None:
                self._on_unknown_domain(request.domain)
            outcome = LimitOutcome(True, tuple([_status(item, None) for item in planned.items]))
        elif not planned.hits:
            outcome = LimitOutcome(True, tuple([_status(item, None) for item in planned.items]))
        else:
            outcome = await self._decide(planned, planned.domain)
        self._count(outcome.statuses)
        self._requests("ok" if outcome.ok else "over_limit").inc()
        return outcome

    async def _decide(self, planned: Plan, domain: DomainConfig) -> LimitOutcome:
        try:
            stored = await self.store.decide(planned.hits)
        except BackendError:
            return fallback(planned, domain.on_backend_error)
        return resolve(planned, stored)

    async def _settle(self, settles: Sequence[Settle]) -> None:
        """Settle reservations and free slots of requests that ended. A store failure leaves
        the reservation standing (the safe side) and a slot held until its lease expires."""
        try:
            await self.store.settle(settles)
        except BackendError:
            self._settled("backend_error").inc(len(settles))
            return
        # One increment per kind, not per settlement: a batch from extproc carries up to 256,
        # and labels() costs ~2 µs a call.
        released = sum(1 for item in settles if item.used is None)
        if released:
            self._settled("release").inc(released)
        if released < len(settles):
            self._settled("tokens").inc(len(settles) - released)

    def _count(self, statuses: Sequence[DescriptorOutcome]) -> None:
        for status in statuses:
            if status.result != "none":
                self._decisions(status.level, status.kind, status.result).inc()
