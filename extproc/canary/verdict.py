"""The canary verdict on shadow pairs (docs: Canary verdict): pure figures and judgement.

A pair is one stable answer and the canary's answer to the same request, replayed as a shadow
(:mod:`extproc.canary.shadow`). Pairs are kept as Prometheus histograms and counters
(:class:`PairMetrics`), which sum across ``--workers`` processes; :func:`pair_stats` reads them
back, from a registry's own families (the process judging itself) or from a merged
exposition text (``llm-sidecar canary``), and :func:`judge` decides from that alone, so both
say the same from the same pairs.

Confidence: a 95% bootstrap interval of the mean ROUGE-L F1 (resampling the pairs' scores as
binned in :data:`ROUGE_BUCKETS`, 0.05 wide, 2,000 resamples, a fixed seed: the same pairs give
the same interval). Latency and cost are compared as ratios of the pairs' figures, without an
interval: a ratio over its maximum is a rollback at any confidence, since a latency that is
only probably worse is still what a client may get.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from extproc.canary.report import Histo, quantile
from extproc.telemetry.metrics import LATENCY_BUCKETS, TPOT_BUCKETS
from routing.schema import CompareSpec

Verdict = Literal["promote", "hold", "rollback"]
VERDICTS: tuple[Verdict, ...] = ("promote", "hold", "rollback")
ROUGE_BUCKETS = tuple(round(0.05 * k, 2) for k in range(1, 21))
"""Upper bounds of the ROUGE-L histogram: 0.05 to 1.0."""
TTFT_FLOOR_S = 0.05
"""Stable's TTFT P99 is taken to be at least this when the canary's is judged against it: a
few milliseconds apart is no difference a client notices, and at that scale the ratio is noise
(scheduling, the one hop the shadow skips) that would roll back a canary as good as stable."""
RESAMPLES = 2000
CONFIDENCE = 0.95
SEED = 37


@dataclass
class PairStats:
    """What the pairs of one model add up to (every field a sum: workers add up)."""

    pairs: int = 0
    rouge_sum: float = 0.0
    rouge: Histo = field(default_factory=dict)
    """Cumulative ROUGE-L counts by upper bound."""
    ttft: dict[str, Histo] = field(default_factory=dict)
    """Per variant (``stable``, ``canary``): cumulative TTFT counts by upper bound."""
    tpot_sum: dict[str, float] = field(default_factory=dict)
    tpot_count: dict[str, float] = field(default_factory=dict)
    cost: dict[str, float] = field(default_factory=dict)
    """Per variant: the cost of the pairs' answers (completion tokens x price / 1000, or
    completion tokens when the pool has no price)."""


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    pairs: int
    rouge_l: float | None
    rouge_interval: tuple[float, float] | None
    ttft_p99: tuple[float | None, float | None]
    """(stable, canary)."""
    ttft_ratio: float | None
    tpot_ratio: float | None
    cost_per_request: tuple[float | None, float | None]
    cost_ratio: float | None
    reasons: tuple[str, ...]
    """Why it is not ``promote`` (empty when it is)."""


def _ratio(canary: float | None, stable: float | None) -> float | None:
    if canary is None or stable is None or stable <= 0.0:
        return None
    return canary / stable


def rouge_interval(buckets: Histo, pairs: int) -> tuple[float, float] | None:
    """The :data:`CONFIDENCE` bootstrap interval of the mean ROUGE-L, from its binned pairs
    (each pair at its bin's middle)."""
    bounds = sorted(b for b in buckets if b != float("inf"))
    if pairs < 2 or not bounds:
        return None
    counts, lows, prev = [], [], 0.0
    below = 0.0
    for bound in bounds:
        counts.append(max(0.0, buckets[bound] - below))
        lows.append(prev)
        below, prev = buckets[bound], bound
    total = sum(counts)
    if total <= 0:
        return None
    middles = np.array([(low + high) / 2 for low, high in zip(lows, bounds, strict=True)])
    draws = np.random.default_rng(SEED).multinomial(
        pairs, np.array(counts) / total, size=RESAMPLES)
    means = draws @ middles / pairs
    tail = (1.0 - CONFIDENCE) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1.0 - tail))


def judge(stats: PairStats, spec: CompareSpec) -> Judgement:
    """``rollback`` when the mean ROUGE-L is below ``rouge_l_min`` or the TTFT P99 or cost ratio
    is over its maximum (stable's TTFT P99 counted as at least :data:`TTFT_FLOOR_S`);
    ``promote`` when none is and the ROUGE-L interval lies above
    ``rouge_l_min``; else ``hold`` (too few pairs, or quality not yet known to pass)."""
    pairs = stats.pairs
    rouge = stats.rouge_sum / pairs if pairs else None
    interval = None
    s_ttft = quantile(0.99, stats.ttft.get("stable", {}))
    c_ttft = quantile(0.99, stats.ttft.get("canary", {}))
    ttft_ratio = _ratio(c_ttft, s_ttft)
    tpots = {v: stats.tpot_sum.get(v, 0.0) / n for v, n in stats.tpot_count.items() if n > 0}
    tpot_ratio = _ratio(tpots.get("canary"), tpots.get("stable"))
    s_cost = stats.cost.get("stable", 0.0) / pairs if pairs else None
    c_cost = stats.cost.get("canary", 0.0) / pairs if pairs else None
    cost_ratio = _ratio(c_cost, s_cost)
    reasons: list[str] = []
    verdict: Verdict = "promote"
    if pairs < spec.min_samples:
        verdict = "hold"
        reasons.append(f"{pairs} of {spec.min_samples} pairs")
    else:
        failed = []
        if rouge is not None and rouge < spec.rouge_l_min:
            failed.append(f"ROUGE-L {rouge:.3f} < {spec.rouge_l_min}")
        if s_ttft is not None and c_ttft is not None \
                and c_ttft > spec.ttft_p99_max_ratio * max(s_ttft, TTFT_FLOOR_S):
            failed.append(f"TTFT P99 ratio {ttft_ratio or math.inf:.2f} > "
                          f"{spec.ttft_p99_max_ratio}")
        if cost_ratio is not None and cost_ratio > spec.cost_max_ratio:
            failed.append(f"cost ratio {cost_ratio:.2f} > {spec.cost_max_ratio}")
        interval = rouge_interval(stats.rouge, pairs)  # the costly part: only once it counts
        if failed:
            verdict = "rollback"
            reasons += failed
        elif interval is None or interval[0] < spec.rouge_l_min:
            verdict = "hold"
            reasons.append(f"ROUGE-L interval reaches below {spec.rouge_l_min}")
    return Judgement(verdict, pairs, rouge, interval, (s_ttft, c_ttft), ttft_ratio, tpot_ratio,
                     (s_cost, c_cost), cost_ratio, tuple(reasons))


INFO_NAME = "llm_sidecar_canary_compare_info"
INFO_LABELS = ("min_samples", "rouge_l_min", "ttft_p99_max_ratio", "cost_max_ratio", "action")
ROUGE_NAME = "llm_sidecar_canary_pair_rouge_l"
TTFT_NAME = "llm_sidecar_canary_pair_ttft_seconds"
TPOT_NAME = "llm_sidecar_canary_pair_tpot_seconds"
COST_NAME = "llm_sidecar_canary_pair_cost"
PAIR_FAMILIES = frozenset({ROUGE_NAME, TTFT_NAME, TPOT_NAME, COST_NAME})


def pair_stats(families: Iterable[Metric], model: str) -> PairStats:
    """The pairs of ``model`` in ``families`` (a registry's, or a parsed exposition text's;
    samples of several workers add up)."""
    stats = PairStats()
    for family in families:
        if family.name not in PAIR_FAMILIES:
            continue
        for sample in family.samples:
            labels = sample.labels
            if labels.get("model") != model:
                continue
            variant = labels.get("variant", "")
            name, value = sample.name, sample.value
            if family.name == ROUGE_NAME:
                if name.endswith("_bucket"):
                    bound = float(labels["le"])
                    stats.rouge[bound] = stats.rouge.get(bound, 0.0) + value
                elif name.endswith("_sum"):
                    stats.rouge_sum += value
                elif name.endswith("_count"):
                    stats.pairs += int(value)
            elif family.name == TTFT_NAME and name.endswith("_bucket"):
                histo = stats.ttft.setdefault(variant, {})
                bound = float(labels["le"])
                histo[bound] = histo.get(bound, 0.0) + value
            elif family.name == TPOT_NAME:
                if name.endswith("_sum"):
                    stats.tpot_sum[variant] = stats.tpot_sum.get(variant, 0.0) + value
                elif name.endswith("_count"):
                    stats.tpot_count[variant] = stats.tpot_count.get(variant, 0.0) + value
            elif family.name == COST_NAME and name.endswith("_total"):
                stats.cost[variant] = stats.cost.get(variant, 0.0) + value
    return stats


@dataclass(frozen=True)
class Pair:
    """One compared pair: the canary's answer against stable's, for ``model`` (stable's name)."""

    model: str
    rouge_l: float
    ttft_s: tuple[float | None, float | None]
    """(stable, canary); None where the answer was not streamed."""
    tpot_s: tuple[float | None, float | None]
    cost: tuple[float, float]


class PairMetrics:
    """The pairs as metrics: what :func:`pair_stats` reads, and the verdict gauges."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rouge = Histogram(ROUGE_NAME, "ROUGE-L F1 of the canary's answer against stable's, "
                               "per shadow pair.", ["model"], buckets=ROUGE_BUCKETS,
                               registry=registry)
        self.ttft = Histogram(TTFT_NAME, "Time to first token of each side of the shadow pairs.",
                              ["model", "variant"], buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram(TPOT_NAME, "Time per output token of each side of the shadow "
                              "pairs.", ["model", "variant"], buckets=TPOT_BUCKETS,
                              registry=registry)
        self.cost = Counter(COST_NAME, "Cost of each side's answers in the shadow pairs "
                            "(completion tokens x cost_per_1k_tokens / 1000, or tokens).",
                            ["model", "variant"], registry=registry)
        self.mean_rouge = Gauge("llm_sidecar_canary_rouge_l", "Mean ROUGE-L F1 of the canary's "
                                "answers against stable's over the shadow pairs.", ["model"],
                                registry=registry)
        self.verdict = Gauge("llm_sidecar_canary_verdict", "1 for the canary's current verdict "
                             "(promote, hold, rollback), 0 for the others.",
                             ["model", "verdict"], registry=registry)
        self.shadows = Counter("llm_sidecar_canary_shadows", "Shadow requests by result: "
                               "compared, failed, or skipped (saturated, budget, busy).",
                               ["model", "result"], registry=registry)
        self.info = Gauge(INFO_NAME, "1, labelled with the canary verdict's settings of the "
                          "model (what llm-sidecar canary judges the pairs with).",
                          ["model", *INFO_LABELS], registry=registry)

    def add(self, pair: Pair) -> None:
        model = pair.model
        self.rouge.labels(model).observe(pair.rouge_l)
        for variant, ttft, tpot, cost in zip(("stable", "canary"), pair.ttft_s, pair.tpot_s,
                                             pair.cost, strict=True):
            if ttft is not None:
                self.ttft.labels(model, variant).observe(ttft)
            if tpot is not None:
                self.tpot.labels(model, variant).observe(tpot)
            self.cost.labels(model, variant).inc(cost)

    def stats(self, model: str) -> PairStats:
        families = [*self.rouge.collect(), *self.ttft.collect(), *self.tpot.collect(),
                    *self.cost.collect()]
        return pair_stats(families, model)

    def show(self, model: str, judgement: Judgement, spec: CompareSpec) -> None:
        self.info.labels(model, *(str(getattr(spec, name)) for name in INFO_LABELS)).set(1)
        if judgement.rouge_l is not None:
            self.mean_rouge.labels(model).set(judgement.rouge_l)
        for verdict in VERDICTS:
            self.verdict.labels(model, verdict).set(1.0 if verdict == judgement.verdict else 0.0)


def render(model: str, j: Judgement) -> str:
    """The verdict with every figure and its sample count (``llm-sidecar canary``)."""
    def fmt(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"
    interval = "-" if j.rouge_interval is None else \
        f"[{j.rouge_interval[0]:.3f}, {j.rouge_interval[1]:.3f}]"
    lines = [f"canary verdict for {model}: {j.verdict.upper()} ({j.pairs} shadow pairs)",
             f"  ROUGE-L F1 mean        {fmt(j.rouge_l)}  95% bootstrap interval {interval}",
             f"  TTFT P99 (s)           stable {fmt(j.ttft_p99[0])}  canary {fmt(j.ttft_p99[1])}"
             f"  ratio {fmt(j.ttft_ratio, 2)}",
             f"  time per output token  ratio {fmt(j.tpot_ratio, 2)}",
             f"  cost per request       stable {fmt(j.cost_per_request[0])}  canary "
             f"{fmt(j.cost_per_request[1])}  ratio {fmt(j.cost_ratio, 2)}"]
    if j.reasons:
        lines.append("  because: " + "; ".join(j.reasons))
    return "\n".join(lines)


def verdicts_text(text: str) -> str:
    """The verdict of every model whose pairs an exposition ``text`` holds (a process's, or
    its workers' merged), judged with the settings it exports; "" when none has pairs."""
    families = list(text_string_to_metric_families(text))
    specs: dict[str, CompareSpec] = {}
    for family in families:
        if family.name != INFO_NAME:
            continue
        for sample in family.samples:
            labels = sample.labels
            try:
                specs[labels["model"]] = CompareSpec.model_validate(
                    {name: labels[name] for name in INFO_LABELS})
            except (KeyError, ValueError):
                continue
    return "\n\n".join(render(model, judge(pair_stats(families, model), spec))
                       for model, spec in sorted(specs.items()))
