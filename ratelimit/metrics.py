"""Prometheus metrics of one ratelimit process, on a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sidecar_runtime.redis.breaker import BreakerState

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class RateLimitMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.decisions = Counter(
            "ratelimit_decisions",
            "Descriptor decisions, by level (api_key|tenant|model|other), kind "
            "(requests|tokens|concurrent) and result (ok|over_limit|shadow_over_limit|unlimited|"
            "backend_allow|backend_deny).",
            ["level", "kind", "result"],
            registry=self.registry,
        )
        self.requests = Counter(
            "ratelimit_requests",
            "ShouldRateLimit calls by overall code (ok|over_limit).",
            ["code"],
            registry=self.registry,
        )
        self.settlements = Counter(
            "ratelimit_settlements",
            "Ends of admitted requests applied to buckets, by what was settled (tokens: a "
            "reservation against the real usage; release: a concurrency slot; backend_error: "
            "the store failed them, and they are kept to try again; retried: applied once the "
            "store answered again).",
            ["what"],
            registry=self.registry,
        )
        self.backend_latency = Histogram(
            "ratelimit_backend_seconds",
            "Time of one bucket store decision (a Redis round trip, or memory).",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.backend_errors = Counter(
            "ratelimit_backend_errors",
            "Bucket store failures, by reason (timeout|error|breaker_open|node_down).",
            ["reason"],
            registry=self.registry,
        )
        self.breaker_state = Gauge(
            "ratelimit_breaker_state",
            "Redis circuit breaker: 0 closed, 1 open, 2 half-open.",
            registry=self.registry,
        )
        self.reloads = Counter(
            "ratelimit_config_reloads",
            "Config reloads by result (ok|error).",
            ["result"],
            registry=self.registry,
        )
        self.unknown_domains = Counter(
            "ratelimit_unknown_domain_requests",
            "Requests for a domain the config does not have (answered OK).",
            registry=self.registry,
        )

    def set_breaker(self, state: BreakerState) -> None:
        self.breaker_state.set(int(state))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
