from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from extproc.canary.report import judge, quantile, render_all, report
from extproc.records import RequestRecord
from extproc.telemetry.metrics import ExtprocMetrics


def test_quantile_interpolates_inside_buckets() -> None:
    buckets = {0.1: 50.0, 0.2: 100.0, float("inf"): 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.75, buckets) == pytest.approx(0.15)
    assert quantile(0.5, {}) is None
    assert quantile(0.99, {1.0: 0.0, float("inf"): 5.0}) == 1.0


@pytest.mark.parametrize(("stable", "canary", "n", "expected"), [
    (1.0, 2.0, 50, "worse"), (1.0, 0.5, 50, "better"), (1.0, 1.05, 50, "same"),
    (1.0, 2.0, 5, "not enough data"), (None, 1.0, 50, "not enough data"),
])
def test_judge(stable: float | None, canary: float | None, n: int, expected: str) -> None:
    assert judge(stable, canary, n, n, True, 30) == expected


def test_report_from_real_metrics_shows_a_slow_canary_as_worse() -> None:
    registry = CollectorRegistry()
    metrics = ExtprocMetrics(registry, lambda: frozenset({"default"}))
    for i in range(40):
        for variant, ttft in (("stable", 0.02), ("canary", 0.4)):
            metrics.routed("m", "c", variant)
            metrics.request_done(RequestRecord(
                f"r{i}", "m", "c", variant, "default", 200, True, variant == "canary" and i < 4,
                0.5, ttft, 0.01, 10, 20, 30))
    rows = {r.metric: r for r in report(generate_latest(registry).decode(), "m")}
    assert rows["requests"].stable == 40 and rows["requests"].canary == 40
    assert rows["TTFT p99 (s)"].verdict == "worse"
    assert rows["TTFT p50 (s)"].verdict == "worse"
    assert rows["error rate"].verdict == "worse"
    assert rows["completion tokens / request"].canary == 20
    text = render_all(generate_latest(registry).decode())
    assert "canary vs stable for m" in text and "worse" in text
