"""Admission to the running batch: a slot per sequence and KV-cache room per token.

A request asks for ``sequences`` slots (at most ``max_num_seqs`` run at once) and ``kv_tokens`` of
KV cache: every sequence's prompt plus its whole output budget, reserved up front. vLLM allocates
KV blocks as tokens are produced and preempts when the cache runs out; reserving the budget gives
the same outward behaviour (new requests queue while the cache is full, and
``vllm:kv_cache_usage_perc`` is near 1 exactly when they do) without modelling preemption.

Waiters are granted by (priority, arrival), head of the line first: like vLLM's scheduler, a small
request never overtakes a waiting large one. A request larger than the whole batch or the whole
cache is clamped to it, so it runs alone rather than waiting forever.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Need:
    """What one request holds while it runs: batch slots and KV-cache tokens."""

    sequences: int
    kv_tokens: int


def clamp(need: Need, max_sequences: int, kv_capacity: int) -> Need:
    """``need`` cut to the whole batch and the whole cache, so it can always run alone."""
    return Need(min(need.sequences, max_sequences), min(need.kv_tokens, kv_capacity))


def fits(held: Need, need: Need, max_sequences: int, kv_capacity: int) -> bool:
    """Whether ``need`` (already clamped) can start beside what running requests ``held``."""
    return (
        held.sequences + need.sequences <= max_sequences
        and held.kv_tokens + need.kv_tokens <= kv_capacity
    )


class Admission:
    """Slots for at most ``capacity`` running sequences and ``kv_capacity`` KV tokens
    (by default KV room is never the limit, only the batch is)."""

    def __init__(
        self, capacity: int, on_change: Callable[[], None], kv_capacity: int = sys.maxsize
    ) -> None:
        self.capacity = capacity
        self.kv_capacity = kv_capacity
        self.running = 0
        self.waiting = 0
        self.peak_waiting = 0
        """The most sequences ever waiting at once (how far a gateway overfilled the pod)."""
        self.kv_used = 0
        self._on_change = on_change
        self._queue: list[tuple[int, int, Need, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    def _clamp(self, sequences: int, kv_tokens: int) -> Need:
        return clamp(Need(sequences, kv_tokens), self.capacity, self.kv_capacity)

    def _fits(self, need: Need) -> bool:
        return fits(Need(self.running, self.kv_used), need, self.capacity, self.kv_capacity)

    async def acquire(self, sequences: int, priority: int, kv_tokens: int = 0) -> int:
        """Wait for room for ``sequences`` sequences holding ``kv_tokens`` KV tokens.

        Returns the slot weight; give it back with ``release(weight, kv_tokens)`` (the same
        ``kv_tokens`` as asked).
        """
        need = self._clamp(sequences, kv_tokens)
        if not self._queue and self._fits(need):
            self._take(need)
            self._on_change()
            return need.sequences
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (priority, next(self._arrivals), need, granted))
        self.waiting += need.sequences
        if self.waiting > self.peak_waiting:
            self.peak_waiting = self.waiting
        self._on_change()
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(need.sequences, kv_tokens)  # granted in the same tick we were cancelled
            else:
                self.waiting -= need.sequences  # its queue entry is skipped when it surfaces
                self._grant()
            raise
        return need.sequences

    def release(self, weight: int, kv_tokens: int = 0) -> None:
        """Give back what a finished request held."""
        need = self._clamp(weight, kv_tokens)
        self.running -= need.sequences
        self.kv_used -= need.kv_tokens
        self._grant()

    def _take(self, need: Need) -> None:
        self.running += need.sequences
        self.kv_used += need.kv_tokens

    def _grant(self) -> None:
        while self._queue:
            _, _, need, granted = self._queue[0]
            if granted.done():
                heapq.heappop(self._queue)
                continue
            if not self._fits(need):
                break
            heapq.heappop(self._queue)
            self.waiting -= need.sequences
            self._take(need)
            granted.set_result(None)
        self._on_change()
