"""Canary vs stable, side by side, from extproc's own Prometheus metrics.

``llm-sidecar canary --metrics URL`` and ``GET /canary`` on extproc's metrics port both print
this. Quantiles are estimated from histogram buckets the way PromQL's ``histogram_quantile``
does (linear inside a bucket), so they are as fine as the buckets.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

MIN_SAMPLES = 30
SAME_WITHIN = 0.10


@dataclass(frozen=True)
class Row:
    metric: str
    stable: float | None
    canary: float | None
    stable_n: int
    canary_n: int
    verdict: str
    """better, worse, same (within 10%), or not enough data."""


Histo = dict[float, float]  # upper bound -> cumulative count


def quantile(q: float, buckets: Histo) -> float | None:
    """``histogram_quantile`` over cumulative buckets; None when there are no observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def judge(stable: float | None, canary: float | None, stable_n: int, canary_n: int,
          lower_is_better: bool, min_samples: int) -> str:
    if stable is None or canary is None or min(stable_n, canary_n) < min_samples:
        return "not enough data"
    if stable == canary or abs(canary - stable) <= SAME_WITHIN * max(abs(stable), 1e-9):
        return "same"
    return "better" if (canary < stable) == lower_is_better else "worse"


@dataclass
class _Variant:
    requests: float = 0.0
    errors: float = 0.0
    histos: dict[str, Histo] | None = None
    sums: dict[str, float] | None = None
    counts: dict[str, float] | None = None


def _collect(text: str, model: str) -> dict[str, _Variant]:
    variants: dict[str, _Variant] = defaultdict(_Variant)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if labels.get("model") != model or "variant" not in labels:
                continue
            v = variants[labels["variant"]]
            if v.histos is None:
                v.histos, v.sums, v.counts = defaultdict(dict), defaultdict(float), \
                    defaultdict(float)
            assert v.histos is not None and v.sums is not None and v.counts is not None
            name = family.name
            if family.name == "gen_ai_client_token_usage":
                name = f"{name}:{labels.get('token_type')}"
            if sample.name == "llm_sidecar_requests_total":
                v.requests += sample.value
                if labels.get("outcome") == "error":
                    v.errors += sample.value
            elif sample.name.endswith("_bucket"):
                bound = float(labels["le"])
                v.histos[name][bound] = v.histos[name].get(bound, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                v.sums[name] += sample.value
            elif sample.name.endswith("_count"):
                v.counts[name] += sample.value
    return variants


def report(text: str, model: str, min_samples: int = MIN_SAMPLES) -> list[Row]:
    """Rows comparing the ``canary`` and ``stable`` variants of ``model``."""
    variants = _collect(text, model)
    stable, canary = variants.get("stable", _Variant()), variants.get("canary", _Variant())
    rows = [Row("requests", stable.requests, canary.requests, int(stable.requests),
                int(canary.requests), "-")]
    s_rate = stable.errors / stable.requests if stable.requests else None
    c_rate = canary.errors / canary.requests if canary.requests else None
    rows.append(Row("error rate", s_rate, c_rate, int(stable.requests), int(canary.requests),
                    judge(s_rate, c_rate, int(stable.requests), int(canary.requests), True,
                          min_samples)))
    for metric, title in (("gen_ai_server_time_to_first_token_seconds", "TTFT"),
                          ("gen_ai_server_time_per_output_token_seconds", "time per output token"),
                          ("gen_ai_server_request_duration_seconds", "end-to-end latency")):
        for q in (0.5, 0.99):
            s_h = (stable.histos or {}).get(metric, {})
            c_h = (canary.histos or {}).get(metric, {})
            s_n = int(s_h.get(float("inf"), 0))
            c_n = int(c_h.get(float("inf"), 0))
            s_v, c_v = quantile(q, s_h), quantile(q, c_h)
            rows.append(Row(f"{title} p{int(q * 100)} (s)", s_v, c_v, s_n, c_n,
                            judge(s_v, c_v, s_n, c_n, True, min_samples)))
    for token_type, title in (("input", "prompt tokens / request"),
                              ("output", "completion tokens / request")):
        key = f"gen_ai_client_token_usage:{token_type}"
        s_n = int((stable.counts or {}).get(key, 0))
        c_n = int((canary.counts or {}).get(key, 0))
        s_v = (stable.sums or {}).get(key, 0.0) / s_n if s_n else None
        c_v = (canary.sums or {}).get(key, 0.0) / c_n if c_n else None
        rows.append(Row(title, s_v, c_v, s_n, c_n, "-"))
    return rows


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}"


def render(rows: list[Row], model: str) -> str:
    lines = [f"canary vs stable for {model}",
             f"{'metric':<30} {'stable':>10} {'canary':>10} {'n stable':>9} {'n canary':>9}  verdict"]
    for row in rows:
        lines.append(f"{row.metric:<30} {_fmt(row.stable):>10} {_fmt(row.canary):>10} "
                     f"{row.stable_n:>9} {row.canary_n:>9}  {row.verdict}")
    return "\n".join(lines)


def models_with_canary(text: str) -> list[str]:
    found: set[str] = set()
    for family in text_string_to_metric_families(text):
        if family.name == "llm_sidecar_route_decisions":
            found.update(s.labels["model"] for s in family.samples
                         if s.labels.get("variant") == "canary")
    return sorted(found)


def render_all(text: str, min_samples: int = MIN_SAMPLES) -> str:
    """The comparison for every model that has served a canary request."""
    pages = [render(report(text, model, min_samples), model)
             for model in models_with_canary(text)]
    return "\n\n".join(pages) if pages else "no canary traffic yet"
