from __future__ import annotations

from sidecar_runtime.redis.breaker import Breaker, BreakerState


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


def test_opens_only_after_consecutive_failures() -> None:
    breaker = Breaker(cooldown_s=1.0, failures_to_open=3)
    assert not breaker.failure(0.0)
    assert not breaker.failure(0.1)
    breaker.success()  # a success in between: the count starts again
    assert not breaker.failure(0.2)
    assert not breaker.failure(0.3)
    assert state_of(breaker) is BreakerState.CLOSED
    assert breaker.failure(1.0)
    assert state_of(breaker) is BreakerState.OPEN
    assert not breaker.allow(1.5)
    assert breaker.allow(2.0)  # the probe
    assert breaker.failure(2.1)  # one failed probe reopens: no second chance
    assert state_of(breaker) is BreakerState.OPEN


def test_late_failures_do_not_extend_the_cooldown() -> None:
    breaker = Breaker(cooldown_s=1.0)
    assert breaker.failure(0.0)
    assert not breaker.failure(0.5)  # a call started before the breaker opened
    assert breaker.allow(1.0)


def test_an_inconclusive_call_neither_counts_nor_holds_the_probe() -> None:
    breaker = Breaker(cooldown_s=1.0, failures_to_open=2)
    assert not breaker.failure(0.0)
    breaker.inconclusive()  # a dead Cluster master's key: not evidence either way
    assert state_of(breaker) is BreakerState.CLOSED
    assert breaker.failure(0.1)  # the earlier failure still counts
    assert breaker.allow(1.1)  # the probe...
    breaker.inconclusive()  # ...only needed the dead master: the next caller probes at once
    assert state_of(breaker) is BreakerState.HALF_OPEN
    assert breaker.allow(1.2)
    assert not breaker.allow(1.3)
    breaker.success()
    assert state_of(breaker) is BreakerState.CLOSED
