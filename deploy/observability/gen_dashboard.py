"""Writes ``llm-sidecar-dashboard.json`` (Grafana) beside this file: ``python gen_dashboard.py``.

The dashboard is generated so that its queries are plain data a test can check against the
metrics the services export (tests/observability/test_dashboard.py).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

RATE = "[5m]"

ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Traffic and errors by route", [
        ("Requests/s by model, cluster, variant, outcome", "reqps", [
            (f"sum by (model, cluster, variant, outcome) (rate(llm_sidecar_requests_total{RATE}))",
             "{{model}} {{cluster}} {{variant}} {{outcome}}")]),
        ("5xx share by cluster", "percentunit", [
            (f'sum by (cluster) (rate(llm_sidecar_requests_total{{outcome="error"}}{RATE})) / '
             f"sum by (cluster) (rate(llm_sidecar_requests_total{RATE}))", "{{cluster}}")]),
        ("Requests the gateway refused, by status and code", "reqps", [
            (f"sum by (status, code) (rate(llm_sidecar_rejections_total{RATE}))",
             "{{status}} {{code}}")]),
        ("Routing decisions by cluster and variant", "reqps", [
            (f"sum by (cluster, variant) (rate(llm_sidecar_route_decisions_total{RATE}))",
             "{{cluster}} {{variant}}")]),
        ("Canary verdict: mean ROUGE-L of the shadow pairs, and rollback", "short", [
            ("max by (model) (llm_sidecar_canary_rouge_l)", "ROUGE-L {{model}}"),
            ('max by (model) (llm_sidecar_canary_verdict{verdict="rollback"})',
             "rollback {{model}}")]),
    ]),
    # Diagnosis order: the prefix (KV) cache hit rate first, because a pod that misses it
    # recomputes each prompt, which shows up as slow prefill and then as a queue and slow
    # decode; below 75 % over a quarter of the prompt blocks is recomputed: start there. Then
    # prefill, then decode: the rows and panels read in that order.
    ("Pods of picker pools: prefix-cache hit rate first, then load", [
        ("Prefix-cache hit rate by pod (below 75 %: diagnose this first)", "percentunit", [
            ("avg by (cluster, endpoint) (llm_sidecar_endpoint_prefix_hit_rate)",
             "{{cluster}} {{endpoint}}")]),
        ("Requests waiting by pod (vllm:num_requests_waiting)", "short", [
            ("max by (cluster, endpoint) (llm_sidecar_endpoint_queue)",
             "{{cluster}} {{endpoint}}")]),
        ("KV-cache use by pod", "percentunit", [
            ("max by (cluster, endpoint) (llm_sidecar_endpoint_kv_cache_usage)",
             "{{cluster}} {{endpoint}}")]),
        ("Picks by pod and reason", "reqps", [
            (f"sum by (cluster, endpoint, reason) (rate(llm_sidecar_endpoint_picks_total{RATE}))",
             "{{endpoint}} {{reason}}")]),
        ("Low-priority requests shed (pool saturated)", "reqps", [
            (f"sum by (cluster) (rate(llm_sidecar_shed_total{RATE}))", "{{cluster}}")]),
        ("Flow control: requests waiting for a pod with room, by band", "short", [
            ("sum by (cluster, priority) (llm_sidecar_flow_queue_depth)",
             "{{cluster}} {{priority}}")]),
        ("Flow control: P99 wait by band, and 503s after waiting", "s", [
            (f"histogram_quantile(0.99, sum by (le, cluster, priority) "
             f"(rate(llm_sidecar_flow_wait_seconds_bucket{RATE})))", "p99 {{cluster}} {{priority}}"),
            (f"sum by (cluster, reason) (rate(llm_sidecar_flow_rejected_total{RATE}))",
             "503/s {{cluster}} {{reason}}")]),
        ("Metrics scrape age and failures by pod", "s", [
            ("max by (cluster, endpoint) (llm_sidecar_endpoint_scrape_age_seconds)",
             "age {{endpoint}}"),
            (f"sum by (cluster, endpoint) (rate(llm_sidecar_endpoint_scrape_failures_total{RATE}))",
             "failures/s {{endpoint}}")]),
    ]),
    ("Prefill and decode latency by pool", [
        ("P50/P99 time to first token (prefill) by cluster", "s", [
            (f"histogram_quantile(0.5, sum by (le, cluster) "
             f"(rate(gen_ai_server_time_to_first_token_seconds_bucket{RATE})))", "p50 {{cluster}}"),
            (f"histogram_quantile(0.99, sum by (le, cluster) "
             f"(rate(gen_ai_server_time_to_first_token_seconds_bucket{RATE})))", "p99 {{cluster}}"),
        ]),
        ("P50/P99 time per output token (decode) by cluster", "s", [
            (f"histogram_quantile(0.5, sum by (le, cluster) "
             f"(rate(gen_ai_server_time_per_output_token_seconds_bucket{RATE})))",
             "p50 {{cluster}}"),
            (f"histogram_quantile(0.99, sum by (le, cluster) "
             f"(rate(gen_ai_server_time_per_output_token_seconds_bucket{RATE})))",
             "p99 {{cluster}}"),
        ]),
        ("P99 end-to-end latency by cluster and variant", "s", [
            (f"histogram_quantile(0.99, sum by (le, cluster, variant) "
             f"(rate(gen_ai_server_request_duration_seconds_bucket{RATE})))",
             "{{cluster}} {{variant}}")]),
        ("Tokens/s by type", "short", [
            (f"sum by (token_type) (rate(gen_ai_client_token_usage_sum{RATE}))",
             "{{token_type}}")]),
        ("extproc time per message, P99 by phase", "s", [
            (f"histogram_quantile(0.99, sum by (le, phase) "
             f"(rate(llm_sidecar_extproc_message_seconds_bucket{RATE})))", "{{phase}}")]),
    ]),
    ("Rate-limit pressure by tenant and key", [
        ("429s by tenant", "reqps", [
            (f'sum by (tenant) (rate(llm_sidecar_requests_total{{outcome="rate_limited"}}{RATE}))',
             "{{tenant}}")]),
        ("Decisions by level, kind and result", "reqps", [
            (f"sum by (level, kind, result) (rate(ratelimit_decisions_total{RATE}))",
             "{{level}} {{kind}} {{result}}")]),
        ("Bucket store latency P99 and backend errors", "s", [
            (f"histogram_quantile(0.99, sum by (le) (rate(ratelimit_backend_seconds_bucket{RATE})))",
             "p99"),
            (f"sum by (reason) (rate(ratelimit_backend_errors_total{RATE}))", "errors {{reason}}"),
        ]),
        ("Redis circuit breaker (0 closed, 1 open, 2 half-open)", "short", [
            ("max(ratelimit_breaker_state)", "state")]),
    ]),
    ("Embedding cache", [
        ("Cache hit rate (inputs)", "percentunit", [
            (f'sum(rate(llm_sidecar_cache_inputs_total{{result="hit"}}{RATE})) / '
             f"sum(rate(llm_sidecar_cache_inputs_total{RATE}))", "hit rate")]),
        ("Cache lookups by result", "reqps", [
            (f"sum by (result) (rate(llm_sidecar_cache_lookups_total{RATE}))", "{{result}}")]),
    ]),
]


def panel(panel_id: int, title: str, unit: str, targets: list[tuple[str, str]], x: int,
          y: int) -> dict[str, Any]:
    return {
        "id": panel_id, "type": "timeseries", "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": chr(65 + i), "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y, panel_id = 0, 1
    for row_title, row_panels in ROWS:
        panels.append({"id": panel_id, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id += 1
        y += 1
        for i, (title, unit, targets) in enumerate(row_panels):
            panels.append(panel(panel_id, title, unit, targets, 12 * (i % 2), y + 8 * (i // 2)))
            panel_id += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "title": "llm-sidecar", "uid": "llm-sidecar", "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "tags": ["llm", "envoy"],
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus", "label": "Prometheus"}]},
        "panels": panels,
    }


if __name__ == "__main__":
    out = pathlib.Path(__file__).with_name("llm-sidecar-dashboard.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(out)
