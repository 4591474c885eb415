"""Flow control's metrics (docs: Flow control). ``cluster`` comes from the config and
``priority`` and ``reason`` are fixed words: the label sets are bounded."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["cluster", "priority"]
        self._depth = Gauge(
            "llm_sidecar_flow_queue_depth",
            "Requests waiting in extproc for a pod of the pool with room, by priority band.",
            labels, registry=registry)
        self._wait = Histogram(
            "llm_sidecar_flow_wait_seconds",
            "How long requests waited for a pod with room (released or refused).",
            labels, buckets=WAIT_BUCKETS, registry=registry)
        self._rejected = Counter(
            "llm_sidecar_flow_rejected",
            "Waiting requests answered 503 server_overloaded: reason max_wait (waited too long) "
            "or max_queue (the queue was full and it was the newest of the lowest band).",
            [*labels, "reason"], registry=registry)
        self._abandoned = Counter(
            "llm_sidecar_flow_abandoned",
            "Waiting requests whose client hung up (nothing sent, nothing charged).",
            labels, registry=registry)

    def depth(self, cluster: str, priority: str, depth: int) -> None:
        self._depth.labels(cluster, priority).set(depth)

    def waited(self, cluster: str, priority: str, seconds: float) -> None:
        self._wait.labels(cluster, priority).observe(seconds)

    def rejected(self, cluster: str, priority: str, reason: str, seconds: float) -> None:
        self._rejected.labels(cluster, priority, reason).inc()
        self._wait.labels(cluster, priority).observe(seconds)

    def abandoned(self, cluster: str, priority: str) -> None:
        self._abandoned.labels(cluster, priority).inc()
