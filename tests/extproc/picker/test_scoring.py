from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from extproc.picker import scoring
from extproc.picker.scoring import NEUTRAL, PoolContext, score_rows
from extproc.picker.state import Candidate, PodMetrics
from routing.picker_schema import PickerWeights, SaturationSpec

CTX = PoolContext.of(SaturationSpec())  # depth 32, KV full at 0.98
W = PickerWeights()


def pod(waiting: float = 0, kv: float = 0.0, sent: int = 0, open_: int = 0, prefix: float = 0.0,
        throttled: bool | None = None) -> Candidate:
    return Candidate("10.0.0.1:8000", PodMetrics(waiting=waiting, kv_usage=kv, throttled=throttled),
                     sent, open_, prefix)


def unknown(sent: int = 0, open_: int = 0, prefix: float = 0.0) -> Candidate:
    return Candidate("10.0.0.1:8000", None, sent, open_, prefix)


Scorer = Callable[[Candidate, PoolContext], float]


@pytest.mark.parametrize(("scorer", "candidate", "expected"), [
    # queue: waiting + sent since the scrape, linear to the saturation depth
    (scoring.queue, pod(), 1.0),
    (scoring.queue, pod(waiting=16), 0.5),
    (scoring.queue, pod(sent=8), 0.75),
    (scoring.queue, pod(waiting=24, sent=8), 0.0),
    (scoring.queue, pod(waiting=40), 0.0),
    (scoring.queue, unknown(), NEUTRAL),
    (scoring.queue, unknown(sent=8), 0.25),  # a burst onto an unknown pod counts too
    (scoring.queue, unknown(sent=40), 0.0),
    # kv_cache: 1 - use
    (scoring.kv_cache, pod(kv=0.0), 1.0),
    (scoring.kv_cache, pod(kv=0.25), 0.75),
    (scoring.kv_cache, pod(kv=1.0), 0.0),
    (scoring.kv_cache, unknown(), NEUTRAL),
    # in_flight: this replica's open requests, linear to the depth, known or not
    (scoring.in_flight, pod(), 1.0),
    (scoring.in_flight, pod(open_=8), 0.75),
    (scoring.in_flight, pod(open_=64), 0.0),
    (scoring.in_flight, unknown(open_=8), 0.75),
    # prefix: share x queue headroom, nothing on a saturated pod
    (scoring.prefix, pod(prefix=1.0), 1.0),
    (scoring.prefix, pod(prefix=0.5), 0.5),
    (scoring.prefix, pod(prefix=1.0, waiting=16), 0.5),
    (scoring.prefix, pod(prefix=1.0, waiting=31), 1 / 32),
    (scoring.prefix, pod(prefix=1.0, waiting=32), 0.0),
    (scoring.prefix, pod(prefix=1.0, kv=0.98), 0.0),
    (scoring.prefix, pod(prefix=0.0), 0.0),
    (scoring.prefix, unknown(prefix=1.0), NEUTRAL),
    # thermal: DCGM's throttle reasons when known
    (scoring.thermal, pod(throttled=True), 0.0),
    (scoring.thermal, pod(throttled=False), 1.0),
    (scoring.thermal, pod(), NEUTRAL),
    (scoring.thermal, unknown(), NEUTRAL),
])
def test_scorers(scorer: Scorer, candidate: Candidate, expected: float) -> None:
    assert scorer(candidate, CTX) == pytest.approx(expected)


@pytest.mark.parametrize(("saturation", "depth", "kv_full"), [
    (SaturationSpec(queue_depth=8, kv_cache=0.9), 8.0, 0.9),
    (None, 32.0, 0.98),  # shedding off: scores keep the default scale
])
def test_context_comes_from_saturation(saturation: SaturationSpec | None, depth: float,
                                       kv_full: float) -> None:
    assert PoolContext.of(saturation) == PoolContext(depth, kv_full)


@pytest.mark.parametrize(("metrics", "saturated"), [
    (PodMetrics(), False), (PodMetrics(waiting=31, kv_usage=0.97), False),
    (PodMetrics(waiting=32), True), (PodMetrics(kv_usage=0.98), True),
])
def test_saturated(metrics: PodMetrics, saturated: bool) -> None:
    assert scoring.saturated(metrics, CTX) is saturated


def test_total_is_the_weighted_sum() -> None:
    c = pod(waiting=8, kv=0.5, open_=4, prefix=0.5, throttled=False)
    w = PickerWeights(queue=1, kv_cache=2, in_flight=3, prefix=4, thermal=5)
    expected = 1 * 0.75 + 2 * 0.5 + 3 * 0.875 + 4 * 0.5 * 0.75 + 5 * 1.0
    assert scoring.total(c, w, CTX) == pytest.approx(expected)


def _random_candidate(rng: random.Random) -> Candidate:
    metrics = None if rng.random() < 0.3 else PodMetrics(
        waiting=rng.choice([0, 1, 5, 31, 32, 40]), kv_usage=rng.choice([0.0, 0.3, 0.97, 0.98, 1.0]),
        throttled=rng.choice([None, True, False]))
    return Candidate("10.0.0.1:8000", metrics, rng.randint(0, 40), rng.randint(0, 40),
                     rng.choice([0.0, 0.25, 1.0]))


def test_the_fused_loop_the_pick_runs_equals_the_scorers() -> None:
    rng = random.Random(15)
    weights = [W, PickerWeights(queue=0, kv_cache=3, in_flight=0.1, prefix=7, thermal=2)]
    for w in weights:
        for ctx in (CTX, PoolContext(8.0, 0.5)):
            candidates = [_random_candidate(rng) for _ in range(500)]
            totals, bases = score_rows([(c.metrics, c.sent_since_scrape, c.in_flight, c.prefix_match)
                                        for c in candidates], w, ctx)
            for c, got_total, got_base in zip(candidates, totals, bases, strict=True):
                base, pre = scoring.parts(c, w, ctx)
                assert (got_total, got_base) == (base + pre, base), c
