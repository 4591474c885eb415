"""The default scorer, `latency` (issue 36): when a request would be served on each pod, from the
pod's load against its own capacity, its pace, its prefix cache and the request's own size; and
the share floor that keeps a slower pod from sitting idle while the pool is busy."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from extproc.picker.pick import (
    MIN_PICKS_FOR_SHARE,
    EndpointPicker,
    Pick,
    below_share,
    choose,
)
from extproc.picker.scoring import (
    DECODE_SHARE,
    PREFILL_SHARE,
    UNKNOWN_FACTOR,
    PoolContext,
    Work,
    eta,
)
from extproc.picker.state import CAPACITY_GUESS, Candidate, PodMetrics, PoolState
from routing.picker_schema import PickerWeights, SaturationSpec
from routing.schema import RoutingConfig

W = PickerWeights()
FAST, FAST2, SLOW, OTHER = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"
CHAT = Work(prompt_tokens=1000, output_tokens=64)
CTX = PoolContext(32.0, 0.98, work=CHAT, backlog_tokens=64.0, pace=0.015)
"""A 1,000-token prompt asking for 64 tokens, in a pool whose requests ask for 64."""


def pod(address: str = FAST, *, running: float = 0, waiting: float = 0, kv: float | None = 0.1,
        sent: int = 0, open_: int = 0, prefix: float = 0.0, tpot: float | None = 0.015,
        capacity: float | None = 6.0) -> Candidate:
    return Candidate(address, PodMetrics(waiting=waiting, running=running, kv_usage=kv), sent,
                     open_, prefix, tpot_s=tpot, capacity=capacity)


def one_eta(c: Candidate, ctx: PoolContext = CTX) -> float:
    return eta(c.metrics, c.sent_since_scrape, c.prefix_match, c.tpot_s, c.capacity, ctx)


FREE = 0.015 * (1000 * PREFILL_SHARE + 1 + DECODE_SHARE * 64)
"""A free pod at 15 ms a token: the prefill, the first token, half the answer."""
SLOT = 64 * 0.015 / 6
"""One request in line ahead, on a pod of 6 slots at 15 ms a token: a sixth of a request's time."""


@pytest.mark.parametrize(("candidate", "expected"), [
    (pod(), FREE),
    (pod(running=5), FREE),                                      # a slot free: no wait
    (pod(running=6), FREE + SLOT),                               # full: the next slot to free
    (pod(running=6, waiting=2), FREE + 3 * SLOT),                # two ahead in line
    (pod(running=4, sent=3), FREE + 2 * SLOT),                   # sends since the scrape count
    (pod(running=2, kv=0.99), FREE + 64 * 0.015 / 2),            # KV full: full at what it runs
    (pod(running=3, waiting=1, capacity=None), FREE + 2 * 64 * 0.015 / 3),  # full, never seen so
    (pod(running=30, capacity=None), FREE),                      # never seen full: room
    (pod(tpot=0.045), 3 * FREE),                                 # three times slower
    (pod(tpot=None), FREE),                                      # pace unknown: the pool's
    (pod(prefix=1.0), FREE - 0.015 * 1000 * PREFILL_SHARE),      # the prompt is cached
    (pod(prefix=0.5), FREE - 0.015 * 500 * PREFILL_SHARE),
    (Candidate(OTHER, None, 0, 0), UNKNOWN_FACTOR * FREE),       # unknown: twice a free pod
    (Candidate(OTHER, None, 16, 0), UNKNOWN_FACTOR * FREE * 1.5),
], ids=repr)
def test_eta(candidate: Candidate, expected: float) -> None:
    assert one_eta(candidate) == pytest.approx(expected)


def test_a_cached_prefix_is_worth_its_prefill_never_a_queue() -> None:
    cached = pod(FAST, running=6, prefix=1.0)
    assert one_eta(cached) > one_eta(pod(FAST2))  # one slot's wait is more than the prefill
    assert one_eta(pod(FAST, running=5, prefix=1.0)) < one_eta(pod(FAST2))


def pick(*candidates: Candidate, work: Work = CHAT, seed: int = 0, backlog: float = 64.0) -> Pick:
    return choose(candidates, W, SaturationSpec(), "high", random.Random(seed), work, backlog)


def test_a_pod_with_a_free_slot_wins_over_a_full_one() -> None:
    for seed in range(20):
        assert pick(pod(FAST, running=6, waiting=1), pod(FAST2, running=5), seed=seed).endpoint == FAST2


def test_a_fast_pod_with_room_wins_over_an_idle_slow_one() -> None:
    for seed in range(20):
        assert pick(pod(SLOW, tpot=0.045), pod(FAST, running=5), seed=seed).endpoint == FAST


def test_a_short_request_takes_an_idle_slow_pod_rather_than_a_long_line() -> None:
    busy = [pod(FAST, running=6, waiting=6), pod(FAST2, running=6, waiting=6)]
    short = Work(200, 16)
    assert pick(*busy, pod(SLOW, tpot=0.045), work=short).endpoint == SLOW
    # Behind one request only, the fast pod is still sooner.
    assert pick(pod(FAST, running=6), pod(SLOW, tpot=0.045), work=CHAT).endpoint == FAST


def test_the_prefix_decides_between_pods_as_good() -> None:
    got = pick(pod(FAST, running=2), pod(FAST2, running=1, prefix=1.0))
    assert got == Pick(FAST2, (FAST,), "prefix")


def test_a_prefix_on_a_full_pod_gives_way() -> None:
    got = pick(pod(FAST, running=6, waiting=3, prefix=1.0), pod(FAST2, running=3))
    assert got == Pick(FAST2, (FAST,), "scored")


def test_equal_pods_share_by_chance_and_what_this_replica_has_open() -> None:
    got = Counter(pick(pod(FAST), pod(FAST2), pod(OTHER), seed=seed).endpoint for seed in range(300))
    assert set(got) == {FAST, FAST2, OTHER} and min(got.values()) > 60
    # Within the tie band, fewer requests open from this replica goes first.
    assert pick(pod(FAST, open_=3), pod(FAST2, running=1, open_=0)).endpoint == FAST2


def test_an_unknown_pod_beats_a_long_line_not_a_free_pod() -> None:
    unknown = Candidate(OTHER, None, 0, 0)
    assert pick(unknown, pod(FAST, running=6, waiting=12)).endpoint == OTHER
    assert pick(unknown, pod(FAST, running=3)).endpoint == FAST


@pytest.mark.parametrize(("loads", "shares", "room", "owed"), [
    ((1, 1, 1, 0), (0.5, 0.5, 0.0, 0.0), (True,) * 4, None),          # under half busy
    # The fast pods 5/6 full, the slow ones idle: 10 of 24 slots, but 56% of the throughput.
    ((5, 5, 0, 0), (0.5, 0.5, 0.0, 0.0), (True,) * 4, [False, False, True, True]),
    ((6, 6, 4, 0), (0.45, 0.45, 0.1, 0.0), (False, False, True, True),
     [False, False, True, True]),                                      # 1.5x and 3x pods owed
    ((6, 6, 4, 0), (0.35, 0.35, 0.2, 0.1), (False, False, True, True),
     [False] * 4),                                                     # each has 3/4 of its share
    ((6, 6, 4, 6), (0.45, 0.45, 0.1, 0.0), (False, False, True, False),
     [False, False, True, False]),                                     # no room: not owed
])
def test_below_share(loads: tuple[float, ...], shares: tuple[float, ...], room: tuple[bool, ...],
                     owed: list[bool] | None) -> None:
    # Four pods of 6 slots, at 15, 15, 22.5 and 45 ms a token: capacity shares 1/3, 1/3, 2/9, 1/9.
    paces = (0.015, 0.015, 0.0225, 0.045)
    assert below_share(loads, (6.0,) * 4, paces, shares, room) == owed


def config(picker: dict[str, Any] | None = None) -> RoutingConfig:
    return RoutingConfig.model_validate({
        "version": 1, "models": {"m": {"clusters": ["pool"]}},
        "clusters": {"pool": {"endpoints": [FAST, FAST2, SLOW], "max_context": 8192,
                              "endpoint_picker": picker or {}}}})


def busy_pool(picker: EndpointPicker, now: float) -> PoolState:
    pool = picker.pools["pool"]
    for address, tpot in ((FAST, 0.015), (FAST2, 0.015), (SLOW, 0.045)):
        for i in (1, 2):  # two scrapes: the pace is measured, and the fast pods seen full
            running = 6 if address != SLOW else 1
            pool.record_scrape(address, PodMetrics(
                running=running, waiting=1 if address != SLOW else 0,
                token_gap_sum=tpot * 100 * i, token_gap_count=100 * i), now)
    return pool


def test_a_slow_pod_owed_its_share_gets_the_short_requests() -> None:
    picker = EndpointPicker(config(), clock=lambda: 5.0, rng=random.Random(1))
    pool = busy_pool(picker, 5.0)
    assert pool.pods[FAST].capacity == 6 and pool.pods[SLOW].capacity is None
    # The fast pods have taken every request so far.
    for i in range(MIN_PICKS_FOR_SHARE):
        pool.sent(FAST if i % 2 else FAST2)
        pool.done(FAST if i % 2 else FAST2)
        pool.record_scrape(FAST if i % 2 else FAST2, PodMetrics(
            running=6, waiting=1, token_gap_sum=0.015 * 200, token_gap_count=200), 5.0)
    picker.pick("pool", b"q" * 400, "high", work=Work(100, 60))  # the pool's typical output
    long = picker.pick("pool", b"q" * 400, "high", work=Work(100, 200))
    assert long is not None and long.reason != "share"
    # A short answer to a prompt it would have to prefill whole: not on the slow pod.
    heavy = picker.pick("pool", b"h" * 1600, "high", work=Work(400, 16))
    assert heavy is not None and heavy.reason != "share"
    short = picker.pick("pool", b"q" * 40, "high", work=Work(40, 16))
    assert short is not None and (short.endpoint, short.reason) == (SLOW, "share")


def test_without_latency_weighted_there_is_no_share_floor() -> None:
    legacy = {"weights": {"latency": 0, "queue": 1}}
    picker = EndpointPicker(config(legacy), clock=lambda: 5.0, rng=random.Random(1))
    pool = busy_pool(picker, 5.0)
    for _ in range(MIN_PICKS_FOR_SHARE):
        pool.sent(FAST)
    got = picker.pick("pool", b"q", "high", work=Work(100, 1))
    assert got is not None and got.reason != "share"


def test_capacity_is_learned_from_scrapes_that_saw_requests_waiting() -> None:
    pool = PoolState("pool", 2.0)
    pool.set_addresses([FAST])
    state = pool.pods[FAST]
    assert state.capacity is None and state.capacity_estimate() == CAPACITY_GUESS
    assert state.capacity_estimate(6.0) == 6.0  # the pool's other pods were seen full at 6
    pool.record_scrape(FAST, PodMetrics(running=20), 1.0)
    assert state.capacity is None and state.capacity_estimate() == 20  # ran 20: at least that
    assert state.capacity_estimate(6.0) == 20
    pool.record_scrape(FAST, PodMetrics(running=6, waiting=3), 1.1)
    assert state.capacity == 6
    pool.record_scrape(FAST, PodMetrics(running=4, waiting=3), 1.2)  # between two sequences
    assert state.capacity == 5
    pool.record_scrape(FAST, PodMetrics(running=8), 1.3)  # more than thought: at once
    assert state.capacity == 8


def test_the_pools_typical_output_follows_the_budgets() -> None:
    pool = PoolState("pool", 2.0)
    pool.note(300, 100)
    assert (pool.prompt_mean, pool.backlog_tokens) == (300, 100)
    pool.note(300, 0)  # no output budget said: the output mean keeps
    assert pool.backlog_tokens == 100
    for _ in range(500):
        pool.note(40, 20)
    assert pool.backlog_tokens == pytest.approx(20, abs=0.1)
    assert pool.prompt_mean == pytest.approx(40, abs=0.1)


@pytest.mark.parametrize("replicas", [2, 4])
def test_replicas_that_see_the_same_scrape_do_not_herd_onto_one_pod(replicas: int) -> None:
    # Every replica (or --workers process) reads the same metrics and sends between two scrapes
    # without seeing what the others sent: the tie band and chance spread them over the pods
    # that are about as good, and each replica's own sends count against the pod it chose.
    pickers = [EndpointPicker(config(), clock=lambda: 5.0, rng=random.Random(seed))
               for seed in range(replicas)]
    for picker in pickers:
        for address in (FAST, FAST2, SLOW):
            picker.pools["pool"].record_scrape(address, PodMetrics(running=2), 5.0)
    got: Counter[str | None] = Counter()
    for i in range(6):  # six requests a replica between two scrapes
        for picker in pickers:
            result = picker.pick("pool", f"prompt {i}".encode(), "high", work=Work(500, 64))
            assert result is not None
            got[result.endpoint] += 1
    total = 6 * replicas
    assert set(got) == {FAST, FAST2, SLOW} and max(got.values()) <= total / 2, got


def test_a_few_milliseconds_of_cached_preamble_do_not_draw_every_request() -> None:
    # A short request whose first block sits in one idle pod's cache: a few tokens' time saved
    # (TIE_TOKENS), so the pods tie and share; a 1,000-token prompt cached is not a tie.
    tiny = Work(prompt_tokens=80, output_tokens=16)
    ctx = PoolContext(32.0, 0.98, work=tiny, backlog_tokens=64.0, pace=0.015)
    near = [pod(FAST, prefix=0.8), pod(FAST2)]
    assert 0.0 < one_eta(near[1], ctx) - one_eta(near[0], ctx) < 2 * 0.015
    got = Counter(pick(*near, work=tiny, seed=seed).endpoint for seed in range(200))
    assert min(got.values()) > 60, got
    assert pick(pod(FAST, prefix=1.0), pod(FAST2), work=CHAT).endpoint == FAST


def test_a_pod_with_requests_waiting_and_none_running_is_full_whatever_the_guess() -> None:
    # Never seen full, so no capacity learned; 20 waiting with nothing running is no room, even
    # for a 4-token answer whose estimates would otherwise sit within the tie band.
    picker = EndpointPicker(config(), clock=lambda: 5.0, rng=random.Random(2))
    pool = picker.pools["pool"]
    pool.record_scrape(FAST, PodMetrics(waiting=20), 5.0)
    pool.record_scrape(FAST2, PodMetrics(), 5.0)
    pool.record_scrape(SLOW, PodMetrics(waiting=40), 5.0)
    for _ in range(10):
        got = picker.pick("pool", b"hello", "high", work=Work(5, 4))
        assert got is not None and got.endpoint == FAST2
        picker.done("pool", FAST2)
