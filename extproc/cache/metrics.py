"""Prometheus metrics of the embedding cache, on extproc's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sidecar_runtime.redis.breaker import BreakerState

BACKEND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lookups = Counter(
            "llm_sidecar_cache_lookups",
            "Cached-model embedding requests by lookup result (hit|partial|miss|bypass).",
            ["result"], registry=registry)
        self.inputs = Counter(
            "llm_sidecar_cache_inputs",
            "Distinct inputs looked up, by result (hit|miss|bypass).",
            ["result"], registry=registry)
        self.stored = Counter(
            "llm_sidecar_cache_stored_vectors",
            "Vectors written to the cache.", registry=registry)
        self.backend_errors = Counter(
            "llm_sidecar_cache_backend_errors",
            "Cache store failures by operation (lookup|store) and reason "
            "(timeout|error|breaker_open|node_down|backlog).",
            ["op", "reason"], registry=registry)
        self.backend_latency = Histogram(
            "llm_sidecar_cache_backend_seconds",
            "Time of one cache store round trip, by operation (lookup|store).",
            ["op"], buckets=BACKEND_BUCKETS, registry=registry)
        self.breaker_state = Gauge(
            "llm_sidecar_cache_breaker_state",
            "Cache store circuit breaker: 0 closed, 1 open, 2 half-open.", registry=registry)
        for result in ("hit", "partial", "miss", "bypass"):
            self.lookups.labels(result)
        for result in ("hit", "miss", "bypass"):
            self.inputs.labels(result)

    def set_breaker(self, state: BreakerState) -> None:
        self.breaker_state.set(int(state))
