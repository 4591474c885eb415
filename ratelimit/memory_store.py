"""In-process bucket store: right for one replica, wrong for several (each keeps its own)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ratelimit.bucket import BucketState, Hit, Settle, decide, idle_ttl_s, refill, settled_level
from ratelimit.store import LEASE_TTL_S, StoreResult

_SWEEP_EVERY = 1024


class MemoryStore:
    """Buckets in a dict, decided with :func:`ratelimit.bucket.decide`.

    ``decide`` never awaits while it reads and writes, so concurrent asyncio tasks cannot
    interleave inside one decision. Idle buckets (full again, plus ``margin_s``) and expired
    leases are dropped by a sweep every ``_SWEEP_EVERY`` decisions.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, margin_s: float = 1.0,
                 lease_ttl_s: float = LEASE_TTL_S) -> None:
        self._clock = clock
        self._margin_s = margin_s
        self._lease_ttl_s = lease_ttl_s
        self._buckets: dict[str, tuple[BucketState, float]] = {}
        self._slots: dict[str, dict[str, float]] = {}
        """Concurrency bucket -> lease -> expiry."""
        self._reserved: dict[tuple[str, str], tuple[float, float]] = {}
        """(token bucket, lease) -> (tokens reserved, expiry)."""
        self._since_sweep = 0

    def _live_slots(self, key: str, now: float) -> dict[str, float]:
        held = self._slots.get(key, {})
        for lease in [lease for lease, expires in held.items() if expires <= now]:
            del held[lease]
        return held

    def _state(self, key: str, now: float) -> BucketState | None:
        held = self._buckets.get(key)
        return held[0] if held is not None and held[1] > now else None

    def _write(self, key: str, hit_spec: Hit | Settle, state: BucketState, now: float) -> None:
        expires = now + idle_ttl_s(hit_spec.spec, state.level, self._margin_s)
        self._buckets[key] = (state, expires)

    async def decide(self, hits: Sequence[Hit]) -> StoreResult:
        now = self._clock()
        states: dict[str, BucketState | None] = {}
        for hit in hits:
            if hit.spec.concurrent:
                free = hit.spec.capacity - len(self._live_slots(hit.key, now))
                states[hit.key] = BucketState(free, now)
            else:
                states[hit.key] = self._state(hit.key, now)
        decision = decide(states, hits, now)
        by_key = {hit.key: hit for hit in hits}
        for key, state in decision.writes.items():
            if not by_key[key].spec.concurrent:
                self._write(key, by_key[key], state, now)
        if decision.admitted:
            expires = now + self._lease_ttl_s
            for hit, result in zip(hits, decision.results, strict=True):
                if hit.lease is None or not result.admitted:
                    continue
                if hit.spec.concurrent:
                    self._slots.setdefault(hit.key, {})[hit.lease] = expires
                elif hit.hits > 0:
                    held = self._reserved.get((hit.key, hit.lease), (0.0, expires))[0]
                    self._reserved[(hit.key, hit.lease)] = (held + hit.hits, expires)
        self._since_sweep += 1
        if self._since_sweep >= _SWEEP_EVERY:
            self.sweep()
        return StoreResult(decision.admitted, decision.results)

    async def settle(self, settles: Sequence[Settle]) -> None:
        now = self._clock()
        for item in settles:
            if item.used is None:
                self._slots.get(item.key, {}).pop(item.lease, None)
                continue
            reserved = self._reserved.pop((item.key, item.lease), None)
            if reserved is None or reserved[1] <= now:
                continue
            level = refill(self._state(item.key, now), item.spec, now)
            new = settled_level(level, item.spec, reserved[0], item.used)
            if new != level:
                self._write(item.key, item, BucketState(new, now), now)

    def sweep(self) -> None:
        """Drop every bucket and lease that has expired."""
        now = self._clock()
        self._since_sweep = 0
        for key in [key for key, (_, expires) in self._buckets.items() if expires <= now]:
            del self._buckets[key]
        for key in list(self._slots):
            if not self._live_slots(key, now):
                del self._slots[key]
        for pair in [pair for pair, (_, expires) in self._reserved.items() if expires <= now]:
            del self._reserved[pair]

    def __len__(self) -> int:
        return len(self._buckets)

    async def connect(self) -> None:
        return None

    async def aclose(self) -> None:
        self._buckets.clear()
        self._slots.clear()
        self._reserved.clear()
