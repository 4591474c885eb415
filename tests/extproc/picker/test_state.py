"""PoolState's smoothed time per output token: deltas of vLLM's inter-token histogram between
good scrapes, an EWMA, None until known; and the gauge that shows it."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.picker.metrics import EndpointMetrics
from extproc.picker.state import TPOT_ALPHA, PodMetrics, PoolState

POD = "10.0.0.1:8000"


def tokens(seconds: float, count: float) -> PodMetrics:
    return PodMetrics(token_gap_sum=seconds, token_gap_count=count)


def smoothed(*scrapes: PodMetrics) -> float | None:
    pool = PoolState("pool", stale_s=2.0)
    pool.set_addresses([POD])
    for i, metrics in enumerate(scrapes):
        pool.record_scrape(POD, metrics, float(i))
    return pool.pods[POD].tpot_s


@pytest.mark.parametrize(("scrapes", "expected"), [
    ((), None),
    ((tokens(5.0, 100),), None),                                # one scrape: no interval yet
    ((tokens(5.0, 100), tokens(6.0, 200)), 0.01),               # 1 s over 100 tokens
    ((tokens(0, 0), tokens(0.2, 10), tokens(0.2, 10)), 0.02),   # an idle interval changes nothing
    ((tokens(0, 0), tokens(0, 0), tokens(0, 0)), None),         # never a token: unknown
    ((tokens(0, 0), tokens(0.1, 10), tokens(0.4, 20)),          # 10 ms, then 30 ms: smoothed
     0.01 + TPOT_ALPHA * (0.03 - 0.01)),
    ((tokens(0, 0), tokens(0.1, 10), tokens(0.01, 1), tokens(0.03, 2)),  # a restart (counters
     0.01 + TPOT_ALPHA * (0.02 - 0.01)),                                 # reset): skipped
    ((tokens(0, 0), tokens(0, 10)), 1e-6),                      # a zero sum is floored, never 0
])
def test_tpot_is_an_ewma_of_the_intervals_with_tokens(scrapes: tuple[PodMetrics, ...],
                                                      expected: float | None) -> None:
    got = smoothed(*scrapes)
    assert got == (None if expected is None else pytest.approx(expected))


def test_tpot_survives_failed_scrapes_and_is_dropped_with_the_pod() -> None:
    pool = PoolState("pool", stale_s=2.0)
    pool.set_addresses([POD])
    pool.record_scrape(POD, tokens(0, 0), 0.0)
    pool.record_scrape(POD, tokens(0.5, 50), 0.1)
    pool.record_failure(POD)
    pool.record_failure(POD, connect=True)
    assert pool.pods[POD].tpot_s == pytest.approx(0.01)
    pool.set_addresses(["10.0.0.2:8000"])
    pool.set_addresses([POD])  # back, as a new pod: measured afresh
    assert pool.pods[POD].tpot_s is None


def test_the_smoothed_tpot_is_exported_while_the_metrics_are_fresh() -> None:
    registry = CollectorRegistry()
    now = [10.0]
    pool = PoolState("pool", stale_s=2.0)
    pool.set_addresses([POD, "10.0.0.2:8000"])
    EndpointMetrics(registry, {"pool": pool}, lambda: now[0])
    pool.record_scrape(POD, tokens(1.0, 100), 9.0)
    pool.record_scrape(POD, tokens(1.5, 200), 9.5)
    pool.record_scrape("10.0.0.2:8000", tokens(0, 0), 9.5)  # no tokens yet: no gauge
    name = "llm_sidecar_endpoint_time_per_output_token_seconds"

    def exported() -> dict[str, float]:
        text = generate_latest(registry).decode()
        return {s.labels["endpoint"]: s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == name}

    assert exported() == {POD: pytest.approx(0.005)}
    now[0] = 12.0  # stale: the picker scores the pod unknown, and shows no speed for it
    assert exported() == {}
