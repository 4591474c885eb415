"""Deadline and circuit breaker around a store that hangs or fails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from ratelimit.bucket import BucketResult, BucketSpec, Hit, Settle
from ratelimit.errors import BackendError, NodeDown
from ratelimit.metrics import RateLimitMetrics
from ratelimit.shielded_store import ShieldedStore
from ratelimit.store import StoreResult
from sidecar_runtime.redis.breaker import BreakerState

from .helpers import FakeClock


def breaker_of(guard: ShieldedStore) -> BreakerState:
    return guard.breaker_state  # read through a call: mypy must not narrow across calls


class ScriptedStore:
    def __init__(self) -> None:
        self.mode = "ok"
        self.calls = 0

    async def decide(self, hits: Sequence[Hit]) -> StoreResult:
        self.calls += 1
        if self.mode == "hang":
            await asyncio.sleep(10)
        if self.mode == "fail":
            raise BackendError("boom")
        if self.mode == "node_down":
            raise NodeDown("redis cluster node 127.0.0.1:7001 is down")
        return StoreResult(True, tuple(BucketResult(True, 1.0) for _ in hits))

    async def settle(self, settles: Sequence[Settle]) -> None:
        self.calls += 1

    async def connect(self) -> None:
        self.calls += 1
        if self.mode == "hang":
            await asyncio.sleep(10)
        if self.mode == "fail":
            raise BackendError("connection refused")

    async def aclose(self) -> None:
        return None


async def test_deadline_breaker_and_recovery() -> None:
    inner, clock, metrics = ScriptedStore(), FakeClock(), RateLimitMetrics()
    guard = ShieldedStore(inner, timeout_s=0.05, cooldown_s=1.0, metrics=metrics, clock=clock)
    assert (await guard.decide([])).admitted

    inner.mode = "hang"
    started = time.perf_counter()
    with pytest.raises(BackendError, match="deadline"):
        await guard.decide([])
    assert time.perf_counter() - started < 1.0  # the deadline (0.05 s), not the hang (10 s)
    assert breaker_of(guard) is BreakerState.OPEN
    assert metrics.breaker_state._value.get() == 1

    calls = inner.calls
    for _ in range(5):  # open: fails at once without touching the store
        with pytest.raises(BackendError, match="breaker"):
            await guard.decide([])
    assert inner.calls == calls
    assert metrics.backend_errors.labels("breaker_open")._value.get() == 5

    clock.advance(1.0)
    inner.mode = "fail"
    with pytest.raises(BackendError, match="boom"):  # the half-open probe fails
        await guard.decide([])
    assert breaker_of(guard) is BreakerState.OPEN

    clock.advance(1.0)
    inner.mode = "ok"
    assert (await guard.decide([])).admitted  # the probe succeeds
    assert breaker_of(guard) is BreakerState.CLOSED
    assert metrics.breaker_state._value.get() == 0


async def test_cancelled_probe_does_not_wedge_the_breaker() -> None:
    inner, clock = ScriptedStore(), FakeClock()
    guard = ShieldedStore(inner, 5.0, 1.0, RateLimitMetrics(), clock=clock)
    inner.mode = "hang"
    task = asyncio.create_task(guard.decide([]))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert breaker_of(guard) is BreakerState.OPEN
    clock.advance(1.0)
    inner.mode = "ok"
    assert (await guard.decide([])).admitted


async def test_a_lone_missed_deadline_does_not_open_the_breaker() -> None:
    inner, clock, metrics = ScriptedStore(), FakeClock(), RateLimitMetrics()
    guard = ShieldedStore(inner, 0.02, 1.0, metrics, clock=clock, failures_to_open=3)
    inner.mode = "hang"
    with pytest.raises(BackendError, match="deadline"):
        await guard.decide([])
    inner.mode = "ok"
    assert (await guard.decide([])).admitted
    assert breaker_of(guard) is BreakerState.CLOSED
    inner.mode = "hang"
    for _ in range(3):  # three in a row: a real outage
        with pytest.raises(BackendError, match="deadline"):
            await guard.decide([])
    assert breaker_of(guard) is BreakerState.OPEN
    with pytest.raises(BackendError, match="breaker"):
        await guard.decide([])


async def test_a_dead_cluster_master_does_not_open_the_breaker_for_every_key() -> None:
    """Its keys get the policy (a BackendError), every other key is still sent to Redis."""
    inner, clock, metrics = ScriptedStore(), FakeClock(), RateLimitMetrics()
    guard = ShieldedStore(inner, timeout_s=0.05, cooldown_s=1.0, metrics=metrics, clock=clock,
                         failures_to_open=1)
    inner.mode = "node_down"
    for _ in range(10):
        with pytest.raises(BackendError):
            await guard.decide([])
    assert breaker_of(guard) is BreakerState.CLOSED
    assert metrics.backend_errors.labels("node_down")._value.get() == 10
    inner.mode = "ok"
    assert (await guard.decide([])).admitted
    assert inner.calls == 11


class SettlingStore(ScriptedStore):
    """Records what each settle applied; fails settles while ``mode`` is ``fail``."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[Settle] = []

    async def settle(self, settles: Sequence[Settle]) -> None:
        self.calls += 1
        if self.mode == "fail":
            raise BackendError("boom")
        self.applied.extend(settles)


def release(lease: str) -> Settle:
    return Settle("rl:s:kind.tenant:{x}", BucketSpec(1, 0, concurrent=True), lease, None)


async def test_ends_the_store_failed_are_applied_once_it_answers_again() -> None:
    """A slot released during an outage (the breaker open, or Redis failing) used to stay
    taken for its lease's 10 minutes; it is kept and released once the store answers."""
    inner, clock, metrics = SettlingStore(), FakeClock(), RateLimitMetrics()
    guard = ShieldedStore(inner, timeout_s=0.05, cooldown_s=1.0, metrics=metrics, clock=clock)
    inner.mode = "fail"
    with pytest.raises(BackendError):
        await guard.settle([release("a" * 24)])
    with pytest.raises(BackendError):  # skipped: the breaker is open
        await guard.settle([release("b" * 24), release("c" * 24)])
    assert guard.pending == 3 and inner.applied == []
    inner.mode = "ok"
    clock.advance(1.1)  # the cooldown is over: the next call is tried
    assert (await guard.decide([])).admitted
    for _ in range(100):
        if not guard.pending:
            break
        await asyncio.sleep(0.01)
    assert [s.lease for s in inner.applied] == ["a" * 24, "b" * 24, "c" * 24]
    assert metrics.settlements.labels("retried")._value.get() == 3
    await guard.aclose()


@pytest.mark.parametrize(("mode", "calls"), [("ok", range(1, 2)), ("fail", range(2, 11)),
                                              ("hang", range(1, 2))])
async def test_start_up_gets_the_store_ready_and_never_waits_on_a_dead_one(
        mode: str, calls: range, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that is down at start-up is asked again until the bound (a Redis started beside
    the service may not listen yet), then logged, not fatal; a hung one does not hold the
    start beyond the bound; the breaker is untouched (the first request finds out)."""
    monkeypatch.setattr("ratelimit.shielded_store.CONNECT_TIMEOUT_S", 1.0)
    inner = ScriptedStore()
    inner.mode = mode
    guard = ShieldedStore(inner, timeout_s=0.05, cooldown_s=1.0, metrics=RateLimitMetrics())
    started = time.monotonic()
    await guard.connect()
    assert inner.calls in calls  # "fail": every 0.1 s for 1 s (fewer on a loaded machine)
    assert time.monotonic() - started < 5  # the bound is 1 s; "hang" sleeps 10
    assert breaker_of(guard) is BreakerState.CLOSED


async def test_a_store_that_comes_up_during_start_up_is_got_ready(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ratelimit.shielded_store.CONNECT_TIMEOUT_S", 5.0)
    inner = ScriptedStore()
    inner.mode = "fail"
    real = inner.connect

    async def comes_up() -> None:
        if inner.calls == 2:
            inner.mode = "ok"
        await real()
    monkeypatch.setattr(inner, "connect", comes_up)
    guard = ShieldedStore(inner, timeout_s=0.05, cooldown_s=1.0, metrics=RateLimitMetrics())
    await guard.connect()
    assert inner.calls == 3  # refused twice, ready the third time: no more asked
