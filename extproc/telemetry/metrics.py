"""Prometheus metrics of extproc, named after the OpenTelemetry GenAI conventions where they exist.

Labels are bounded: tenants not listed in the config are reported as ``other``, and models,
clusters and variants come from the config, never from the client.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.records import RequestRecord, outcome
from sidecar_runtime.process.metric_children import Children

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                1.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
OTHER_TENANT = "other"


def settlements_counter(registry: CollectorRegistry) -> Callable[[str, int], None]:
    """``llm_sidecar_extproc_settlements_total{result}`` (requests) and
    ``llm_sidecar_extproc_settlement_batches_total{result}`` (rate-limit calls), as the batcher
    counts (:class:`extproc.settlements.SettlementBatcher`: result, requests of one batch)."""
    requests = Counter(
        "llm_sidecar_extproc_settlements",
        "Token reservations extproc settled itself, by result (ok: the ratelimit service took "
        "them; failed: their batch got no answer, the reservations stand; envoy: handed back to "
        "Envoy's stream-done call, the batcher being off, full or draining).",
        ["result"], registry=registry)
    batches = Counter(
        "llm_sidecar_extproc_settlement_batches",
        "Rate-limit calls extproc made to settle reservations (one per batch), by result "
        "(ok|failed).", ["result"], registry=registry)

    def count(result: str, settled: int) -> None:
        requests.labels(result).inc(settled)
        if result != "envoy":
            batches.labels(result).inc()
    return count


class ExtprocMetrics:
    """Every extproc metric on one registry; ``known_tenants`` bounds the tenant label."""

    def __init__(self, registry: CollectorRegistry,
                 known_tenants: Callable[[], frozenset[str]]) -> None:
        self._known_tenants = known_tenants
        common = ["model", "cluster", "variant", "tenant"]
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Time from the request reaching the gateway to the first streamed token (prefill).",
            common, buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Mean time between streamed tokens after the first (decode).",
            common, buckets=TPOT_BUCKETS, registry=registry)
        self.duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "Time from the request reaching the gateway to the end of the response.",
            [*common, "outcome"], buckets=LATENCY_BUCKETS, registry=registry)
        self.tokens = Histogram(
            "gen_ai_client_token_usage",
            "Tokens per request by type (input = prompt, output = completion).",
            ["model", "variant", "tenant", "token_type"], buckets=TOKEN_BUCKETS,
            registry=registry)
        self.requests = Counter(
            "llm_sidecar_requests", "Routed requests (chat, completions, embeddings) by outcome.",
            [*common, "outcome"], registry=registry)
        self.routes = Counter(
            "llm_sidecar_route_decisions", "Routing decisions by model, cluster and variant.",
            ["model", "cluster", "variant"], registry=registry)
        self.rejections = Counter(
            "llm_sidecar_rejections", "Requests extproc answered itself with an error.",
            ["status", "code"], registry=registry)
        self.phases = Histogram(
            "llm_sidecar_extproc_message_seconds",
            "Time extproc spends on one ext_proc message, by phase.",
            ["phase"], buckets=PHASE_BUCKETS, registry=registry)
        # Observed on every ext_proc message; five phases.
        self._phase = Children(self.phases)
        # Every routed request: labels from the config (tenants bounded to the listed ones and
        # "other") and the fixed outcomes, so the children are as bounded as the metrics'.
        self._requests = Children(self.requests)
        self._duration = Children(self.duration)
        self._ttft = Children(self.ttft)
        self._tpot = Children(self.tpot)
        self._tokens = Children(self.tokens)
        self._routes = Children(self.routes)
        self.canary_tripped = Gauge(
            "llm_sidecar_canary_guard_tripped",
            "1 when this replica's canary guard stopped the model's canary.",
            ["model"], registry=registry)
        self.build = Gauge("llm_sidecar_build_info", "Version of the running llm-sidecar.",
                           ["version", "service"], registry=registry)
        try:
            current = version("llm-sidecar")
        except PackageNotFoundError:
            current = "unknown"
        self.build.labels(current, "extproc").set(1)

    def tenant(self, tenant: str) -> str:
        return tenant if tenant in self._known_tenants() else OTHER_TENANT

    def request_done(self, record: RequestRecord) -> None:
        tenant = self.tenant(record.tenant)
        labels = (record.model, record.cluster, record.variant, tenant)
        result = outcome(record)
        self._requests(*labels, result).inc()
        if not record.sampled:
            return  # counted; its timings and tokens are not known (telemetry.sample)
        self._duration(*labels, result).observe(record.duration_s)
        if record.ttft_s is not None:
            self._ttft(*labels).observe(record.ttft_s)
        if record.tpot_s is not None:
            self._tpot(*labels).observe(record.tpot_s)
        # An aborted request's tokens count too: its prompt went upstream, and the completion
        # tokens streamed before the end were served.
        if record.status < 400:
            self._tokens(record.model, record.variant, tenant, "input") \
                .observe(record.prompt_tokens)
            self._tokens(record.model, record.variant, tenant, "output") \
                .observe(record.completion_tokens)

    def rejected(self, status: int, code: str) -> None:
        self.rejections.labels(str(status), code).inc()

    def routed(self, model: str, cluster: str, variant: str) -> None:
        self._routes(model, cluster, variant).inc()

    def phase(self, phase: str, seconds: float) -> None:
        self._phase(phase).observe(seconds)
