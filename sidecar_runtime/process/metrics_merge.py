"""One ``/metrics`` for a service run as several worker processes (``--workers N``).

Each worker keeps its own prometheus_client registry and serves it on a private Unix socket;
the supervisor scrapes them all and merges the texts here. Pure: text in, text out.

- counters, histograms, summaries (and untyped samples): summed per label set, so
  ``rate(llm_sidecar_requests_total[1m])`` is the whole process's rate;
- ``*_created`` (when a series started): the earliest;
- gauges: the largest, which for the state gauges this project has (breaker open = 1, canary
  tripped = 1, Redis without a password = 1) is the worst worker; except those in
  :data:`MIN_GAUGES`, where the worst worker is the smallest (a reload rejected = 0, the
  oldest config still running), and those in :data:`SUMMED_GAUGES`, amounts each worker holds
  (requests open on a pod), summed over the live workers.

A worker that died and was replaced gives its last counters as a *retired* text: they keep
being added (``live=False`` drops its gauges), so a sum never goes down because one worker
restarted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

MIN_GAUGES = frozenset({
    "extproc_config_last_reload_ok",
    "extproc_config_applied_timestamp_seconds",
})
"""Gauges whose smallest worker value is the one to report."""
SUMMED_GAUGES = frozenset({"llm_sidecar_endpoint_in_flight", "llm_sidecar_grpc_connections",
                           "llm_sidecar_flow_queue_depth"})
"""Gauges that count what each worker has (its requests open on a pod): the process's is the
sum over the live workers."""

SUMMED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram", "unknown",
                          "untyped"})


@dataclass(frozen=True)
class Scrape:
    """One worker's exposition text; ``live=False`` for a worker that is gone (counters only)."""

    text: str
    live: bool = True


def _rule(family: Metric) -> str:
    if family.type in SUMMED_TYPES:
        return "sum"
    if family.name.endswith("_created") or family.name in MIN_GAUGES:
        return "min"
    return "live_sum" if family.name in SUMMED_GAUGES else "max"


def merge(scrapes: Sequence[Scrape]) -> list[Metric]:
    """The families of every scrape, combined sample by sample (first-seen order kept)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for scrape in scrapes:
        for family in text_string_to_metric_families(scrape.text):
            rule = _rule(family)
            if not scrape.live and rule != "sum":
                continue  # a dead worker's gauges say nothing about now
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type,
                                               family.unit)
                values[family.name] = {}
            merged = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = merged.get(key)
                if old is None:
                    merged[key] = sample.value
                elif rule in ("sum", "live_sum"):
                    merged[key] = old + sample.value
                elif rule == "min":
                    merged[key] = min(old, sample.value)
                else:
                    merged[key] = max(old, sample.value)
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    return list(families.values())


class _Fixed:
    """A collector that yields families already built."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def exposition(families: Iterable[Metric]) -> bytes:
    """Prometheus text format of ``families``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families))
    return generate_latest(registry)
