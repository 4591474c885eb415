"""Pods ejected for failing their answers (:meth:`PoolState.record_answer`,
:meth:`EndpointPicker.answered`): a pod whose engine fails every request fails fast, looks idle
to the scorers, and would otherwise draw the most traffic."""

from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from extproc.picker.pick import EndpointPicker
from extproc.picker.runtime import PickerRuntime
from extproc.picker.state import EJECT_AFTER, EJECT_BASE_S, EJECT_MAX_S, PoolState
from tests.extproc.picker.test_picker import PODS, Clock, config, picker, prompt, scrape

BAD = PODS[0]


def pool_of(n: int) -> PoolState:
    pool = PoolState("pool", 1.0)
    pool.set_addresses(PODS[:n])
    return pool


def fail(pool: PoolState, address: str, times: int, now: float) -> list[bool]:
    return [pool.record_answer(address, True, now) for _ in range(times)]


def test_five_5xx_in_a_row_eject_and_a_good_answer_restarts_the_count() -> None:
    pool = pool_of(4)
    assert fail(pool, BAD, EJECT_AFTER - 1, 0.0) == [False] * (EJECT_AFTER - 1)
    assert not pool.record_answer(BAD, False, 0.0)  # the run is broken
    assert fail(pool, BAD, EJECT_AFTER, 0.0) == [False] * (EJECT_AFTER - 1) + [True]
    pod = pool.pods[BAD]
    assert pod.avoided(EJECT_BASE_S - 0.1) and not pod.avoided(EJECT_BASE_S)
    assert pod.ejections_total == 1


def test_ejections_in_a_row_double_up_to_the_cap_and_a_good_answer_resets_them() -> None:
    pool, now, lengths = pool_of(4), 0.0, []
    for _ in range(8):
        assert fail(pool, BAD, EJECT_AFTER, now)[-1]
        lengths.append(pool.pods[BAD].ejected_until - now)
        now = pool.pods[BAD].ejected_until  # back, and failing again
    assert lengths == [min(EJECT_MAX_S, EJECT_BASE_S * 2 ** k) for k in range(8)]
    pool.record_answer(BAD, False, now)
    assert fail(pool, BAD, EJECT_AFTER, now)[-1]
    assert pool.pods[BAD].ejected_until - now == EJECT_BASE_S


def test_failures_while_ejected_neither_lengthen_it_nor_count_after_it() -> None:
    """Answers to requests picked before the ejection (or sent as a last fallback) arrive while
    it is out: back, the pod needs five new failures to go again (for twice as long)."""
    pool = pool_of(4)
    fail(pool, BAD, EJECT_AFTER, 0.0)
    assert fail(pool, BAD, 3 * EJECT_AFTER, 1.0) == [False] * (3 * EJECT_AFTER)
    assert pool.pods[BAD].ejected_until == EJECT_BASE_S
    back = EJECT_BASE_S
    assert fail(pool, BAD, EJECT_AFTER, back) == [False] * (EJECT_AFTER - 1) + [True]
    assert pool.pods[BAD].ejected_until == back + 2 * EJECT_BASE_S


def test_a_pod_failing_for_days_stays_at_the_longest_ejection() -> None:
    pool = pool_of(4)
    pool.pods[BAD].ejections = 5000  # ~17 days of 5-minute ejections in a row
    assert fail(pool, BAD, EJECT_AFTER, 0.0)[-1]
    assert pool.pods[BAD].ejected_until == EJECT_MAX_S


@pytest.mark.parametrize(("pods", "most_out"), [(1, 1), (2, 1), (3, 1), (4, 2)])
def test_at_most_half_the_pool_is_ejected(pods: int, most_out: int) -> None:
    """Requests that fail on every pod (a client that found a prompt vLLM answers 500) cannot
    empty the pool; the next pod goes as soon as another comes back."""
    pool = pool_of(pods)
    for address in PODS[:pods]:
        fail(pool, address, EJECT_AFTER, 0.0)
    assert sum(pod.avoided(1.0) for pod in pool.pods.values()) == most_out
    if pods > most_out:
        waiting = PODS[most_out]
        assert pool.record_answer(waiting, True, EJECT_BASE_S)  # its run went on


def test_an_unknown_pod_is_ignored() -> None:
    assert not pool_of(2).record_answer("10.9.9.9:1", True, 0.0)


def eject(p: EndpointPicker, clock: Clock, address: str) -> None:
    for _ in range(EJECT_AFTER):
        p.answered("pool", address, 500)
    assert p.pools["pool"].pods[address].avoided(clock.now)


def test_an_ejected_pod_is_picked_only_as_a_last_fallback_until_it_returns() -> None:
    p, clock = picker()
    two, _ = picker({"pool": {"endpoints": PODS[:2], "max_context": 8, "endpoint_picker": {}}})
    scrape(two, clock.now)
    eject(two, clock, BAD)
    only = two.pick("pool", prompt(3), "medium")
    assert only is not None and (only.endpoint, only.fallbacks) == (PODS[1], (BAD,))
    scrape(p, clock.now)
    eject(p, clock, BAD)
    got: Counter[str | None] = Counter()
    for i in range(60):
        result = p.pick("pool", prompt(i), "medium")
        assert result is not None and result.endpoint != BAD
        # Named last, if at all (the reachable pods fill the fallbacks first).
        assert BAD not in result.fallbacks[:-1]
        got[result.endpoint] += 1
    assert set(got) == set(PODS[1:])
    clock.now += EJECT_BASE_S
    scrape(p, clock.now)
    assert any(p.pick("pool", prompt(i), "medium").endpoint == BAD  # type: ignore[union-attr]
               for i in range(60))


@pytest.mark.parametrize("status", [200, 400, 404, 429])
def test_answers_below_500_never_eject(status: int) -> None:
    p, clock = picker()
    for _ in range(3 * EJECT_AFTER):
        assert not p.answered("pool", BAD, status)
    assert not p.pools["pool"].pods[BAD].avoided(clock.now)


def test_a_cluster_without_picker_is_not_told() -> None:
    p, _ = picker()
    assert not p.answered("nowhere", BAD, 500)


async def test_the_runtime_logs_an_ejection_and_exports_it() -> None:
    registry = CollectorRegistry()
    runtime = PickerRuntime(config(), registry)
    with capture_logs() as logs:
        told = [runtime.answered("pool", BAD, 500) for _ in range(EJECT_AFTER)]
    assert told == [False] * (EJECT_AFTER - 1) + [True]
    labels = {"cluster": "pool", "endpoint": BAD}
    assert registry.get_sample_value("llm_sidecar_endpoint_ejected", labels) == 1.0
    assert registry.get_sample_value("llm_sidecar_endpoint_ejections_total", labels) == 1.0
    assert registry.get_sample_value("llm_sidecar_endpoint_ejected",
                                     {"cluster": "pool", "endpoint": PODS[1]}) == 0.0
    assert [(e["event"], e["endpoint"], e["seconds"]) for e in logs] \
        == [("picker_pod_ejected", BAD, EJECT_BASE_S)]
