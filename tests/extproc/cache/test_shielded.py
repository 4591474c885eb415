"""The cache's deadline, breaker, background stores and metrics, around a store that misbehaves."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from extproc.actions import CacheWrite
from extproc.cache.metrics import CacheMetrics
from extproc.cache.shielded import VectorCache
from extproc.cache.store import MemoryVectorStore
from extproc.errors import BackendError, NodeDown
from sidecar_runtime.redis.breaker import BreakerState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FlakyStore(MemoryVectorStore):
    """Memory, unless told to hang or fail."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.mode = "ok"
        self.calls = 0

    async def _trouble(self) -> None:
        self.calls += 1
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "fail":
            raise BackendError("redis: ConnectionError: refused")
        if self.mode == "node_down":
            raise NodeDown("redis: redis cluster node 127.0.0.1:7001 is down")

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        await self._trouble()
        return await super().get_many(keys)

    async def set_many(self, entries: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        await self._trouble()
        await super().set_many(entries, ttl_s)


def breaker_of(cache: VectorCache) -> BreakerState:
    return cache.breaker_state  # read through a call: mypy must not narrow across awaits


def made(store: FlakyStore, clock: Clock) -> tuple[VectorCache, CacheMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = CacheMetrics(registry)
    return VectorCache(store, 0.02, 0.05, cooldown_s=1.0, metrics=metrics, clock=clock), \
        metrics, registry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_lookups_count_hits_partials_and_misses() -> None:
    store, clock = FlakyStore(), Clock()
    cache, _, registry = made(store, clock)
    assert await cache.store_now(CacheWrite((("a", b"fA"),), 60))
    assert await cache.lookup(["a"]) == (b"fA",)
    assert await cache.lookup(["a", "b"]) == (b"fA", None)
    assert await cache.lookup(["b"]) == (None,)
    lookups = "llm_sidecar_cache_lookups_total"
    assert [sample(registry, lookups, result=r) for r in ("hit", "partial", "miss", "bypass")] \
        == [1, 1, 1, 0]
    inputs = "llm_sidecar_cache_inputs_total"
    assert sample(registry, inputs, result="hit") == 2 and sample(registry, inputs, result="miss") == 2
    assert sample(registry, "llm_sidecar_cache_stored_vectors_total") == 1


async def test_a_frozen_store_costs_one_deadline_then_the_breaker_skips_it() -> None:
    store, clock = FlakyStore(), Clock()
    cache, _, registry = made(store, clock)
    store.mode = "hang"
    started = asyncio.get_running_loop().time()
    assert await cache.lookup(["a"]) is None
    assert asyncio.get_running_loop().time() - started < 0.5
    assert breaker_of(cache) is BreakerState.OPEN
    for _ in range(5):
        assert await cache.lookup(["a", "b"]) is None
    assert store.calls == 1  # skipped while open
    errors = "llm_sidecar_cache_backend_errors_total"
    assert sample(registry, errors, op="lookup", reason="timeout") == 1
    assert sample(registry, errors, op="lookup", reason="breaker_open") == 5
    assert sample(registry, "llm_sidecar_cache_lookups_total", result="bypass") == 6
    assert sample(registry, "llm_sidecar_cache_inputs_total", result="bypass") == 11
    assert sample(registry, "llm_sidecar_cache_breaker_state") == 1
    # Writes are not piled onto a store the breaker has given up on, and say so.
    assert not await cache.store_now(CacheWrite((("a", b"fA"),), 60))
    assert sample(registry, errors, op="store", reason="breaker_open") == 1
    # After the cooldown one probe goes through; a healthy store closes the breaker.
    store.mode = "ok"
    clock.now += 1.0
    assert await cache.lookup(["a"]) == (None,)
    assert breaker_of(cache) is BreakerState.CLOSED
    assert sample(registry, "llm_sidecar_cache_breaker_state") == 0


async def test_a_failing_store_is_a_bypass_never_an_exception() -> None:
    store, clock = FlakyStore(), Clock()
    cache, _, registry = made(store, clock)
    store.mode = "fail"
    assert await cache.lookup(["a"]) is None
    assert sample(registry, "llm_sidecar_cache_backend_errors_total",
                  op="lookup", reason="error") == 1


async def test_failed_background_stores_are_counted_and_open_the_breaker() -> None:
    store, clock = FlakyStore(), Clock()
    cache, _, registry = made(store, clock)
    store.mode = "fail"
    cache.store_later(CacheWrite((("a", b"fA"),), 60))
    await cache.aclose()  # drains the background store
    assert sample(registry, "llm_sidecar_cache_backend_errors_total",
                  op="store", reason="error") == 1
    assert breaker_of(cache) is BreakerState.OPEN


async def test_a_slow_store_write_times_out_on_its_own_deadline() -> None:
    store, clock = FlakyStore(), Clock()
    cache, _, registry = made(store, clock)
    store.mode = "hang"
    assert not await cache.store_now(CacheWrite((("a", b"fA"),), 60))
    assert sample(registry, "llm_sidecar_cache_backend_errors_total",
                  op="store", reason="timeout") == 1


async def test_stores_beyond_the_backlog_are_dropped_and_counted() -> None:
    store, clock = FlakyStore(), Clock()
    registry = CollectorRegistry()
    cache = VectorCache(store, 0.02, 5.0, 1.0, CacheMetrics(registry), clock, max_pending=2)
    store.mode = "hang"
    for n in range(4):
        cache.store_later(CacheWrite(((f"k{n}", b"f"),), 60))
    assert sample(registry, "llm_sidecar_cache_backend_errors_total",
                  op="store", reason="backlog") == 2
    await cache.aclose(drain_s=0.01)  # the two hanging ones are abandoned, and counted
    assert sample(registry, "llm_sidecar_cache_backend_errors_total",
                  op="store", reason="timeout") == 2


async def test_empty_writes_are_not_sent() -> None:
    store, clock = FlakyStore(), Clock()
    cache, _, _ = made(store, clock)
    cache.store_later(CacheWrite((), 60))
    await cache.aclose()
    assert store.calls == 0


async def test_connect_warms_the_store_and_tolerates_a_dead_one() -> None:
    store, clock = FlakyStore(), Clock()
    cache, _, registry = made(store, clock)
    assert await cache.connect() and store.calls == 1
    store.mode = "fail"
    assert not await cache.connect()
    # Not a lookup: no lookup metric, and the breaker is left to real traffic.
    assert sample(registry, "llm_sidecar_cache_lookups_total", result="bypass") == 0
    assert breaker_of(cache) is BreakerState.CLOSED


async def test_a_dead_cluster_master_is_a_bypass_that_leaves_the_breaker_closed() -> None:
    """Lookups touching its keys bypass; the cache stays in use for the others."""
    store, clock = FlakyStore(), Clock()
    cache, _, registry = made(store, clock)
    store.mode = "node_down"
    for _ in range(5):
        assert await cache.lookup(["a"]) is None
    assert not await cache.store_now(CacheWrite((("a", b"fA"),), 60))
    assert breaker_of(cache) is BreakerState.CLOSED
    errors = "llm_sidecar_cache_backend_errors_total"
    assert sample(registry, errors, op="lookup", reason="node_down") == 5
    assert sample(registry, errors, op="store", reason="node_down") == 1
    assert sample(registry, "llm_sidecar_cache_lookups_total", result="bypass") == 5
    store.mode = "ok"
    assert await cache.lookup(["a"]) == (None,)
