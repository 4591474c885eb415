"""The canary verdict's judgement on shadow pairs: a table of pair sets and settings."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.actions import ShadowJob
from extproc.canary.guard import CanaryGuards
from extproc.canary.rouge import RougeProcess, rouge_l
from extproc.canary.shadow import ShadowRunner
from extproc.canary.verdict import Pair, PairMetrics, judge, pair_stats, rouge_interval, verdicts_text
from routing.compiled import Canary
from routing.schema import CompareSpec
from tests.extproc.helpers import snapshot

SPEC = CompareSpec(min_samples=10, rouge_l_min=0.5, ttft_p99_max_ratio=1.2, cost_max_ratio=1.2)


def metrics_with(pairs: list[Pair]) -> PairMetrics:
    metrics = PairMetrics(CollectorRegistry())
    for pair in pairs:
        metrics.add(pair)
    return metrics


def pairs(n: int, rouge: float, ttft: tuple[float, float] = (0.2, 0.2),
          cost: tuple[float, float] = (50.0, 50.0)) -> list[Pair]:
    return [Pair("m", rouge, ttft, (0.02, 0.02), cost) for _ in range(n)]


@pytest.mark.parametrize(("pair_set", "verdict", "because"), [
    (pairs(5, 1.0), "hold", "5 of 10 pairs"),
    (pairs(40, 0.98), "promote", ""),
    (pairs(40, 0.3), "rollback", "ROUGE-L 0.300 < 0.5"),
    # Equal quality, but the canary is slow: its TTFT P99 is ~2x stable's.
    (pairs(40, 0.98, ttft=(0.2, 0.45)), "rollback", "TTFT P99 ratio"),
    # Twice stable's, but both a few milliseconds: under the floor, no difference.
    (pairs(40, 0.98, ttft=(0.004, 0.009)), "promote", ""),
    (pairs(40, 0.98, ttft=(0.004, 0.2)), "rollback", "TTFT P99 ratio"),
    (pairs(40, 0.98, cost=(50.0, 80.0)), "rollback", "cost ratio 1.60 > 1.2"),
    # A mean just above the minimum, the scores spread across it: not confidently above.
    (pairs(6, 0.1) + pairs(6, 0.95), "hold", "interval reaches below"),
])
def test_verdicts(pair_set: list[Pair], verdict: str, because: str) -> None:
    metrics = metrics_with(pair_set)
    judgement = judge(metrics.stats("m"), SPEC)
    assert judgement.verdict == verdict
    assert because in "; ".join(judgement.reasons)
    assert judgement.pairs == len(pair_set)


def test_the_interval_brackets_the_mean_and_narrows_with_pairs() -> None:
    few = metrics_with(pairs(5, 0.2) + pairs(5, 0.8)).stats("m")
    many = metrics_with(pairs(200, 0.2) + pairs(200, 0.8)).stats("m")
    low_few, high_few = rouge_interval(few.rouge, few.pairs) or (0, 0)
    low_many, high_many = rouge_interval(many.rouge, many.pairs) or (0, 0)
    assert low_few < 0.5 < high_few and low_many < 0.5 < high_many
    assert high_many - low_many < high_few - low_few


def test_workers_add_up_through_the_merged_text() -> None:
    """Each worker's pairs are counters and histograms: the merged text holds their sums, and
    the page judges from it what one process holding every pair would."""
    registry = CollectorRegistry()
    metrics = PairMetrics(registry)
    for pair in pairs(20, 0.9) + pairs(20, 0.05):
        metrics.add(pair)
    metrics.show("m", judge(metrics.stats("m"), SPEC), SPEC)
    text = generate_latest(registry).decode()
    parsed = pair_stats(text_string_to_metric_families(text), "m")
    assert parsed.pairs == 40 and parsed.rouge_sum == pytest.approx(19.0)
    page = verdicts_text(text)
    assert "canary verdict for m: ROLLBACK (40 shadow pairs)" in page
    assert "ROUGE-L F1 mean        0.475" in page and "because: ROUGE-L 0.475 < 0.5" in page


def test_rouge_l_is_the_package_figure() -> None:
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert rouge_l("the cat sat on the mat", "a dog ran in the park") == pytest.approx(1 / 6)
    assert rouge_l("", "words") == 0.0


async def test_the_rouge_process_scores_and_replaces_a_dead_child() -> None:
    rouge = RougeProcess()
    try:
        assert await rouge.score("the cat sat on the mat", "the cat sat on the mat") == 1.0
        child = rouge._child
        assert child is not None
        child.kill()
        await child.wait()
        # The next comparison starts a new child.
        assert await rouge.score("a b c", "a b d") == pytest.approx(rouge_l("a b c", "a b d"))
    finally:
        await rouge.aclose()
    assert rouge._child is None


async def test_shadows_past_the_budget_are_skipped_not_sent() -> None:
    """``max_shadows_per_s`` is a token bucket of the shadows' own, per model: at 2 a second,
    five shadows at once send two and skip three."""
    spec = CompareSpec(max_shadows_per_s=2, max_in_flight=100)
    canary = Canary("m-v2", "no-such-pool", 5.0, "api_key", 8192, None, spec)
    metrics = PairMetrics(CollectorRegistry())
    runner = ShadowRunner(snapshot, CanaryGuards(), metrics)
    try:
        for _ in range(5):
            runner.submit(ShadowJob("m", canary, "/v1/chat/completions", b"{}", b"", "text",
                                    None, None, 1.0))
        await asyncio.sleep(0)
    finally:
        await runner.aclose()
    results = {s.labels["result"]: s.value for family in metrics.shadows.collect()
               for s in family.samples if s.name.endswith("_total")}
    assert results.get("skipped_budget") == 3
