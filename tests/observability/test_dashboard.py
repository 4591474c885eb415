"""Every query in the dashboard and the alert rules names a metric the services export."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import yaml
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from extproc.canary.verdict import PairMetrics
from extproc.flow.metrics import FlowMetrics
from extproc.picker.metrics import EndpointMetrics
from extproc.telemetry.envoy_drift import EnvoyDrift
from extproc.telemetry.metrics import ExtprocMetrics
from ratelimit.metrics import RateLimitMetrics
from sidecar_runtime.process.key_audit import audit_key_id_secret
from sidecar_runtime.redis.audit import audit_redis

ROOT = pathlib.Path(__file__).resolve().parents[2]
OBS = ROOT / "deploy" / "observability"
FUNCTIONS = {"sum", "rate", "histogram_quantile", "max", "min", "avg", "by", "without", "irate",
             "increase", "count", "topk", "bottomk", "and", "or", "unless", "on", "ignoring",
             "group_left", "group_right", "offset"}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",), "summary": ("_sum", "_count")}


def exported() -> set[str]:
    registry = CollectorRegistry()
    ExtprocMetrics(registry, lambda: frozenset())
    RateLimitMetrics(registry)
    audit_redis(None, True, registry, "any")  # llm_sidecar_redis_unauthenticated, both services
    audit_key_id_secret(SecretStr("x"), True, registry)  # extproc
    EndpointMetrics(registry, {}, lambda: 0.0)  # extproc's endpoint picker
    FlowMetrics(registry)  # extproc's flow control
    PairMetrics(registry)  # extproc's canary verdict
    EnvoyDrift(registry)  # extproc: Envoy's bootstrap against the running file
    cache_metrics = importlib.util.find_spec("extproc.cache.metrics")
    if cache_metrics is not None:
        module = importlib.import_module("extproc.cache.metrics")
        module.CacheMetrics(registry)
    names: set[str] = set()
    for family in registry.collect():
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def metric_names(expr: str) -> set[str]:
    text = re.sub(r'"[^"]*"', "", expr)             # strings
    text = re.sub(r"\{[^}]*\}", "", text)           # label matchers
    text = re.sub(r"\b(by|without)\s*\([^)]*\)", "", text)  # grouping labels
    text = re.sub(r"\[[^\]]*\]", "", text)          # ranges
    found = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text))
    return {name for name in found if name not in FUNCTIONS}


def dashboard_exprs() -> list[str]:
    board = json.loads((OBS / "llm-sidecar-dashboard.json").read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((OBS / "alerts.yaml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_every_dashboard_and_alert_query_names_an_exported_metric() -> None:
    known = exported()
    exprs = dashboard_exprs() + alert_exprs()
    assert len(exprs) >= 15
    missing = {name for expr in exprs for name in metric_names(expr)} - known
    assert not missing, f"queries name metrics nobody exports: {sorted(missing)}"


def test_the_dashboard_covers_the_four_funnels() -> None:
    board = json.loads((OBS / "llm-sidecar-dashboard.json").read_text())
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Traffic and errors by route",
                    "Pods of picker pools: prefix-cache hit rate first, then load",
                    "Prefill and decode latency by pool",
                    "Rate-limit pressure by tenant and key", "Embedding cache"]


def test_the_committed_dashboard_is_what_the_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("gen_dashboard", OBS / "gen_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = json.loads((OBS / "llm-sidecar-dashboard.json").read_text())
    assert committed == module.dashboard(), "run python deploy/observability/gen_dashboard.py"


def test_the_name_extractor() -> None:
    assert metric_names('sum by (le, x) (rate(a_b_bucket{y="z"}[5m])) / max(c)') == {"a_b_bucket",
                                                                                     "c"}
