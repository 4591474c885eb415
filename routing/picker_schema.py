"""``clusters.X.endpoint_picker``: extproc picks the pod of a pool from each pod's live metrics.

Kept apart from :mod:`routing.schema` (which imports it) because it is one feature's settings.
Absent, Envoy balances the pool by least request as before; ``{}`` takes every default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from routing.units import INTERVAL_PATTERN, parse_interval


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _interval(value: str) -> str:
    parse_interval(value)
    return value


class PickerWeights(_Strict):
    """How much each scorer counts; every scorer gives a pod 0 (worst) to 1 (best)."""

    latency: float = Field(default=1.0, ge=0, le=100)
    """The default scorer: when this request would be served on the pod against the pool's
    best. It estimates the wait for a free sequence slot (the pod's running and waiting
    requests plus what this replica sent since the last scrape, against the sequences it was
    seen running at saturation), the prefill its prefix cache would not save, and the request's
    own tokens at the pod's pace (its inter-token histogram): a slow pod gets the requests it
    can serve soonest, and a cached prefix counts for what it saves, never more than a queue."""
    queue: float = Field(default=0.0, ge=0, le=100)
    """Requests waiting on the pod (``vllm:num_requests_waiting``) plus what this replica sent
    it since the last scrape, against ``saturation.queue_depth``: fewer is better."""
    kv_cache: float = Field(default=0.0, ge=0, le=100)
    """KV-cache use (``vllm:kv_cache_usage_perc``): emptier is better."""
    in_flight: float = Field(default=0.0, ge=0, le=100)
    """Requests this extproc replica has open on the pod: fewer is better."""
    speed: float = Field(default=0.0, ge=0, le=100)
    """The pod's time per output token times the requests waiting there, relative to the pool's
    lowest. Above 0 it also scales down the `prefix` score on a pod over twice the best."""
    prefix: float = Field(default=0.0, ge=0, le=100)
    """Share of the prompt's leading blocks the pod recently served (its prefix cache), times
    its `queue` score. `latency` already counts what a cached prefix saves."""
    thermal: float = Field(default=1.0, ge=0, le=100)
    """GPU clock throttling (DCGM): a throttled pod scores 0, when a DCGM URL is set."""


class SaturationSpec(_Strict):
    """When every pod of the pool is over these, low-priority requests get 503
    ``server_overloaded`` (high and medium still go)."""

    queue_depth: int = Field(default=32, ge=1, le=1_000_000)
    """A pod with this many requests waiting is saturated."""
    kv_cache: float = Field(default=0.98, gt=0, le=1)
    """A pod whose KV cache is this full (0 to 1) is saturated."""
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    """The ``retry-after`` of the 503."""


METRIC_NAME_PATTERN = r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"
"""Prometheus's metric name syntax (its data model's ``[a-zA-Z_:][a-zA-Z0-9_:]*``)."""


class LoadMetricNames(_Strict):
    """The load series of an engine the picker does not know by name: each pod's
    ``metrics_path`` is read for these instead of the engines it recognises. Every label set
    of a series counts: queues and running requests summed, KV use the fullest."""

    queue: str = Field(pattern=METRIC_NAME_PATTERN, max_length=200)
    """A gauge of the requests waiting on the pod."""
    running: str | None = Field(default=None, pattern=METRIC_NAME_PATTERN, max_length=200)
    """A gauge of the requests it is generating (unset: 0)."""
    kv_cache: str | None = Field(default=None, pattern=METRIC_NAME_PATTERN, max_length=200)
    """A gauge of its KV-cache use from 0 to 1 (unset: the `kv_cache` scorer is neutral)."""


MAX_WAIT_LIMIT_S = 120.0
"""The longest ``max_wait`` accepted: a client holding a connection open that long without a
byte is already past most clients' own timeouts."""

DEFAULT_MAX_WAIT = "2s"
"""A waiting request's limit when neither the pool nor its model's SLA sets one."""


class FlowControlSpec(_Strict):
    """Waiting instead of failing when every pod of the pool is busy (docs: Flow control): a
    request that finds no pod with a free sequence slot waits in extproc, in its priority band,
    and goes to the pod the picker chooses as soon as one has room. Each extproc process (each
    ``--workers`` process) keeps its own queue; these bounds hold per process and pool."""

    max_wait: str | None = Field(default=None, pattern=INTERVAL_PATTERN, examples=["2s"])
    """The longest a request waits before it is answered 503 ``server_overloaded`` with
    ``retry-after`` (unset: 2s). The rendered Envoy gives extproc longer than this to answer."""
    max_queue: int = Field(default=1000, ge=1, le=1_000_000)
    """Requests waiting at most; one more refuses the newest of the lowest band waiting."""
    max_queue_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, le=2**34)
    """Request bodies waiting at most, in bytes (extproc holds each body while it waits); more
    refuses the newest of the lowest band as ``max_queue`` does."""
    fairness: Literal["tenant", "none"] = "tenant"
    """Within a band: ``tenant`` takes the tenants waiting in turn, one request each (a tenant
    with 100 waiting delays another's first request by one); ``none`` is first come, first
    served."""
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    """The ``retry-after`` of the 503 that ends a wait."""

    @field_validator("max_wait")
    @classmethod
    def _wait(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not 0.0 < parse_interval(value) <= MAX_WAIT_LIMIT_S:
            raise ValueError(f"max_wait must be above 0 and at most {MAX_WAIT_LIMIT_S:g}s")
        return value

    @property
    def max_wait_s(self) -> float:
        return parse_interval(self.max_wait or DEFAULT_MAX_WAIT)


class EndpointPickerSpec(_Strict):
    metrics_interval: str = Field(default="100ms", pattern=INTERVAL_PATTERN)
    """How often each pod's ``/metrics`` is scraped (``100ms``, ``1s``)."""
    metrics_path: str = Field(default="/metrics", pattern=r"^/[\x21-\x7e]*$")
    """Path of the engine's Prometheus metrics on each pod."""
    metrics: LoadMetricNames | None = None
    """The load series of an engine the picker does not recognise by name (vLLM, SGLang, TGI,
    llama.cpp and TensorRT-LLM/Triton need none): ``{queue, running, kv_cache}``."""
    resolve_interval: str = Field(default="5s", pattern=INTERVAL_PATTERN)
    """How often DNS names among the endpoints are re-resolved (a headless Service: one A
    record per pod)."""
    stale_after: str = Field(default="2s", pattern=INTERVAL_PATTERN)
    """A pod whose last good scrape is older than this is scored as unknown (never dropped:
    Envoy's health checks decide liveness)."""
    dcgm_url: str | None = Field(default=None, pattern=r"^https?://\S*\{host\}\S*$")
    """Optional DCGM exporter URL per pod, ``{host}`` replaced by the pod's IP (and ``{port}``
    by its vLLM port), like ``http://{host}:9400/metrics``: GPU temperature, memory and
    clock-throttle reasons."""
    max_num_seqs: int | None = Field(default=None, ge=1, le=65_536)
    """Sequences each pod runs at once, when known (its vLLM ``--max-num-seqs``; ``llm-sidecar
    onboard`` writes the planned one): a pod not yet seen full is taken to run this many, where
    the picker would otherwise guess 16 and flow control double what it saw, overfilling pods
    in their first seconds. A pod seen full at fewer (its KV cache bound first) counts at what
    it ran (unset: the pool's ``simulate.max_num_seqs`` for simulated pods, else learned from
    the pods' metrics alone)."""
    weights: PickerWeights = Field(default_factory=PickerWeights)
    saturation: SaturationSpec | None = Field(default_factory=SaturationSpec)
    """Shedding of low-priority requests when the whole pool is saturated; ``null`` never sheds.
    Its ``kv_cache`` is also the KV use at which flow control counts a pod full."""
    flow_control: FlowControlSpec | None = None
    """Requests wait in priority bands while every pod is busy, instead of low ones being shed
    and the others piled onto full pods (``{}``: the defaults; absent: no waiting)."""

    @field_validator("metrics_interval", "resolve_interval", "stale_after")
    @classmethod
    def _intervals(cls, value: str) -> str:
        return _interval(value)

    @property
    def interval_s(self) -> float:
        return parse_interval(self.metrics_interval)

    @property
    def resolve_s(self) -> float:
        return parse_interval(self.resolve_interval)

    @property
    def stale_s(self) -> float:
        return parse_interval(self.stale_after)
