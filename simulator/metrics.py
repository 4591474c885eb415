"""vLLM's Prometheus metrics, on a registry of the simulator's own (or, with ``--engine``, another
engine's load gauges: :mod:`simulator.exposition`).

Names, label and buckets follow vLLM's V1 engine (``vllm/v1/metrics/loggers.py``); every series is
labelled ``model_name`` with the served name, as vLLM labels with its first served model name. A
registry per simulator lets several simulators share one process without name collisions.

The prefix-cache counters are vLLM's (>= 0.10) ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits``, in tokens; like every counter here the exposition names their samples
``..._total``. Overrides set by ``POST /sim/state`` replace the three scheduler gauges in what is
reported; the real values are kept and come back when the overrides are cleared.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from simulator.exposition import Load, render
from simulator.overrides import NONE, SimOverrides

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
    """The metric handles of one simulator; ``render`` gives the Prometheus text, in ``engine``'s
    names and shape."""

    def __init__(self, model_name: str, engine: str = "vllm") -> None:
        self.engine = engine
        self._shown: tuple[float, float, float] = (0, 0, 0.0)
        self._tokens = [0, 0]  # prompt, generated: the counters other engines' text reports
        self._created = time.time()
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        reg = self.registry
        running = Gauge("vllm:num_requests_running", "Requests being generated.", labels, registry=reg)
        waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", labels, registry=reg)
        kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means full.", labels, registry=reg)
        prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=reg)
        generation = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=reg)
        queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=reg,
        )
        hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=reg,
        )
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
        self._queries = queries.labels(model_name)
        self._hits = hits.labels(model_name)
        self._real: tuple[int, int, float] = (0, 0, 0.0)
        self.overrides = NONE
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
        self._real = (running, waiting, kv_usage)
        self._publish()

    def set_overrides(self, overrides: SimOverrides) -> None:
        """Report ``overrides`` instead of the real values they name (``NONE``: report all real)."""
        self.overrides = overrides
        self._publish()

    @property
    def real_load(self) -> tuple[int, int, float]:
        """The real (running, waiting, kv_usage), whatever is overridden."""
        return self._real

    def _publish(self) -> None:
        running, waiting, kv_usage = self._real
        o = self.overrides
        self._shown = (running if o.running is None else o.running,
                       waiting if o.waiting is None else o.waiting,
                       kv_usage if o.kv_usage is None else o.kv_usage)
        self._running.set(self._shown[0])
        self._waiting.set(self._shown[1])
        self._kv.set(self._shown[2])

    def prefix_query(self, queried_tokens: int, hit_tokens: int) -> None:
        """A sequence looked its prompt up in the prefix cache and found ``hit_tokens`` of it."""
        self._queries.inc(queried_tokens)
        self._hits.inc(hit_tokens)

    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        """A sequence finished prefill and produced its first token (or its embedding)."""
        self._ttft.observe(seconds)
        self._prompt.inc(prompt_tokens)
        self._tokens[0] += prompt_tokens

    def token(self, since_previous: float | None) -> None:
        """A sequence produced a token; ``since_previous`` is None for its first."""
        self._generation.inc()
        self._tokens[1] += 1
        if since_previous is not None:
            self._tpot.observe(since_previous)

    def finished(self, reason: str, seconds: float) -> None:
        """A sequence ended (``stop``, ``length`` or ``abort``) ``seconds`` after arrival."""
        self._success.labels(self._model_name, reason).inc()
        self._e2e.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (vLLM's), or of ``engine``'s load."""
        if self.engine == "vllm":
            return generate_latest(self.registry)
        running, waiting, kv_usage = self._shown
        load = Load(running, waiting, kv_usage, self._tokens[0], self._tokens[1], self._created)
        return render(self.engine, self._model_name, load).encode()
