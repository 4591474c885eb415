from __future__ import annotations

from llm_sidecar.breaker import Breaker, BreakerState


def state_of(breaker: Breaker) -> BreakerState:
    return breaker.state  # read through a call: mypy must not narrow across transitions


def test_breaker_cycle() -> None:
    breaker = Breaker(cooldown_s=1.0)
    assert breaker.allow(0.0)
    breaker.failure(0.0)
    assert state_of(breaker) is BreakerState.OPEN
    assert not breaker.allow(0.5)
    assert breaker.allow(1.0)  # the probe
    assert state_of(breaker) is BreakerState.HALF_OPEN
    assert not breaker.allow(1.1)  # only one probe at a time
    breaker.failure(1.2)
    assert not breaker.allow(2.1)
    assert breaker.allow(2.2)
    breaker.success()
    assert state_of(breaker) is BreakerState.CLOSED
    assert breaker.allow(2.3)


def test_lost_probe_is_replaced_after_a_cooldown() -> None:
    breaker = Breaker(cooldown_s=1.0)
    breaker.failure(0.0)
    assert breaker.allow(1.0)
    assert not breaker.allow(1.5)
    assert breaker.allow(2.0)
