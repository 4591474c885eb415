"""Where cached vectors live: the :class:`VectorStore` seam and its in-process memory backend.

Redis (shared by every replica) is :mod:`extproc.cache.redis_store`; memory is the default without a
Redis URL: right for one replica, wrong for several (each would compute and keep its own copy).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

ENTRY_OVERHEAD_BYTES = 96
"""What one entry costs beyond its key and value (dict slot, tuple, object headers): an estimate."""


class VectorStore(Protocol):
    """Stored vectors by key. Errors propagate; the guard in :mod:`extproc.cache.shielded` turns
    them (and missed deadlines) into a bypass."""

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value of each key (None where absent or expired), in one round trip."""
        ...

    async def set_many(self, entries: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        """Store every entry with a time to live, in one round trip."""
        ...

    async def aclose(self) -> None: ...


class MemoryVectorStore:
    """Least-recently-used entries in process memory, at most ``max_bytes`` (approximately:
    key + value + :data:`ENTRY_OVERHEAD_BYTES` each), each expiring after its TTL."""

    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _cost(key: str, value: bytes) -> int:
        return len(key) + len(value) + ENTRY_OVERHEAD_BYTES

    def _drop(self, key: str) -> None:
        value, _ = self._entries.pop(key)
        self.bytes -= self._cost(key, value)

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        now = self._clock()
        out: list[bytes | None] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                out.append(None)
            elif entry[1] <= now:
                self._drop(key)
                out.append(None)
            else:
                self._entries.move_to_end(key)
                out.append(entry[0])
        return out

    async def set_many(self, entries: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        expires = self._clock() + ttl_s
        for key, value in entries:
            if key in self._entries:
                self._drop(key)
            cost = self._cost(key, value)
            if cost > self.max_bytes:
                continue  # would evict everything and still not fit
            while self.bytes + cost > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._entries[key] = (value, expires)
            self.bytes += cost

    async def aclose(self) -> None:
        self._entries.clear()
        self.bytes = 0
