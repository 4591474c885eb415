"""The bucket store behind the shared guarded call (:mod:`sidecar_runtime.redis.shield`): a dead or
frozen Redis costs a few deadlines per cooldown (``failures_to_open``), not one per request,
and is tried again by itself."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TypeVar

from ratelimit.bucket import Hit, Settle
from ratelimit.metrics import RateLimitMetrics
from ratelimit.store import BucketStore, StoreResult
from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.redis.breaker import BreakerState
from sidecar_runtime.redis.shield import BackendError, Shield, ready_within

T = TypeVar("T")
log = get_logger("ratelimit.backend")

PENDING_MAX = 16_384
"""Ends of requests (slot releases, token settles) kept to try again after the store failed
them: beyond this the oldest are dropped (their slots free themselves when their lease
expires; their reservations stand)."""
RETRY_BATCH = 256
CONNECT_TIMEOUT_S = 2.0
"""How long start-up waits for the store to get ready (:meth:`ShieldedStore.connect`)."""


class ShieldedStore:
    """A :class:`BucketStore` that raises :class:`~sidecar_runtime.redis.shield.BackendError` quickly
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
        self._pending: deque[Settle] = deque(maxlen=PENDING_MAX)
        self._retrying: asyncio.Task[None] | None = None
        self._guard = Shield(
            cooldown_s=cooldown_s, failures_to_open=failures_to_open, logger="ratelimit.backend",
            failed_event="ratelimit_backend_failed", recovered_event="ratelimit_backend_recovered",
            skip_detail="skipping the backend",
            on_error=lambda _op, reason: metrics.backend_errors.labels(reason).inc(),
            on_state=metrics.set_breaker, clock=clock)

    @property
    def breaker_state(self) -> BreakerState:
        return self._guard.state

    async def connect(self) -> None:
        """Get the store ready before the first request (connections, TLS, AUTH, scripts), so
        that request's deadline does not pay for it: :func:`ready_within`, for up to
        ``CONNECT_TIMEOUT_S``. A store that is still down is not an error here (it is logged):
        decisions take ``on_backend_error`` until it answers."""
        error = await ready_within(self.inner.connect, max(self._timeout_s, CONNECT_TIMEOUT_S))
        if error is not None:
            log.warning("ratelimit_backend_unreachable_at_start", error=str(error) or "timeout",
                        detail="decisions take on_backend_error until it answers")

    async def decide(self, hits: Sequence[Hit]) -> StoreResult:
        result = await self._guarded(lambda: self.inner.decide(hits))
        if self._pending:
            self._retry_soon()
        return result

    async def settle(self, settles: Sequence[Settle]) -> None:
        """The same deadline and breaker as :meth:`decide`: a stream-done call does not wait on
        a Redis that is down. What it could not apply is kept and applied once the store
        answers again (a release or a settle applies once, however often it is sent): without
        that, a slot released during an outage stayed taken for its lease's 10 minutes."""
        try:
            await self._guarded(lambda: self.inner.settle(settles))
        except BackendError:
            self._pending.extend(settles)
            raise
        if self._pending:
            self._retry_soon()

    @property
    def pending(self) -> int:
        """Ends of requests waiting for the store to answer again."""
        return len(self._pending)

    def _retry_soon(self) -> None:
        if self._retrying is None or self._retrying.done():
            self._retrying = asyncio.get_running_loop().create_task(self._retry())

    async def _retry(self) -> None:
        while self._pending:
            batch = [self._pending.popleft() for _ in range(min(RETRY_BATCH, len(self._pending)))]
            try:
                await self._guarded(partial(self.inner.settle, batch))
            except BackendError:
                self._pending.extendleft(reversed(batch))  # the next answer tries again
                return
            self._metrics.settlements.labels("retried").inc(len(batch))

    async def _guarded(self, call: Callable[[], Awaitable[T]]) -> T:
        started = time.perf_counter()
        try:
            return await self._guard.call(call, self._timeout_s)
        finally:
            self._metrics.backend_latency.observe(time.perf_counter() - started)

    async def aclose(self) -> None:
        if self._retrying is not None and not self._retrying.done():
            self._retrying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retrying
        await self.inner.aclose()
