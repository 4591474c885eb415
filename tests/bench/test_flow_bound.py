"""``bench.flow_bound``'s model gateway: the bound the flow-control bench prints beside the quiet
tenant's bar must follow the rules it claims (strict bands, the quiet tenant first within a
band, ``max_wait``, the fastest free pod, whole holds), or it bounds nothing."""

from __future__ import annotations

import math

import pytest

from bench.flow_bound import Job, hold_seconds, model_waits, quiet_ttfts

HIGH, LOW = 0, 1


def _job(at: float, band: int, quiet: bool = False, hold: float = 1.0) -> Job:
    return Job(at, band, quiet, hold)


def test_a_free_slot_is_taken_at_once_and_a_full_pool_waits_for_the_first_to_end() -> None:
    jobs = [_job(0.0, LOW, hold=1.0), _job(0.25, LOW, hold=3.0), _job(0.5, LOW)]
    waits = model_waits(jobs, [1.0, 1.0], 1, max_wait_s=10.0)
    assert waits == [0.0, 0.0, pytest.approx(0.5)]  # the first pod frees at 1.0


def test_the_low_band_waits_while_the_high_band_has_any() -> None:
    # One slot busy until 1.0; a quiet low request waits longer than a loud high one.
    jobs = [_job(0.0, LOW), _job(0.1, LOW, quiet=True), _job(0.2, HIGH)]
    waits = model_waits(jobs, [1.0], 1, max_wait_s=10.0)
    assert waits == [0.0, pytest.approx(1.9), pytest.approx(0.8)]


def test_within_a_band_the_quiet_tenant_goes_first_whenever_it_came() -> None:
    jobs = [_job(0.0, LOW), _job(0.1, LOW), _job(0.2, LOW), _job(0.3, LOW, quiet=True)]
    waits = model_waits(jobs, [1.0], 1, max_wait_s=10.0)
    assert waits == [0.0, pytest.approx(1.9), pytest.approx(2.8), pytest.approx(0.7)]


def test_a_wait_past_max_wait_is_refused_and_holds_no_slot() -> None:
    jobs = [_job(0.0, LOW, hold=5.0), _job(1.0, LOW), _job(4.5, LOW, hold=1.0)]
    waits = model_waits(jobs, [1.0], 1, max_wait_s=2.0)
    assert waits == [0.0, None, pytest.approx(0.5)]  # at 5.0 the second had waited 4 s


def test_the_fastest_free_pod_takes_the_request_and_a_slow_pod_holds_it_longer() -> None:
    # Pods at speed 0.5 and 1.0, one slot each: the first request goes to the fast pod, the
    # second to the slow one (2 s for a 1 s hold), so the third waits for the fast one.
    jobs = [_job(0.0, LOW), _job(0.0, LOW), _job(0.1, LOW)]
    waits = model_waits(jobs, [0.5, 1.0], 1, max_wait_s=10.0)
    assert waits == [0.0, 0.0, pytest.approx(0.9)]


def test_the_quiet_ttfts_are_the_waits_plus_the_unloaded_ttfts_of_answered_quiet_requests() -> None:
    jobs = [_job(0.0, LOW, quiet=True), _job(0.0, LOW), _job(0.0, LOW, quiet=True),
            _job(0.0, LOW, quiet=True)]
    assert quiet_ttfts(jobs, [0.5, 0.0, None, 0.25], [0.1, 9.0, 0.1, None]) == [0.6]


def test_a_hold_is_the_uncached_prefill_then_the_whole_output() -> None:
    assert math.isclose(hold_seconds(1000, 200, 100, prefill_s=0.001, decode_s=0.01), 1.8)
    assert hold_seconds(100, 200, 10, prefill_s=0.001, decode_s=0.01) == pytest.approx(0.1)
