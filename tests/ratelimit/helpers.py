"""Small builders shared by the ratelimit unit tests."""

from __future__ import annotations

from collections.abc import Sequence

from ratelimit.descriptors import RateLimitConfig
from ratelimit.limiter import DescriptorRequest, Limiter, LimitOutcome, LimitRequest
from ratelimit.memory_store import MemoryStore
from ratelimit.metrics import RateLimitMetrics

Entries = Sequence[tuple[str, str]]


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Decider:
    """A limiter over a memory store on a fake clock."""

    def __init__(self, config: RateLimitConfig) -> None:
        self.config = config
        self.clock = FakeClock()
        self.store = MemoryStore(clock=self.clock)
        self.metrics = RateLimitMetrics()
        self.limiter = Limiter(lambda: self.config, self.store, self.metrics)

    async def check(
        self,
        domain: str,
        *descriptors: Entries,
        hits_addend: int = 0,
        hits: int | None = None,
    ) -> LimitOutcome:
        request = LimitRequest(
            domain,
            tuple(DescriptorRequest(tuple(d), hits) for d in descriptors),
            hits_addend,
        )
        return await self.limiter.check(request)

    async def admitted(self, domain: str, *descriptors: Entries, times: int) -> int:
        """How many of ``times`` identical requests (at one instant) were admitted."""
        count = 0
        for _ in range(times):
            if (await self.check(domain, *descriptors)).ok:
                count += 1
        return count
