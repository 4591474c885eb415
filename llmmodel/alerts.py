"""A model's SLO burn-rate alerts, as a Prometheus Operator ``PrometheusRule``.

Two SLOs come from ``spec.sla``:

- availability: the share of requests not answered with a server error, from extproc's
  ``llm_sidecar_requests_total{model, outcome}``: bad is ``outcome="error"``; requests the
  client caused (``client_error``, ``rate_limited``) are not counted at all;
- latency: 99% of requests get their first token within ``p99Latency``, from extproc's
  ``gen_ai_server_time_to_first_token_seconds`` histogram: bad is the share above the bucket
  ``le`` at or above the SLA (the histogram has fixed buckets, so an SLA between two bounds is
  judged at the next bound up, and :func:`ttft_bound` says which).

Alerts are the multi-window, multi-burn-rate ones of the Google SRE Workbook, chapter "Alerting
on SLOs" (https://sre.google/workbook/alerting-on-slos/, table "Recommended parameters"): page at
14.4x the budget rate over 1h (and 5m), page at 6x over 6h (and 30m), ticket at 1x over 3d (and
6h); the short window makes an alert stop soon after the burn does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client.utils import floatToGoString

from extproc.telemetry.metrics import LATENCY_BUCKETS
from llmmodel.plans import ModelPlan
from routing.units import parse_duration

REQUESTS = "llm_sidecar_requests_total"
TTFT = "gen_ai_server_time_to_first_token_seconds"
LATENCY_TARGET = 0.99
"""``p99Latency``: 99% of requests under it."""


@dataclass(frozen=True)
class BurnWindow:
    long: str
    short: str
    burn_rate: float
    severity: str
    budget_spent: str
    """Share of a 30-day error budget spent when it fires (the workbook's column)."""


WINDOWS = (BurnWindow("1h", "5m", 14.4, "page", "2%"),
           BurnWindow("6h", "30m", 6.0, "page", "5%"),
           BurnWindow("3d", "6h", 1.0, "ticket", "10%"))


def ttft_bound(seconds: float) -> float:
    """The histogram bound the latency SLO is judged at: the smallest at or above the SLA (the
    largest bound for an SLA above every bucket)."""
    return next((b for b in LATENCY_BUCKETS if b >= seconds - 1e-12), LATENCY_BUCKETS[-1])


def le_label(bound: float) -> str:
    """The ``le`` label value of ``bound``, written by the Prometheus client's own formatter
    (Go's float formatting: ``1.0``, ``0.25``, ``+Inf``)."""
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call]


def _windows() -> list[str]:
    return sorted({w for b in WINDOWS for w in (b.long, b.short)}, key=parse_duration)


def _error_ratio(model: str, window: str) -> str:
    sel = f'model="{model}"'
    return (f'sum(rate({REQUESTS}{{{sel},outcome="error"}}[{window}]))\n/\n'
            f'sum(rate({REQUESTS}{{{sel},outcome!~"client_error|rate_limited"}}[{window}]))')


def _slow_ratio(model: str, window: str, bound: float) -> str:
    sel = f'model="{model}"'
    le = le_label(bound)
    return (f'1 - (\n  sum(rate({TTFT}_bucket{{{sel},le="{le}"}}[{window}]))\n  /\n'
            f'  sum(rate({TTFT}_count{{{sel}}}[{window}]))\n)')


def _record(sli: str, window: str) -> str:
    return f"llmmodel:{sli}:ratio_rate{window}"


def _number(value: float) -> str:
    return f"{value:.6g}"


def _bound_note(bound: float, seconds: float, written: str) -> str:
    if abs(bound - seconds) < 1e-9:
        return ""
    if bound > seconds:
        return f" (SLA {written}: judged at the histogram's next bucket bound)"
    return f" (SLA {written}: above the histogram's largest bucket, judged at it)"


def rule_groups(plan: ModelPlan) -> list[dict[str, Any]]:
    """Recording rules of both SLIs per window, then the alerts that read them."""
    sla = plan.model.spec.sla
    name = plan.name
    bound = ttft_bound(sla.p99_latency_s)
    slis: tuple[tuple[str, float, Callable[[str], str], str], ...] = (
        ("availability_errors", 1 - sla.availability_fraction,
         lambda w: _error_ratio(name, w), f"availability {sla.availability}"),
        ("ttft_slow", 1 - LATENCY_TARGET, lambda w: _slow_ratio(name, w, bound),
         f"time to first token under {le_label(bound)}s for 99% of requests"
         + _bound_note(bound, sla.p99_latency_s, sla.p99_latency)))
    labels = {"model": name}
    records = [{"record": _record(sli, w), "expr": ratio(w), "labels": labels}
               for sli, _budget, ratio, _what in slis for w in _windows()]
    alerts = []
    for sli, budget, _ratio, what in slis:
        title = "Availability" if sli.startswith("availability") else "TTFT"
        for window in WINDOWS:
            threshold = _number(window.burn_rate * budget)
            alerts.append({
                "alert": f"LLMModel{title}BurnRate{window.long}",
                "expr": (f'{_record(sli, window.long)}{{model="{name}"}} > {threshold}\nand\n'
                         f'{_record(sli, window.short)}{{model="{name}"}} > {threshold}'),
                "labels": {"severity": window.severity, **labels},
                "annotations": {
                    "summary": f"{name}: {what} is burning its error budget "
                               f"{_number(window.burn_rate)}x too fast",
                    "description": (f"Over the last {window.long} and {window.short}, more than "
                                    f"{threshold} of {name}'s requests were bad (budget "
                                    f"{_number(budget)}): at this rate {window.budget_spent} of a "
                                    "30-day budget is spent within the long window."),
                }})
    return [{"name": f"{name}-slo-records", "rules": records},
            {"name": f"{name}-slo-alerts", "rules": alerts}]


def prometheus_rule(plan: ModelPlan, *, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": f"{plan.name}-slo", "namespace": namespace, "labels": labels},
            "spec": {"groups": rule_groups(plan)}}
