"""The per-endpoint metrics: what the picker sees, and only the pods the pools have now."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.picker.metrics import EndpointMetrics
from extproc.picker.state import PodMetrics, PoolState

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition text, as Prometheus would read it."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def of(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
       endpoint: str, cluster: str = "pool", **labels: str) -> float | None:
    key = tuple(sorted({"cluster": cluster, "endpoint": endpoint, **labels}.items()))
    return found.get((name, key))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup() -> tuple[CollectorRegistry, PoolState, EndpointMetrics, Clock]:
    registry = CollectorRegistry()
    clock = Clock()
    pool = PoolState("pool", stale_s=2.0)
    pool.set_addresses([A, B])
    metrics = EndpointMetrics(registry, {"pool": pool}, clock)
    return registry, pool, metrics, clock


def test_gauges_show_what_the_picker_sees(
        setup: tuple[CollectorRegistry, PoolState, EndpointMetrics, Clock]) -> None:
    registry, pool, _, clock = setup
    pool.record_scrape(A, PodMetrics(waiting=4, running=2, kv_usage=0.5, prefix_queries=100,
                                     prefix_hits=10), now=99.0)
    pool.record_scrape(A, PodMetrics(waiting=5, running=3, kv_usage=0.75, prefix_queries=200,
                                     prefix_hits=70, gpu_temp_c=81.0, gpu_mem_used_frac=0.9,
                                     throttled=True), now=99.5)
    pool.record_failure(B)
    pool.record_failure(B)
    pool.sent(A)
    found = samples(registry)
    assert of(found, "llm_sidecar_endpoint_queue", A) == 5
    assert of(found, "llm_sidecar_endpoint_running", A) == 3
    assert of(found, "llm_sidecar_endpoint_kv_cache_usage", A) == 0.75
    assert of(found, "llm_sidecar_endpoint_prefix_hit_rate", A) == pytest.approx(0.6)
    assert of(found, "llm_sidecar_endpoint_gpu_temperature_celsius", A) == 81
    assert of(found, "llm_sidecar_endpoint_gpu_memory_used_ratio", A) == 0.9
    assert of(found, "llm_sidecar_endpoint_throttled", A) == 1
    assert of(found, "llm_sidecar_endpoint_scrape_age_seconds", A) == pytest.approx(0.5)
    assert of(found, "llm_sidecar_endpoint_in_flight", A) == 1
    assert of(found, "llm_sidecar_endpoint_scrape_failures_total", A) == 0
    # B was never read: no load gauges, no age, but its failures are there.
    assert of(found, "llm_sidecar_endpoint_scrape_failures_total", B) == 2
    for name in ("queue", "running", "kv_cache_usage", "scrape_age_seconds"):
        assert of(found, f"llm_sidecar_endpoint_{name}", B) is None

    clock.now = 110.0  # A is stale now: only its age and counters remain
    found = samples(registry)
    assert of(found, "llm_sidecar_endpoint_queue", A) is None
    assert of(found, "llm_sidecar_endpoint_throttled", A) is None
    assert of(found, "llm_sidecar_endpoint_scrape_age_seconds", A) == pytest.approx(10.5)


def test_gpu_gauges_absent_when_unknown(
        setup: tuple[CollectorRegistry, PoolState, EndpointMetrics, Clock]) -> None:
    registry, pool, _, _ = setup
    pool.record_scrape(A, PodMetrics(waiting=1, throttled=False), now=100.0)
    found = samples(registry)
    assert of(found, "llm_sidecar_endpoint_throttled", A) == 0
    assert of(found, "llm_sidecar_endpoint_gpu_temperature_celsius", A) is None
    assert of(found, "llm_sidecar_endpoint_prefix_hit_rate", A) is None  # one scrape: no rate


def test_a_pod_that_leaves_its_pool_leaves_the_metrics(
        setup: tuple[CollectorRegistry, PoolState, EndpointMetrics, Clock]) -> None:
    registry, pool, metrics, _ = setup
    pool.record_scrape(B, PodMetrics(waiting=7), now=100.0)
    pool.record_failure(B)
    metrics.picked("pool", A, "best")
    metrics.picked("pool", B, "best")
    metrics.picked("pool", B, "best")
    metrics.picked("pool", B, "prefix")
    found = samples(registry)
    assert of(found, "llm_sidecar_endpoint_picks_total", B, reason="best") == 2
    assert of(found, "llm_sidecar_endpoint_picks_total", B, reason="prefix") == 1
    pool.set_addresses([A])  # B resolved away
    found = samples(registry)
    assert not [key for key in found if ("endpoint", B) in key[1]]
    assert of(found, "llm_sidecar_endpoint_picks_total", A, reason="best") == 1
    pool.set_addresses([A, B])  # back, as a new pod: counted from zero
    found = samples(registry)
    assert of(found, "llm_sidecar_endpoint_picks_total", B, reason="best") is None
    assert of(found, "llm_sidecar_endpoint_scrape_failures_total", B) == 0


def test_a_removed_pool_leaves_the_metrics() -> None:
    registry = CollectorRegistry()
    pools = {"one": PoolState("one", 2.0), "two": PoolState("two", 2.0)}
    pools["one"].set_addresses([A])
    pools["two"].set_addresses([A])
    EndpointMetrics(registry, pools, lambda: 0.0)
    assert of(samples(registry), "llm_sidecar_endpoint_in_flight", A, cluster="two") == 0
    del pools["two"]
    found = samples(registry)
    assert of(found, "llm_sidecar_endpoint_in_flight", A, cluster="two") is None
    assert of(found, "llm_sidecar_endpoint_in_flight", A, cluster="one") == 0


def test_shed_counter(setup: tuple[CollectorRegistry, PoolState, EndpointMetrics, Clock]) -> None:
    registry, _, metrics, _ = setup
    metrics.shed("pool", "low")
    metrics.shed("pool", "low")
    found = samples(registry)
    assert found[("llm_sidecar_shed_total", (("cluster", "pool"), ("priority", "low")))] == 2


def test_the_names_are_claimed_on_the_registry() -> None:
    registry = CollectorRegistry()
    EndpointMetrics(registry, {}, lambda: 0.0)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Gauge("llm_sidecar_endpoint_queue", "clash", registry=registry)
