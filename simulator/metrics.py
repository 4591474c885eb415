"""vLLM's Prometheus metrics, on a registry of the simulator's own.

Names, label and buckets follow vLLM's V1 engine (``vllm/v1/metrics/loggers.py``); every series is
labelled ``model_name`` with the served name, as vLLM labels with its first served model name. A
registry per simulator lets several simulators share one process without name collisions.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class SimMetrics:
    """The metric handles of one simulator; ``render`` gives the Prometheus text."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        reg = self.registry
        running = Gauge("vllm:num_requests_running", "Requests being generated.", labels, registry=reg)
        waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", labels, registry=reg)
        kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means full.", labels, registry=reg)
        prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=reg)
        generation = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=reg)
        success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time between output tokens.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=reg,
        )
        e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to last token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=reg,
        )
        self._running = running.labels(model_name)
        self._waiting = waiting.labels(model_name)
        self._kv = kv.labels(model_name)
        self._prompt = prompt.labels(model_name)
        self._generation = generation.labels(model_name)
        self._success = success
        self._model_name = model_name
        self._ttft = ttft.labels(model_name)
        self._tpot = tpot.labels(model_name)
        self._e2e = e2e.labels(model_name)
        # vLLM exposes every finish reason from the start; so do we, at zero.
        for reason in ("stop", "length", "abort"):
            success.labels(model_name, reason)

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        """Current scheduler state."""
        self._running.set(running)
        self._waiting.set(waiting)
        self._kv.set(kv_usage)

    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        """A sequence finished prefill and produced its first token (or its embedding)."""
        self._ttft.observe(seconds)
        self._prompt.inc(prompt_tokens)

    def token(self, since_previous: float | None) -> None:
        """A sequence produced a token; ``since_previous`` is None for its first."""
        self._generation.inc()
        if since_previous is not None:
            self._tpot.observe(since_previous)

    def finished(self, reason: str, seconds: float) -> None:
        """A sequence ended (``stop``, ``length`` or ``abort``) ``seconds`` after arrival."""
        self._success.labels(self._model_name, reason).inc()
        self._e2e.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
