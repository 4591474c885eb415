"""The simulated engine: admission to a bounded batch, paced token production, and the metrics.

Like vLLM with ``--scheduling-policy priority``, at most ``max_num_seqs`` sequences run at once;
the rest wait, lowest ``priority`` value first, then in arrival order. A request with several
prompts (a batched text completion) runs one sequence per prompt, as vLLM does.

Pacing uses the event loop's clock and never blocks it. After ``stop()`` every wait returns at
once, so in-flight responses finish within moments when the server shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from simulator.config import SimConfig
from simulator.generation import SequencePlan, timeline
from simulator.metrics import SimMetrics


@dataclass(frozen=True)
class TokenEvent:
    """Sequence ``seq`` produced token ``token`` (text ``text``); ``finish_reason`` on its last."""

    seq: int
    token: int
    text: str
    finish_reason: str | None


class Admission:
    """Slots for at most ``capacity`` running sequences, granted by (priority, arrival)."""

    def __init__(self, capacity: int, on_change: Callable[[], None]) -> None:
        self.capacity = capacity
        self.running = 0
        self.waiting = 0
        self._on_change = on_change
        self._queue: list[tuple[int, int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    async def acquire(self, sequences: int, priority: int) -> int:
        """Wait for room for ``sequences`` sequences; returns the weight to ``release``.

        A request larger than the whole batch takes the whole batch rather than waiting forever.
        """
        weight = min(sequences, self.capacity)
        if not self._queue and self.running + weight <= self.capacity:
            self.running += weight
            self._on_change()
            return weight
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (priority, next(self._arrivals), weight, granted))
        self.waiting += weight
        self._on_change()
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(weight)  # granted in the same tick we were cancelled
            else:
                self.waiting -= weight  # its queue entry is skipped when it surfaces
                self._grant()
            raise
        return weight

    def release(self, weight: int) -> None:
        """Give back the slots of a finished request."""
        self.running -= weight
        self._grant()

    def _grant(self) -> None:
        while self._queue:
            _, _, weight, granted = self._queue[0]
            if granted.done():
                heapq.heappop(self._queue)
                continue
            if self.running + weight > self.capacity:
                break
            heapq.heappop(self._queue)
            self.waiting -= weight
            self.running += weight
            granted.set_result(None)
        self._on_change()


class Engine:
    """Runs planned sequences at the configured pace and keeps the metrics current."""

    def __init__(self, config: SimConfig, metrics: SimMetrics) -> None:
        self._prefill = config.prefill_ms_per_token / 1000.0
        self._decode = config.decode_ms_per_token / 1000.0
        self._kv_capacity = config.kv_capacity
        self._metrics = metrics
        self._live_tokens = 0
        self._stopping = asyncio.Event()
        self.admission = Admission(config.max_num_seqs, self._publish_load)
        self._publish_load()

    def stop(self) -> None:
        """Stop pacing: every in-flight and later request produces its tokens without delay."""
        self._stopping.set()

    async def run(self, plans: tuple[SequencePlan, ...], priority: int) -> AsyncGenerator[TokenEvent, None]:
        """Yield every token of ``plans`` when it is produced; sequences without tokens
        (embeddings) only take their prefill time. Closing the iterator early aborts the rest.
        """
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        weight = await self.admission.acquire(len(plans), priority)
        start = loop.time()
        held = sum(plan.prompt_tokens for plan in plans)
        self._add_live(held)
        last_token_at: dict[int, float] = {}
        done: set[int] = set()
        try:
            for step in timeline(plans, self._prefill, self._decode):
                await self._until(start + step.at)
                now = loop.time()
                plan = plans[step.seq]
                if step.token <= 0:
                    self._metrics.first_token(now - arrival, plan.prompt_tokens)
                if step.token < 0:
                    done.add(step.seq)
                    self._metrics.finished("stop", now - arrival)
                    continue
                self._metrics.token(now - last_token_at[step.seq] if step.seq in last_token_at else None)
                last_token_at[step.seq] = now
                held += 1
                self._add_live(1)
                last = step.token == len(plan.pieces) - 1
                if last:
                    done.add(step.seq)
                    self._metrics.finished(plan.finish_reason, now - arrival)
                reason = plan.finish_reason if last else None
                yield TokenEvent(step.seq, step.token, plan.pieces[step.token], reason)
        finally:
            now = loop.time()
            for seq in range(len(plans)):
                if seq not in done:
                    self._metrics.finished("abort", now - arrival)
            self._add_live(-held)
            self.admission.release(weight)

    async def _until(self, deadline: float) -> None:
        delay = deadline - asyncio.get_running_loop().time()
        if delay <= 0 or self._stopping.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)

    def _add_live(self, tokens: int) -> None:
        self._live_tokens += tokens
        self._publish_load()

    def _publish_load(self) -> None:
        usage = min(1.0, self._live_tokens / self._kv_capacity)
        self._metrics.set_load(self.admission.running, self.admission.waiting, usage)
