"""The simulated engine: admission to a bounded batch, paced token production, and the metrics.

Like vLLM with ``--scheduling-policy priority``, at most ``max_num_seqs`` sequences run at once
and their KV cache (prompt plus output budget each) must fit ``kv_cache_tokens``; the rest wait,
lowest ``priority`` value first, then in arrival order (``simulator.admission``). A request with
several prompts (a batched text completion) runs one sequence per prompt, as vLLM does.

When a sequence is admitted its prompt is looked up in the prefix cache (``simulator.prefix``;
its blocks are hashed under the request's ``cache_salt``, if any): the cached part skips
prefill. Its blocks are remembered once its prefill is done. Prefill and decode times are
divided by the pod's ``speed``.

Pacing uses the event loop's clock and never blocks it. After ``stop()`` every wait returns at
once, so in-flight responses finish within moments when the server shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from simulator.admission import Admission
from simulator.config import SimConfig
from simulator.generation import SequencePlan, timeline
from simulator.metrics import SimMetrics
from simulator.prefix import PrefixCache, usable_blocks

__all__ = ["Admission", "Engine", "TokenEvent"]


@dataclass(frozen=True)
class TokenEvent:
    """Sequence ``seq`` produced token ``token`` (text ``text``); ``finish_reason`` on its last."""

    seq: int
    token: int
    text: str
    finish_reason: str | None


class Engine:
    """Runs planned sequences at the configured pace and keeps the metrics current."""

    def __init__(self, config: SimConfig, metrics: SimMetrics) -> None:
        self._prefill = config.prefill_ms_per_token / 1000.0 / config.speed
        self._decode = config.decode_ms_per_token / 1000.0 / config.speed
        self._kv_capacity = config.kv_capacity
        self._block_size = config.prefix_block_size
        self._metrics = metrics
        self._stopping = asyncio.Event()
        self.prefix_cache = PrefixCache(config.prefix_cache_blocks)
        self.admission = Admission(config.max_num_seqs, self._publish_load, config.kv_capacity)
        self._publish_load()

    @property
    def kv_usage(self) -> float:
        """Share of the KV cache the running sequences hold, 0 to 1."""
        return min(1.0, self.admission.kv_used / self._kv_capacity)

    def stop(self) -> None:
        """Stop pacing: every in-flight and later request produces its tokens without delay."""
        self._stopping.set()

    async def run(self, plans: tuple[SequencePlan, ...], priority: int) -> AsyncGenerator[TokenEvent, None]:
        """Yield every token of ``plans`` when it is produced; sequences without tokens
        (embeddings) only take their prefill time. Closing the iterator early aborts the rest.
        """
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        kv_tokens = sum(plan.kv_tokens for plan in plans)
        weight = await self.admission.acquire(len(plans), priority, kv_tokens)
        start = loop.time()
        last_token_at: dict[int, float] = {}
        done: set[int] = set()
        try:
            cached = tuple(self._look_up(plan) for plan in plans)
            for step in timeline(plans, self._prefill, self._decode, cached):
                await self._until(start + step.at)
                now = loop.time()
                plan = plans[step.seq]
                if step.token <= 0:
                    self._metrics.first_token(now - arrival, plan.prompt_tokens)
                    if plan.prefix_blocks:
                        self.prefix_cache.remember(plan.prefix_blocks)
                if step.token < 0:
                    done.add(step.seq)
                    self._metrics.finished("stop", now - arrival)
                    continue
                self._metrics.token(now - last_token_at[step.seq] if step.seq in last_token_at else None)
                last_token_at[step.seq] = now
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
            self.admission.release(weight, kv_tokens)

    async def _until(self, deadline: float) -> None:
        delay = deadline - asyncio.get_running_loop().time()
        if delay <= 0 or self._stopping.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)

    def _look_up(self, plan: SequencePlan) -> int:
        """Prompt tokens of ``plan`` the prefix cache supplies; counts the query."""
        if plan.prefix_blocks is None:
            return 0
        limit = usable_blocks(plan.prompt_tokens, self._block_size)
        hit = self.prefix_cache.lookup(plan.prefix_blocks, limit) * self._block_size
        self._metrics.prefix_query(plan.prompt_tokens, hit)
        return hit

    def _publish_load(self) -> None:
        self._metrics.set_load(self.admission.running, self.admission.waiting, self.kv_usage)
