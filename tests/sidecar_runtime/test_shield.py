"""The one guarded backend call both services use (deadline, breaker, log once per outage)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from sidecar_runtime.redis.breaker import BreakerState
from sidecar_runtime.redis.shield import BackendError, BreakerOpen, NodeDown, Shield


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def guard(clock: Clock, errors: list[tuple[str, str]], failures_to_open: int = 1) -> Shield:
    return Shield(cooldown_s=1.0, failures_to_open=failures_to_open, logger="test",
                 failed_event="failed", recovered_event="recovered", skip_detail="skipping",
                 on_error=lambda op, reason: errors.append((op, reason)),
                 on_state=lambda _state: None, clock=clock)


def state_of(g: Shield) -> BreakerState:
    """Read through a call, so the type checker does not narrow one read onto the next."""
    return g.state


def answer(value: int) -> Callable[[], Awaitable[int]]:
    async def call() -> int:
        return value
    return call


def raising(exc: Exception) -> Callable[[], Awaitable[int]]:
    async def call() -> int:
        raise exc
    return call


async def hang() -> int:
    await asyncio.sleep(3600)
    return 0


async def test_a_timeout_opens_the_breaker_and_the_next_call_is_skipped() -> None:
    clock, errors = Clock(), list[tuple[str, str]]()
    g = guard(clock, errors)
    assert await g.call(answer(7), 1.0, "op") == 7
    with pytest.raises(BackendError, match="deadline"):
        await g.call(hang, 0.01, "op")
    assert state_of(g) is BreakerState.OPEN
    with pytest.raises(BreakerOpen):
        await g.call(answer(1), 1.0, "op")
    clock.now = 1.5  # after the cooldown the next call is the probe, and closes it
    assert await g.call(answer(2), 1.0, "op") == 2
    assert state_of(g) is BreakerState.CLOSED
    assert errors == [("op", "timeout"), ("op", "breaker_open")]


async def test_failures_to_open_counts_consecutive_errors() -> None:
    clock, errors = Clock(), list[tuple[str, str]]()
    g = guard(clock, errors, failures_to_open=2)
    with pytest.raises(BackendError):
        await g.call(raising(BackendError("boom")), 1.0)
    assert state_of(g) is BreakerState.CLOSED
    with pytest.raises(BackendError):
        await g.call(raising(BackendError("boom")), 1.0)
    assert state_of(g) is BreakerState.OPEN


async def test_a_node_down_neither_opens_nor_closes_the_breaker() -> None:
    clock, errors = Clock(), list[tuple[str, str]]()
    g = guard(clock, errors)
    with pytest.raises(NodeDown):
        await g.call(raising(NodeDown("one master")), 1.0, "lookup")
    assert state_of(g) is BreakerState.CLOSED and errors == [("lookup", "node_down")]


async def test_a_cancelled_half_open_probe_does_not_leave_the_breaker_stuck() -> None:
    """Envoy resets the stream while the probe waits on Redis: the probe counts as failed, so
    the breaker is open again for one cooldown, not half-open with a probe nobody finishes."""
    clock, errors = Clock(), list[tuple[str, str]]()
    g = guard(clock, errors)
    with pytest.raises(BackendError):
        await g.call(raising(BackendError("down")), 1.0)
    clock.now = 1.5
    probe = asyncio.create_task(g.call(hang, 10.0))
    await asyncio.sleep(0)
    assert state_of(g) is BreakerState.HALF_OPEN
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert state_of(g) is BreakerState.OPEN
    clock.now = 2.6
    assert await g.call(answer(3), 1.0) == 3
    assert state_of(g) is BreakerState.CLOSED


async def test_the_state_is_published_at_start_and_at_each_change_only() -> None:
    clock, errors, published = Clock(), list[tuple[str, str]](), list[BreakerState]()
    g = Shield(cooldown_s=1.0, failures_to_open=1, logger="test", failed_event="failed",
              recovered_event="recovered", skip_detail="skipping",
              on_error=lambda op, reason: errors.append((op, reason)),
              on_state=published.append, clock=clock)
    for _ in range(3):
        await g.call(answer(1), 1.0)
    assert published == [BreakerState.CLOSED]
    with pytest.raises(BackendError):
        await g.call(raising(BackendError("boom")), 1.0)
    with pytest.raises(BreakerOpen):
        await g.call(answer(1), 1.0)
    clock.now = 1.5  # the probe: half-open while it runs, closed once it answered
    await g.call(answer(1), 1.0)
    await g.call(answer(1), 1.0)
    assert published == [BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN,
                         BreakerState.CLOSED]
    assert published[-1] is state_of(g)
