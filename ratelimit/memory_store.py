"""In-process bucket store: right for one replica, wrong for several (each keeps its own)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ratelimit.bucket import BucketState, Hit, decide, idle_ttl_s
from ratelimit.store import StoreResult

_SWEEP_EVERY = 1024


class MemoryStore:
    """Buckets in a dict, decided with :func:`ratelimit.bucket.decide`.

    ``decide`` never awaits while it reads and writes, so concurrent asyncio tasks cannot
    interleave inside one decision. Idle buckets (full again, plus ``margin_s``) are dropped
    by a sweep every ``_SWEEP_EVERY`` decisions.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, margin_s: float = 1.0) -> None:
        self._clock = clock
        self._margin_s = margin_s
        self._buckets: dict[str, tuple[BucketState, float]] = {}
        self._since_sweep = 0

    async def decide(self, hits: Sequence[Hit]) -> StoreResult:
        now = self._clock()
        states: dict[str, BucketState | None] = {}
        for hit in hits:
            held = self._buckets.get(hit.key)
            states[hit.key] = held[0] if held is not None and held[1] > now else None
        decision = decide(states, hits, now)
        specs = {hit.key: hit.spec for hit in hits}
        for key, state in decision.writes.items():
            expires = now + idle_ttl_s(specs[key], state.level, self._margin_s)
            self._buckets[key] = (state, expires)
        self._since_sweep += 1
        if self._since_sweep >= _SWEEP_EVERY:
            self.sweep()
        return StoreResult(decision.admitted, decision.results)

    def sweep(self) -> None:
        """Drop every bucket whose state has expired."""
        now = self._clock()
        self._since_sweep = 0
        for key in [key for key, (_, expires) in self._buckets.items() if expires <= now]:
            del self._buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)

    async def aclose(self) -> None:
        self._buckets.clear()
