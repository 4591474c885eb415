"""The ``BucketStore`` seam: one async call decides a whole request against shared buckets.

Two implementations sit behind it: :class:`ratelimit.memory_store.MemoryStore` (one process)
and :class:`ratelimit.redis_store.RedisStore` (shared by every replica, standalone or
Cluster). Both implement :func:`ratelimit.bucket.decide` exactly; ``tests/integration``
runs one suite over all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from ratelimit.bucket import BucketResult, Hit, Settle

LEASE_TTL_S = 600.0
"""How long a lease outlives its admission when the stream-done call never comes (Envoy
killed mid-request): its reservation then stands, and its concurrency slot frees itself. A
request running longer than this loses its slot early (and, settling late, its refund)."""


class StoreResult(NamedTuple):
    admitted: bool
    results: tuple[BucketResult, ...]
    """One per hit, in request order."""


class BucketStore(Protocol):
    async def connect(self) -> None:
        """Get ready for the first decision before it comes (connections, scripts); raise on
        backend trouble."""
        ...

    async def decide(self, hits: Sequence[Hit]) -> StoreResult:
        """Decide and apply ``hits`` all or nothing; raise on backend trouble."""
        ...

    async def settle(self, settles: Sequence[Settle]) -> None:
        """Apply the end of admitted requests: each lease's reservation once (a second settle
        of the same lease, or one whose lease expired, changes nothing), slots released."""
        ...

    async def aclose(self) -> None:
        """Release connections; the store is not used afterwards."""
        ...
