from __future__ import annotations

import random
from collections import Counter

import pytest

from extproc.picker.pick import Pick, Priority, Reason, choose
from extproc.picker.state import Candidate, PodMetrics
from routing.picker_schema import PickerWeights, SaturationSpec

W = PickerWeights(latency=0, queue=1, kv_cache=1, in_flight=0.5, prefix=2)
"""The weights before `latency` (issue 36): these tables hold the scorers they weigh, which
stay to choose (the default `latency` has its own, tests/extproc/picker/test_latency.py)."""
SAT = SaturationSpec()
FREE, BUSY, OTHER, FOURTH = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"


def known(address: str, waiting: float = 0, kv: float = 0.1, sent: int = 0, open_: int = 0,
          prefix: float = 0.0, throttled: bool | None = None, running: float = 0,
          tpot: float | None = None) -> Candidate:
    return Candidate(address, PodMetrics(waiting=waiting, running=running, kv_usage=kv,
                                         throttled=throttled), sent, open_, prefix, tpot_s=tpot)


def unknown(address: str, sent: int = 0, open_: int = 0, prefix: float = 0.0) -> Candidate:
    return Candidate(address, None, sent, open_, prefix)


def pick(*candidates: Candidate, priority: Priority = "medium", seed: int = 0,
         saturation: SaturationSpec | None = SAT, weights: PickerWeights = W) -> Pick:
    return choose(candidates, weights, saturation, priority, random.Random(seed))


@pytest.mark.parametrize("busy", [
    known(BUSY, waiting=40),
    known(BUSY, waiting=6),
    known(BUSY, kv=0.99),
    known(BUSY, kv=0.6),
    known(BUSY, sent=6),             # not in its metrics yet
    known(BUSY, open_=6),
    known(BUSY, throttled=True),
    unknown(BUSY),                   # neutral: worse than a known free pod
], ids=lambda c: repr(c)[40:120])
def test_the_free_pod_wins(busy: Candidate) -> None:
    for seed in range(20):  # whatever the order and the chance
        assert pick(busy, known(FREE), seed=seed).endpoint == FREE
        assert pick(known(FREE), busy, seed=seed).endpoint == FREE


@pytest.mark.parametrize("busy", [
    known(BUSY, waiting=24, kv=0.9), known(BUSY, kv=0.95, open_=10), known(BUSY, waiting=32),
], ids=lambda c: repr(c)[40:120])
def test_an_unknown_pod_beats_a_busy_one(busy: Candidate) -> None:
    assert pick(busy, unknown(OTHER)) == Pick(OTHER, (BUSY,), "scored")


def test_ties_go_to_fewer_open_then_chance() -> None:
    # Equal scores (the in-flight weight is 0 here, so open requests do not score).
    weights = PickerWeights(in_flight=0)
    assert pick(known(BUSY, open_=3), known(FREE, open_=1), weights=weights).endpoint == FREE
    winners = Counter(pick(known(FREE), known(BUSY), known(OTHER), seed=seed).endpoint
                      for seed in range(300))
    assert set(winners) == {FREE, BUSY, OTHER} and min(winners.values()) > 60
    assert pick(known(FREE), known(BUSY), seed=7) == pick(known(FREE), known(BUSY), seed=7)


def test_fallbacks_are_the_next_best_two() -> None:
    got = pick(known(BUSY, waiting=20), known(FREE), known(OTHER, waiting=10), known(FOURTH, waiting=30))
    assert got == Pick(FREE, (OTHER, BUSY), "scored")
    assert pick(known(FREE), known(BUSY, waiting=5)).fallbacks == (BUSY,)
    assert pick(known(FREE)).fallbacks == ()


@pytest.mark.parametrize(("prefix_pod", "winner", "reason"), [
    # A cached prefix outweighs a short queue...
    (known(BUSY, waiting=4, prefix=1.0), BUSY, "prefix"),
    (known(BUSY, waiting=4, kv=0.3, prefix=1.0), BUSY, "prefix"),
    (known(BUSY, prefix=0.25), BUSY, "prefix"),  # equal otherwise: the prefix decides the tie
    # ...but not a deep one (2/3 of the saturation depth), a saturated pod, or throttling.
    (known(BUSY, waiting=24, prefix=1.0), FREE, "scored"),
    (known(BUSY, waiting=40, prefix=1.0), FREE, "scored"),
    (known(BUSY, kv=0.98, prefix=1.0), FREE, "scored"),
    (known(BUSY, waiting=16, kv=0.9, prefix=1.0), FREE, "scored"),
])
def test_prefix_affinity_against_load(prefix_pod: Candidate, winner: str, reason: Reason) -> None:
    assert pick(prefix_pod, known(FREE)) == Pick(winner, (FREE if winner == BUSY else BUSY,), reason)


FAST, SLOW = FREE, BUSY
SPEED = W.model_copy(update={"speed": 1.0})  # speed counts only when weighted


@pytest.mark.parametrize(("slow", "fast"), [
    (known(SLOW, tpot=0.02), known(FAST, tpot=0.01)),                          # both idle
    (known(SLOW, running=2, waiting=1, tpot=0.02), known(FAST, running=2, waiting=1, tpot=0.01)),
    (known(SLOW, running=3, kv=0.5, tpot=0.04), known(FAST, running=3, kv=0.5, tpot=0.01)),
    (known(SLOW, waiting=2, sent=1, tpot=0.011), known(FAST, waiting=2, sent=1, tpot=0.01)),
], ids=["idle", "equal-load", "4x-slower", "10%-slower"])
def test_with_equal_queues_the_faster_pod_wins(slow: Candidate, fast: Candidate) -> None:
    for seed in range(20):
        assert pick(slow, fast, seed=seed, weights=SPEED).endpoint == FAST
        assert pick(fast, slow, seed=seed, weights=SPEED).endpoint == FAST


def test_speed_weighted_zero_is_the_old_picker() -> None:
    off = W.model_copy(update={"speed": 0.0})
    assert off == W
    # Equal otherwise: chance, as before speed counted...
    assert Counter(pick(known(SLOW, tpot=0.04), known(FAST, tpot=0.01), weights=off,
                        seed=seed).endpoint for seed in range(200))[SLOW] > 60
    # ...and the prefix is not discounted on the slow pod.
    for seed in range(20):
        assert pick(known(SLOW, running=2, prefix=1.0, tpot=0.04), known(FAST, tpot=0.01),
                    weights=off, seed=seed) == Pick(SLOW, (FAST,), "prefix")


@pytest.mark.parametrize(("prefix_pod", "winner", "reason"), [
    # A prefix on a 4x slower pod loses to an idle fast one (and to one as busy as it)...
    (known(SLOW, prefix=1.0, tpot=0.04), FAST, "scored"),
    (known(SLOW, running=2, prefix=1.0, tpot=0.04), FAST, "scored"),
    (known(SLOW, running=3, waiting=1, prefix=0.9, kv=0.6, tpot=0.02), FAST, "scored"),
    # ...still wins on a pod as fast with a request or two more (the old behaviour)...
    (known(SLOW, running=1, prefix=1.0, tpot=0.01), SLOW, "prefix"),
    (known(SLOW, running=2, waiting=1, prefix=1.0, tpot=0.01), SLOW, "prefix"),
    # ...and on a pod of unknown speed, whose prefix is not discounted.
    (known(SLOW, running=2, waiting=2, prefix=1.0), SLOW, "prefix"),
])
def test_a_prefix_against_a_faster_pod(prefix_pod: Candidate, winner: str, reason: Reason) -> None:
    fast = known(FAST, tpot=0.01)
    for seed in range(20):
        got = pick(prefix_pod, fast, seed=seed, weights=SPEED)
        assert got == Pick(winner, (FAST if winner == SLOW else SLOW,), reason)


@pytest.mark.parametrize(("tpot", "order"), [
    (0.0015, (SLOW, OTHER)),   # speed 2/3: ahead of the unknown pod's 0.5
    (0.004, (OTHER, SLOW)),    # speed 1/4: behind it
])
def test_an_unknown_speed_is_neutral(tpot: float, order: tuple[str, str]) -> None:
    # FOURTH is the pool's best (speed 1); OTHER's speed was never measured.
    pods = (known(SLOW, tpot=tpot), known(OTHER), known(FOURTH, tpot=0.001))
    for seed in range(20):
        assert pick(*pods, seed=seed, weights=SPEED) == Pick(FOURTH, order, "scored")


def test_a_prefix_on_the_pod_that_wins_anyway_is_scored() -> None:
    assert pick(known(FREE, prefix=0.5), known(BUSY, waiting=10)).reason == "scored"


def test_every_pod_unknown_picks_by_what_this_replica_sent() -> None:
    got = pick(unknown(BUSY, sent=9, open_=3), unknown(FREE, sent=1, open_=1), unknown(OTHER, sent=5))
    assert got == Pick(FREE, (OTHER, BUSY), "unknown")
    # Within the tie band (a request or so apart), fewer open on this replica goes first.
    assert pick(unknown(BUSY, sent=2, open_=3), unknown(FREE, sent=1, open_=1),
                unknown(OTHER, sent=2)) == Pick(OTHER, (FREE, BUSY), "unknown")


def test_no_candidates_is_no_endpoints_whatever_the_priority() -> None:
    for priority in ("high", "medium", "low"):
        assert pick(priority=priority) == Pick(None, (), "no_endpoints", False)


# Every pod over a threshold; the best of them is BUSY (no queue, KV full).
FULL = [known(FREE, waiting=32, kv=0.5), known(BUSY, kv=0.99), known(OTHER, waiting=50, kv=1.0)]


@pytest.mark.parametrize(("priority", "expected"), [
    ("low", Pick(None, (), "saturated", True)),
    ("medium", Pick(BUSY, (FREE, OTHER), "scored")),
    ("high", Pick(BUSY, (FREE, OTHER), "scored")),
])
def test_a_saturated_pool_sheds_low_only(priority: Priority, expected: Pick) -> None:
    assert pick(*FULL, priority=priority) == expected


@pytest.mark.parametrize("extra", [
    known(FOURTH, waiting=31, kv=0.97),   # one pod under both thresholds
    unknown(FOURTH),                      # one pod nobody knows: it may be free
], ids=["one-free", "one-unknown"])
def test_no_shedding_while_a_pod_may_take_it(extra: Candidate) -> None:
    got = pick(*FULL, extra, priority="low")
    assert not got.shed and got.endpoint is not None and got.reason == "scored"


def test_no_shedding_when_saturation_is_off() -> None:
    assert pick(*FULL, priority="low", saturation=None) == Pick(BUSY, (FREE, OTHER), "scored")


def test_saturation_thresholds_are_the_configured_ones() -> None:
    strict = SaturationSpec(queue_depth=4, kv_cache=0.5)
    pods = [known(FREE, waiting=4), known(BUSY, kv=0.5)]
    assert pick(*pods, priority="low", saturation=strict).shed
    assert not pick(*pods, priority="low").shed


def dead(candidate: Candidate) -> Candidate:
    """``candidate`` as the scraper left a pod it could not connect to."""
    return Candidate(candidate.address, candidate.metrics, candidate.sent_since_scrape,
                     candidate.in_flight, candidate.prefix_match, unreachable=True)


@pytest.mark.parametrize("gone", [
    known(FREE),                     # its last metrics still fresh and the best
    unknown(FREE),
    known(FREE, prefix=1.0),         # holding the prompt's prefix
], ids=["fresh", "unknown", "prefix"])
def test_an_unreachable_pod_is_only_a_last_fallback(gone: Candidate) -> None:
    for seed in range(20):
        assert pick(dead(gone), known(BUSY, waiting=20), seed=seed) == Pick(BUSY, (FREE,), "scored")
        got = pick(known(BUSY, waiting=20), dead(gone), known(OTHER, waiting=30), seed=seed)
        assert got == Pick(BUSY, (OTHER, FREE), "scored")


def test_an_unreachable_pod_is_left_out_when_the_reachable_fill_the_list() -> None:
    got = pick(dead(known(FREE)), known(BUSY, waiting=9), known(OTHER, waiting=5),
               known(FOURTH, waiting=7))
    assert got == Pick(OTHER, (FOURTH, BUSY), "scored")


def test_unreachable_fallbacks_come_best_first() -> None:
    got = pick(dead(known(FREE, waiting=20)), known(BUSY, waiting=30), dead(known(OTHER)))
    assert got == Pick(BUSY, (OTHER, FREE), "scored")


def test_every_pod_unreachable_picks_as_before() -> None:
    pods = [known(BUSY, waiting=20), known(FREE), unknown(OTHER)]
    for seed in range(10):
        assert pick(*map(dead, pods), seed=seed) == pick(*pods, seed=seed)
    assert pick(*map(dead, FULL), priority="low").shed


def test_a_pod_whose_metrics_fail_but_that_answers_still_gets_traffic() -> None:
    # An HTTP 500 on /metrics: unknown, not unreachable, so it wins against busy pods.
    assert pick(known(BUSY, waiting=40), unknown(OTHER)).endpoint == OTHER


def test_an_unreachable_pod_does_not_stop_shedding() -> None:
    # Unlike an unknown pod that answers (test_no_shedding_while_a_pod_may_take_it), a pod
    # nobody can connect to takes nothing: the reachable pods are all saturated.
    assert pick(*FULL, dead(unknown(FOURTH)), priority="low") == Pick(None, (), "saturated", True)
    assert pick(*FULL, dead(unknown(FOURTH)), priority="high") == Pick(BUSY, (FREE, OTHER), "scored")
