"""Per-endpoint metrics of the picker pools, re-exported by extproc.

The gauges are computed when Prometheus scrapes, from the PoolStates themselves (a custom
collector), so they always name exactly the pods the pools have now: a pod that leaves its pool
leaves the output, and label cardinality is bounded by the pools' pods. Load gauges (queue,
running, KV use, prefix hit rate, GPU) show what the picker sees: a pod whose metrics are stale
or were never read has none, only its scrape age and failures.

``endpoint`` is the pod's ``ip:port``; ``cluster`` comes from the config, never from a client.
With ``--workers N`` every worker scrapes on its own: gauges merge to the largest (the oldest
scrape age), the failure counters to the sum over workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.picker.state import PodMetrics, PoolState

LABELS = ["cluster", "endpoint"]

_GAUGES: tuple[tuple[str, str, Callable[[PodMetrics], float | bool | None]], ...] = (
    ("llm_sidecar_endpoint_queue",
     "Requests waiting on the pod (vllm:num_requests_waiting, or its engine's queue).",
     lambda m: m.waiting),
    ("llm_sidecar_endpoint_running",
     "Requests running on the pod (vllm:num_requests_running, or its engine's).",
     lambda m: m.running),
    ("llm_sidecar_endpoint_kv_cache_usage",
     "KV-cache use of the pod, 0 to 1 (none when its engine exposes no KV gauge).",
     lambda m: m.kv_usage),
    ("llm_sidecar_endpoint_gpu_temperature_celsius", "Hottest GPU of the pod (DCGM).",
     lambda m: m.gpu_temp_c),
    ("llm_sidecar_endpoint_gpu_memory_used_ratio", "Fullest GPU framebuffer of the pod (DCGM).",
     lambda m: m.gpu_mem_used_frac),
    ("llm_sidecar_endpoint_throttled",
     "1 when a GPU of the pod has a thermal or power-brake clock slowdown (DCGM).",
     lambda m: m.throttled),
)


class EndpointMetrics(Collector):
    """The picker's metrics on ``registry``; the gauges read ``pools`` (the picker's dict) at
    scrape time, ``clock`` being the scraper's (for the scrape age)."""

    def __init__(self, registry: CollectorRegistry, pools: Mapping[str, PoolState],
                 clock: Callable[[], float]) -> None:
        self._pools = pools
        self._clock = clock
        self._picks: dict[tuple[str, str, str], int] = {}
        self._shed = Counter(
            "llm_sidecar_shed", "Low-priority requests answered 503 server_overloaded because "
            "every pod of the pool was saturated.", ["cluster", "priority"], registry=registry)
        registry.register(self)

    def picked(self, cluster: str, endpoint: str, reason: str) -> None:
        """The picker sent a request to ``endpoint`` of ``cluster``; ``reason`` is a fixed word
        (a bounded label), not free text."""
        key = (cluster, endpoint, reason)
        self._picks[key] = self._picks.get(key, 0) + 1

    def shed(self, cluster: str, priority: str) -> None:
        self._shed.labels(cluster, priority).inc()

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        gauges = [GaugeMetricFamily(name, text, labels=LABELS) for name, text, _ in _GAUGES]
        hit_rate = GaugeMetricFamily(
            "llm_sidecar_endpoint_prefix_hit_rate",
            "Prefix-cache hits / queries of the pod between its last two scrapes.", labels=LABELS)
        tpot = GaugeMetricFamily(
            "llm_sidecar_endpoint_time_per_output_token_seconds",
            "The pod's smoothed seconds per output token, as the speed scorer reads it.",
            labels=LABELS)
        age = GaugeMetricFamily(
            "llm_sidecar_endpoint_scrape_age_seconds",
            "Seconds since the pod's metrics were last read.", labels=LABELS)
        in_flight = GaugeMetricFamily(
            "llm_sidecar_endpoint_in_flight",
            "Requests this extproc replica has open on the pod.", labels=LABELS)
        failures = CounterMetricFamily(
            "llm_sidecar_endpoint_scrape_failures",
            "Failed scrapes of the pod's metrics (unreachable, HTTP error, not an engine's).",
            labels=LABELS)
        ejections = CounterMetricFamily(
            "llm_sidecar_endpoint_ejections",
            "Times the picker took the pod out for answering picked requests with 5xx in a row.",
            labels=LABELS)
        ejected = GaugeMetricFamily(
            "llm_sidecar_endpoint_ejected",
            "1 while the pod is ejected (picked only when every other pod fails to connect).",
            labels=LABELS)
        picks = CounterMetricFamily(
            "llm_sidecar_endpoint_picks", "Requests the picker sent to the pod, by reason.",
            labels=[*LABELS, "reason"])
        present: set[tuple[str, str]] = set()
        for cluster, pool in list(self._pools.items()):
            for endpoint, pod in list(pool.pods.items()):
                labels = [cluster, endpoint]
                present.add((cluster, endpoint))
                failures.add_metric(labels, pod.failures_total)
                ejections.add_metric(labels, pod.ejections_total)
                ejected.add_metric(labels, 1.0 if now < pod.ejected_until else 0.0)
                in_flight.add_metric(labels, pod.in_flight)
                if pod.scraped_at is not None:
                    age.add_metric(labels, max(0.0, now - pod.scraped_at))
                metrics = pool.fresh(pod, now)
                if metrics is None:
                    continue
                for family, (_, _, read) in zip(gauges, _GAUGES, strict=True):
                    value = read(metrics)
                    if value is not None:
                        family.add_metric(labels, float(value))
                if pod.prefix_hit_rate is not None:
                    hit_rate.add_metric(labels, pod.prefix_hit_rate)
                if pod.tpot_s is not None:
                    tpot.add_metric(labels, pod.tpot_s)
        # Picks of pods that left their pool are dropped with them (bounded cardinality).
        self._picks = {k: v for k, v in self._picks.items() if k[:2] in present}
        for (cluster, endpoint, reason), count in self._picks.items():
            picks.add_metric([cluster, endpoint, reason], count)
        yield from (*gauges, hit_rate, tpot, age, in_flight, failures, ejections, ejected, picks)


    def describe(self) -> Iterator[Metric]:
        """Claims the names (a registry refuses a second metric of the same name)."""
        for family in self.collect():
            family.samples = []
            yield family
