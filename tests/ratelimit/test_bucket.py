"""Token bucket math on a fake clock: tables of cases, and a property over any window."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratelimit.bucket import (
    BucketResult,
    BucketSpec,
    BucketState,
    Hit,
    decide,
    idle_ttl_s,
    refill,
    report,
)

TEN_PER_S = BucketSpec(capacity=10.0, rate=10.0)
BURSTY = BucketSpec(capacity=20.0, rate=10.0)
DEBT = BucketSpec(capacity=100.0, rate=10.0, debt=True)
SHADOW = BucketSpec(capacity=1.0, rate=1.0, shadow=True)


@pytest.mark.parametrize(
    ("state", "spec", "now", "level"),
    [
        (None, TEN_PER_S, 5.0, 10.0),  # never seen: full
        (BucketState(0.0, 0.0), TEN_PER_S, 0.5, 5.0),  # continuous refill
        (BucketState(0.0, 0.0), TEN_PER_S, 9.0, 10.0),  # capped at capacity
        (BucketState(4.0, 2.0), TEN_PER_S, 1.0, 4.0),  # clock went back: no refill, no loss
        (BucketState(-30.0, 0.0), DEBT, 1.0, -20.0),  # debt refills too
        (BucketState(50.0, 0.0), TEN_PER_S, 0.0, 10.0),  # capacity shrank on reload
    ],
)
def test_refill(state: BucketState | None, spec: BucketSpec, now: float, level: float) -> None:
    assert refill(state, spec, now) == pytest.approx(level)


@pytest.mark.parametrize(
    ("level", "spec", "hits", "admitted", "after"),
    [
        (10.0, TEN_PER_S, 1, True, 9.0),
        (1.0, TEN_PER_S, 1, True, 0.0),
        (0.99, TEN_PER_S, 1, False, 0.99),
        (5.0, TEN_PER_S, 6, False, 5.0),
        (5.0, TEN_PER_S, 5, True, 0.0),
        (1.0, TEN_PER_S, 0, True, 1.0),  # check only: one more request would pass
        (0.5, TEN_PER_S, 0, False, 0.5),  # check only: it would not
        (20.0, BURSTY, 20, True, 0.0),  # burst is the capacity
        (0.5, DEBT, 0, True, 0.5),  # debt check admits while above zero
        (0.0, DEBT, 0, False, 0.0),
        (-5.0, DEBT, 0, False, -5.0),
        (3.0, DEBT, 500, True, -497.0),  # a charge always applies, into debt
        (-497.0, DEBT, 10, True, -507.0),
        (0.0, SHADOW, 1, False, 0.0),  # shadow: reports the denial, not charged
    ],
)
def test_single_bucket(level: float, spec: BucketSpec, hits: int, admitted: bool, after: float) -> None:
    decision = decide({"k": BucketState(level, 0.0)}, [Hit("k", spec, hits)], 0.0)
    assert decision.results[0].admitted is admitted
    assert decision.results[0].level == pytest.approx(after)
    request_admitted = admitted or spec.shadow
    assert decision.admitted is request_admitted


def test_denied_request_takes_nothing_from_any_bucket() -> None:
    states = {"a": BucketState(5.0, 0.0), "b": BucketState(0.0, 0.0)}
    decision = decide(states, [Hit("a", TEN_PER_S, 1), Hit("b", TEN_PER_S, 1)], 0.0)
    assert not decision.admitted
    assert [r.admitted for r in decision.results] == [True, False]
    assert [r.level for r in decision.results] == [5.0, 0.0]
    assert decision.writes == {}


def test_debt_charge_applies_even_when_another_bucket_denies() -> None:
    states = {"tok": BucketState(10.0, 0.0), "req": BucketState(0.0, 0.0)}
    decision = decide(states, [Hit("tok", DEBT, 50), Hit("req", TEN_PER_S, 1)], 0.0)
    assert not decision.admitted
    assert decision.writes == {"tok": BucketState(-40.0, 0.0)}


def test_same_key_twice_sees_the_first_charge() -> None:
    decision = decide({"a": BucketState(1.5, 0.0)}, [Hit("a", TEN_PER_S, 1)] * 2, 0.0)
    assert not decision.admitted
    assert [r.admitted for r in decision.results] == [True, False]
    assert decision.results[0].level == 1.5  # denied: nothing taken


def test_shadow_denial_does_not_deny_or_charge() -> None:
    states = {"s": BucketState(0.0, 0.0), "a": BucketState(5.0, 0.0)}
    decision = decide(states, [Hit("s", SHADOW, 1), Hit("a", TEN_PER_S, 1)], 0.0)
    assert decision.admitted
    assert decision.writes == {"a": BucketState(4.0, 0.0)}


def test_float_refill_admits_exactly_at_one_token() -> None:
    spec = BucketSpec(capacity=1.0, rate=3.0)
    state = BucketState(0.0, 0.0)
    level = refill(state, spec, 1 / 3)
    assert decide({"k": BucketState(0.0, 0.0)}, [Hit("k", spec, 1)], 1 / 3).admitted
    assert level == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("spec", "result", "hits", "remaining", "reset", "retry"),
    [
        (TEN_PER_S, BucketResult(True, 7.6), 1, 7, 0.24, 0.0),
        (TEN_PER_S, BucketResult(False, 0.5), 1, 0, 0.95, 0.05),
        (TEN_PER_S, BucketResult(False, 2.0), 5, 2, 0.8, 0.3),
        (TEN_PER_S, BucketResult(False, 2.0), 11, 2, 0.8, None),  # more than the burst: never
        (BucketSpec(0.0, 0.0), BucketResult(False, 0.0), 1, 0, 0.0, None),  # requests_per_unit 0
        (DEBT, BucketResult(False, -40.0), 0, 0, 14.0, 4.0),  # debt: wait until above zero
        (DEBT, BucketResult(True, -40.0), 30, 0, 14.0, 0.0),
    ],
)
def test_report(
    spec: BucketSpec,
    result: BucketResult,
    hits: int,
    remaining: int,
    reset: float,
    retry: float | None,
) -> None:
    verdict = report(spec, result, hits)
    assert verdict.remaining == remaining
    assert verdict.reset_s == pytest.approx(reset)
    if retry is None:
        assert verdict.retry_after_s is None
    else:
        assert verdict.retry_after_s == pytest.approx(retry, abs=1e-6)


def test_idle_ttl_is_time_to_full_plus_margin() -> None:
    assert idle_ttl_s(TEN_PER_S, 5.0, margin_s=1.0) == pytest.approx(1.5)
    assert idle_ttl_s(DEBT, -100.0, margin_s=0.0) == pytest.approx(20.0)
    assert idle_ttl_s(BucketSpec(0.0, 0.0), 0.0, margin_s=2.0) == 2.0


_steps = st.lists(
    st.tuples(st.floats(min_value=0.0, max_value=2.0), st.integers(min_value=1, max_value=4)),
    min_size=1,
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(min_value=1, max_value=10),
    rate=st.floats(min_value=0.1, max_value=20.0),
    steps=_steps,
)
def test_never_admits_more_than_burst_plus_rate_times_window(
    capacity: int, rate: float, steps: list[tuple[float, int]]
) -> None:
    spec = BucketSpec(float(capacity), rate)
    state: BucketState | None = None
    now = 0.0
    admitted: list[tuple[float, int]] = []
    for gap, hits in steps:
        now += gap
        decision = decide({"k": state}, [Hit("k", spec, hits)], now)
        state = decision.writes.get("k", state)
        if decision.admitted:
            admitted.append((now, hits))
    for i, (start, _) in enumerate(admitted):
        total = 0
        for at, hits in admitted[i:]:
            total += hits
            assert total <= capacity + rate * (at - start) + 1e-6, (start, at, total)


def test_retry_after_is_enough() -> None:
    spec = BucketSpec(3.0, 0.7)
    state = BucketState(0.2, 0.0)
    decision = decide({"k": state}, [Hit("k", spec, 2)], 0.0)
    wait = report(spec, decision.results[0], 2).retry_after_s
    assert wait is not None and wait > 0
    assert not decide({"k": state}, [Hit("k", spec, 2)], wait * 0.99).admitted
    assert decide({"k": state}, [Hit("k", spec, 2)], wait).admitted
    assert math.isfinite(wait)
