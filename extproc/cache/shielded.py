"""The embedding cache as the service uses it: a :class:`VectorStore` behind a deadline, a circuit
breaker and metrics.

A lookup never raises and never waits past its deadline: a store error, a missed deadline or an
open breaker is a bypass (the request is served as if there were no cache). The deadline, the
breaker and the outage's log lines are the runtime's one guarded call
(:mod:`sidecar_runtime.redis.shield`), as for the rate limiter's buckets. A dead or frozen
Redis costs one deadline per breaker cooldown, not one per request. Stores run in the background
after the answer has gone out; a store that fails or is skipped is counted and logged, never
raised and never silent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from extproc.actions import CacheWrite, Found
from extproc.cache.merge import outcome_of
from extproc.cache.metrics import CacheMetrics
from extproc.cache.redis_store import RedisVectorStore
from extproc.cache.store import MemoryVectorStore, VectorStore
from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.process.settings import Settings, redis_url_for_logs
from sidecar_runtime.redis.breaker import BreakerState
from sidecar_runtime.redis.client import make_client
from sidecar_runtime.redis.shield import BackendError, BreakerOpen, Shield, ready_within

log = get_logger("extproc.cache")

WARM_UP_KEY = "llm-sidecar:emb:v1:warm-up"
MAX_PENDING_STORES = 512
"""Background stores in flight at most; beyond it a store is dropped (and counted) rather than
letting a slow Redis grow memory without bound."""


class VectorCache:
    def __init__(self, store: VectorStore, lookup_timeout_s: float, store_timeout_s: float,
                 cooldown_s: float, metrics: CacheMetrics,
                 clock: Callable[[], float] = time.monotonic,
                 max_pending: int = MAX_PENDING_STORES, failures_to_open: int = 1) -> None:
        self.store = store
        self._lookup_timeout_s = lookup_timeout_s
        self._store_timeout_s = store_timeout_s
        self._metrics = metrics
        self._max_pending = max_pending
        self._pending: set[asyncio.Task[bool]] = set()
        self._guard = Shield(
            cooldown_s=cooldown_s, failures_to_open=failures_to_open, logger="extproc.cache",
            failed_event="embedding_cache_backend_failed",
            recovered_event="embedding_cache_backend_recovered",
            skip_detail="bypassing the cache",
            on_error=lambda op, reason: metrics.backend_errors.labels(op, reason).inc(),
            on_state=metrics.set_breaker, clock=clock)

    @property
    def breaker_state(self) -> BreakerState:
        return self._guard.state

    async def lookup(self, keys: Sequence[str]) -> Found:
        """The stored value of each key, or None (bypass) when the store cannot answer in time."""
        started = time.perf_counter()
        try:
            values = await self._guard.call(lambda: self.store.get_many(keys),
                                            self._lookup_timeout_s, "lookup")
        except BreakerOpen:
            self._bypass(len(keys))
            return None
        except BackendError:  # counted and logged by the guard; NodeDown included
            self._metrics.backend_latency.labels("lookup").observe(time.perf_counter() - started)
            self._bypass(len(keys))
            return None
        self._metrics.backend_latency.labels("lookup").observe(time.perf_counter() - started)
        found = tuple(values)
        self._metrics.lookups.labels(outcome_of(found)).inc()
        hits = sum(1 for value in found if value is not None)
        self._metrics.inputs.labels("hit").inc(hits)
        self._metrics.inputs.labels("miss").inc(len(found) - hits)
        return found

    async def connect(self) -> bool:
        """Open a connection (TCP, TLS, AUTH; on Cluster, the slot map) before the first request
        needs one, so the first lookup's deadline does not pay for it: :func:`ready_within`,
        for up to the store deadline. A store that is still down is not an error here: lookups
        bypass it until it answers."""
        error = await ready_within(lambda: self.store.get_many([WARM_UP_KEY]),
                                   self._store_timeout_s)
        if error is not None:
            log.warning("embedding_cache_backend_unreachable_at_start",
                        error=str(error) or "timeout")
        return error is None

    def store_later(self, write: CacheWrite) -> None:
        """Store in the background; the caller (about to answer Envoy) does not wait."""
        if not write.entries:
            return
        if len(self._pending) >= self._max_pending:
            self._metrics.backend_errors.labels("store", "backlog").inc()
            log.warning("embedding_cache_store_dropped", vectors=len(write.entries),
                        reason=f"{len(self._pending)} stores already in flight")
            return
        task = asyncio.create_task(self.store_now(write))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def store_now(self, write: CacheWrite) -> bool:
        """Store ``write``; True when it was stored. Skipped while the breaker is not closed:
        lookups probe a store that came back, so writes do not pile onto a dead one."""
        if self._guard.state is not BreakerState.CLOSED:
            self._metrics.backend_errors.labels("store", "breaker_open").inc()
            return False
        started = time.perf_counter()
        try:
            await self._guard.call(lambda: self.store.set_many(write.entries, write.ttl_s),
                                   self._store_timeout_s, "store")
        except BackendError:  # counted and logged by the guard
            return False
        finally:
            self._metrics.backend_latency.labels("store").observe(time.perf_counter() - started)
        self._metrics.stored.inc(len(write.entries))
        return True

    async def aclose(self, drain_s: float = 2.0) -> None:
        """Let background stores finish (up to ``drain_s``), then close the store."""
        if self._pending:
            _, late = await asyncio.wait(set(self._pending), timeout=drain_s)
            for task in late:
                task.cancel()
            if late:
                self._metrics.backend_errors.labels("store", "timeout").inc(len(late))
                log.warning("embedding_cache_stores_abandoned", stores=len(late))
        await self.store.aclose()

    def _bypass(self, inputs: int) -> None:
        self._metrics.lookups.labels("bypass").inc()
        self._metrics.inputs.labels("bypass").inc(inputs)


def open_vector_cache(settings: Settings, metrics: CacheMetrics) -> VectorCache:
    """Redis when ``redis_url`` is set (shared by every replica), else bounded process memory."""
    timeout_s = settings.redis_timeout_ms / 1000
    store: VectorStore
    if settings.redis_url is None:
        store = MemoryVectorStore(settings.cache_memory_bytes)
        log.info("embedding_cache_memory_store", max_bytes=settings.cache_memory_bytes,
                 detail="right for one replica; set LLM_SIDECAR_REDIS_URL to share vectors")
    else:
        client = make_client(settings.redis_url.get_secret_value(),
                             max(timeout_s, settings.cache_store_timeout_ms / 1000))
        store = RedisVectorStore(client)
        log.info("embedding_cache_redis_store", redis=redis_url_for_logs(settings.redis_url))
    return VectorCache(store, timeout_s, settings.cache_store_timeout_ms / 1000,
                       settings.redis_breaker_cooldown_ms / 1000, metrics,
                       failures_to_open=settings.redis_breaker_failures)
