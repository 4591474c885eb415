from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from extproc.picker import scoring
from extproc.picker.scoring import NEUTRAL, PoolContext, Work, score_rows
from extproc.picker.state import Candidate, PodMetrics
from routing.picker_schema import PickerWeights, SaturationSpec

CTX = PoolContext.of(SaturationSpec())  # depth 32, KV full at 0.98
W = PickerWeights()
LEGACY = PickerWeights(latency=0, queue=1, kv_cache=1, in_flight=0.5, prefix=2)
"""The weights before `latency` (issue 36): the scorers they weigh are still there to choose."""


def pod(waiting: float = 0, kv: float | None = 0.0, sent: int = 0, open_: int = 0, prefix: float = 0.0,
        throttled: bool | None = None, running: float = 0, tpot: float | None = None,
        capacity: float | None = None) -> Candidate:
    return Candidate("10.0.0.1:8000", PodMetrics(waiting=waiting, running=running, kv_usage=kv,
                                                 throttled=throttled),
                     sent, open_, prefix, tpot_s=tpot, capacity=capacity)


def unknown(sent: int = 0, open_: int = 0, prefix: float = 0.0, tpot: float | None = None) -> Candidate:
    return Candidate("10.0.0.1:8000", None, sent, open_, prefix, tpot_s=tpot)


# The pool's best pod takes 10 ms a token with nothing on it: cost 0.01.
POOL = PoolContext(CTX.depth, CTX.kv_full, best_cost=0.01)


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
    (scoring.kv_cache, pod(kv=None), NEUTRAL),  # an engine without a KV gauge (TGI)
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
    (scoring.prefix, pod(prefix=1.0, kv=None), 1.0),  # no KV gauge: full by its queue alone
    (scoring.prefix, pod(prefix=1.0, kv=None, waiting=32), 0.0),
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


@pytest.mark.parametrize(("scorer", "candidate", "expected"), [
    # speed: the pool's best cost / the pod's, cost = tpot x (1 + running + waiting + sent)
    (scoring.speed, pod(tpot=0.01), 1.0),
    (scoring.speed, pod(tpot=0.02), 0.5),                 # twice as slow
    (scoring.speed, pod(tpot=0.04), 0.25),                # four times
    (scoring.speed, pod(tpot=0.01, waiting=1), 0.5),      # as fast, one request ahead of it
    (scoring.speed, pod(tpot=0.01, waiting=2, sent=1), 0.25),
    (scoring.speed, pod(tpot=0.005, waiting=3), 0.5),     # twice as fast, four times the wait
    (scoring.speed, pod(tpot=0.01, running=8), 1.0),      # a batch shows in its tpot, not here
    (scoring.speed, pod(tpot=0.001), 1.0),                # faster than the context's best: clipped
    (scoring.speed, pod(), NEUTRAL),                      # speed not measured yet
    (scoring.speed, pod(tpot=0.0), NEUTRAL),
    (scoring.speed, unknown(tpot=0.01), NEUTRAL),         # stale metrics: no load to weigh
    # prefix: the headroom is the queue score times the pace: 1 down to a speed score of 0.5,
    # then (speed / 0.5) squared; 1 when the speed is unknown
    (scoring.prefix, pod(prefix=1.0, tpot=0.01), 1.0),
    (scoring.prefix, pod(prefix=1.0, tpot=0.02), 1.0),         # twice the best cost: all of it
    (scoring.prefix, pod(prefix=1.0, tpot=0.03), 4 / 9),
    (scoring.prefix, pod(prefix=1.0, tpot=0.04), 0.25),        # a cached prefix on a 4x slower pod
    (scoring.prefix, pod(prefix=1.0, tpot=0.01, waiting=3), 0.25 * 29 / 32),  # or 3 waiting
    (scoring.prefix, pod(prefix=0.5, tpot=0.02, waiting=16), 0.5 * 0.5 * (2 / 34) ** 2),
    (scoring.prefix, pod(prefix=1.0), 1.0),
    (scoring.prefix, pod(prefix=1.0, tpot=0.04, kv=0.98), 0.0),
    (scoring.prefix, unknown(prefix=1.0, tpot=0.04), NEUTRAL),
])
def test_pool_relative_scorers(scorer: Scorer, candidate: Candidate, expected: float) -> None:
    assert scorer(candidate, POOL) == pytest.approx(expected)


@pytest.mark.parametrize("candidate", [pod(tpot=0.04), pod(tpot=0.01, running=9),
                                       pod(prefix=1.0, tpot=0.04)])
def test_without_a_pool_best_speed_is_neutral_and_leaves_prefix_alone(candidate: Candidate) -> None:
    assert scoring.speed(candidate, CTX) == NEUTRAL
    assert scoring.prefix(candidate, CTX) == pytest.approx(candidate.prefix_match)


def test_the_pool_best_is_the_lowest_known_cost() -> None:
    rows: list[scoring.Row] = [
        (PodMetrics(waiting=3), 0, 0, 0.0, 0.01, None, None),  # 0.04
        (PodMetrics(), 1, 0, 0.0, 0.02, None, None),           # 0.04
        (PodMetrics(waiting=1), 0, 0, 0.0, 0.015, None, None),  # 0.03
        (PodMetrics(), 0, 0, 0.0, None, None, None),           # speed unknown
        (None, 0, 0, 0.0, 0.001, None, None),                  # metrics unknown
    ]
    assert PoolContext.of(None, rows).best_cost == pytest.approx(0.03)
    assert PoolContext.of(None, rows[3:]).best_cost is None
    assert PoolContext.of(None).best_cost is None


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
    (PodMetrics(kv_usage=None), False), (PodMetrics(waiting=32, kv_usage=None), True),
])
def test_saturated(metrics: PodMetrics, saturated: bool) -> None:
    assert scoring.saturated(metrics, CTX) is saturated


def test_total_is_the_weighted_sum() -> None:
    c = pod(waiting=8, kv=0.5, open_=4, prefix=0.5, throttled=False)
    w = PickerWeights(queue=1, kv_cache=2, in_flight=3, prefix=4, thermal=5, latency=0)
    expected = 1 * 0.75 + 2 * 0.5 + 3 * 0.875 + 4 * 0.5 * 0.75 + 5 * 1.0  # speed: 0 by default
    assert scoring.total(c, w, CTX) == pytest.approx(expected)
    fast = pod(waiting=8, kv=0.5, open_=4, prefix=0.5, throttled=False, tpot=0.01)
    w = PickerWeights(queue=1, kv_cache=2, in_flight=3, prefix=4, thermal=5, speed=6, latency=0)
    # cost 0.01 x 9 against the best 0.01: speed 1/9, pace (2/9)^2 in the prefix headroom
    expected = 1 * 0.75 + 2 * 0.5 + 3 * 0.875 + 4 * 0.5 * 0.75 * (2 / 9) ** 2 + 5 * 1.0 + 6 / 9
    assert scoring.total(fast, w, POOL) == pytest.approx(expected)


def _random_candidate(rng: random.Random) -> Candidate:
    metrics = None if rng.random() < 0.3 else PodMetrics(
        waiting=rng.choice([0, 1, 5, 31, 32, 40]), running=rng.choice([0, 1, 4]),
        kv_usage=rng.choice([None, 0.0, 0.3, 0.97, 0.98, 1.0]), throttled=rng.choice([None, True, False]))
    return Candidate("10.0.0.1:8000", metrics, rng.randint(0, 40), rng.randint(0, 40),
                     rng.choice([0.0, 0.25, 1.0]),
                     tpot_s=rng.choice([None, 0.0, 0.005, 0.01, 0.02]),
                     capacity=rng.choice([None, 1.0, 6.0, 256.0]),
                     load=rng.choice([None, 0.0, 3.0, 7.0]))


def test_the_fused_loop_the_pick_runs_equals_the_scorers() -> None:
    rng = random.Random(15)
    weights = [W, PickerWeights(speed=1), LEGACY,
               PickerWeights(queue=0, kv_cache=3, in_flight=0.1, prefix=7, thermal=2, speed=4,
                             latency=2)]
    for w in weights:
        for saturation in (SaturationSpec(), SaturationSpec(queue_depth=8, kv_cache=0.5)):
            candidates = [_random_candidate(rng) for _ in range(500)]
            rows: list[scoring.Row] = [(c.metrics, c.sent_since_scrape, c.in_flight, c.prefix_match,
                                        c.tpot_s, c.capacity, c.load) for c in candidates]
            # with the pool's best cost and eta and without
            pool = PoolContext.of(saturation, rows, latency=True, work=Work(900, 64),
                                  backlog_tokens=rng.choice([0.0, 100.0]))
            assert pool.best_cost is not None and pool.best_eta is not None
            for ctx in (pool, PoolContext.of(saturation)):
                totals, bases = score_rows(rows, w, ctx)
                for c, got_total, got_base in zip(candidates, totals, bases, strict=True):
                    base, pre = scoring.parts(c, w, ctx)
                    assert got_base == pytest.approx(base, abs=1e-12), c
                    assert got_total == pytest.approx(base + pre, abs=1e-12), c
