"""The bucket store behind the shared guarded call (:mod:`sidecar_runtime.guarded`): a dead or
frozen Redis costs a few deadlines per cooldown (``failures_to_open``), not one per request,
and is tried again by itself."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from ratelimit.bucket import Hit, Settle
from ratelimit.metrics import RateLimitMetrics
from ratelimit.store import BucketStore, StoreResult
from sidecar_runtime.breaker import BreakerState
from sidecar_runtime.guarded import Guard

T = TypeVar("T")


class GuardedStore:
    """A :class:`BucketStore` that raises :class:`~sidecar_runtime.guarded.BackendError` quickly
    instead of waiting: on a missed ``timeout_s`` deadline, a store error, or while the breaker
    is open."""

    def __init__(
        self,
        inner: BucketStore,
        timeout_s: float,
        cooldown_s: float,
        metrics: RateLimitMetrics,
        clock: Callable[[], float] = time.monotonic,
        failures_to_open: int = 1,
    ) -> None:
        self.inner = inner
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._guard = Guard(
            cooldown_s=cooldown_s, failures_to_open=failures_to_open, logger="ratelimit.backend",
            failed_event="ratelimit_backend_failed", recovered_event="ratelimit_backend_recovered",
            skip_detail="skipping the backend",
            on_error=lambda _op, reason: metrics.backend_errors.labels(reason).inc(),
            on_state=metrics.set_breaker, clock=clock)

    @property
    def breaker_state(self) -> BreakerState:
        return self._guard.state

    async def decide(self, hits: Sequence[Hit]) -> StoreResult:
        return await self._guarded(lambda: self.inner.decide(hits))

    async def settle(self, settles: Sequence[Settle]) -> None:
        """The same deadline and breaker as :meth:`decide`: a stream-done call does not wait on
        a Redis that is down (the reservation then stands, the slot waits for its lease TTL)."""
        await self._guarded(lambda: self.inner.settle(settles))

    async def _guarded(self, call: Callable[[], Awaitable[T]]) -> T:
        started = time.perf_counter()
        try:
            return await self._guard.call(call, self._timeout_s)
        finally:
            self._metrics.backend_latency.observe(time.perf_counter() - started)

    async def aclose(self) -> None:
        await self.inner.aclose()
