"""Admission order, cancellation, pacing and metrics bookkeeping of the simulated engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from simulator.config import SimConfig
from simulator.engine import Admission, Engine
from simulator.generation import SequencePlan
from simulator.metrics import SimMetrics
from tests.harness.waits import until


def _value(metrics: SimMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    assert value is not None, name
    return value


async def test_waiters_are_admitted_by_priority_then_arrival() -> None:
    admission = Admission(1, lambda: None)
    await admission.acquire(1, priority=0)
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await admission.acquire(1, priority)
        order.append(name)
        admission.release(1)

    tasks = [
        asyncio.create_task(wait(name, priority))
        for name, priority in [("low", 5), ("high", 0), ("mid", 2), ("high-later", 0)]
    ]
    await asyncio.sleep(0)
    assert (admission.running, admission.waiting) == (1, 4)
    admission.release(1)
    await asyncio.gather(*tasks)
    assert order == ["high", "high-later", "mid", "low"]
    assert (admission.running, admission.waiting) == (0, 0)


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    admission = Admission(1, lambda: None)
    await admission.acquire(1, priority=0)
    waiter = asyncio.create_task(admission.acquire(1, priority=0))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert admission.waiting == 0
    admission.release(1)
    assert admission.running == 0
    assert await admission.acquire(1, priority=0) == 1


async def test_a_request_larger_than_the_batch_takes_the_whole_batch() -> None:
    admission = Admission(2, lambda: None)
    assert await admission.acquire(5, priority=0) == 2
    assert admission.running == 2


async def test_tokens_are_paced_and_counted() -> None:
    metrics = SimMetrics("m")
    engine = Engine(SimConfig(name="p", decode_ms_per_token=20.0), metrics)
    plan = SequencePlan(4, ("a", " b", " c"), "length")
    start = time.monotonic()
    seen = []
    async for event in engine.run((plan,), priority=0):
        seen.append((event.token, event.text, event.finish_reason, time.monotonic() - start))
    assert [s[:3] for s in seen] == [(0, "a", None), (1, " b", None), (2, " c", "length")]
    assert seen[0][3] >= 0.015
    assert seen[2][3] >= 0.055
    assert _value(metrics, "vllm:generation_tokens_total") == 3
    assert _value(metrics, "vllm:prompt_tokens_total") == 4
    assert _value(metrics, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(metrics, "vllm:time_per_output_token_seconds_count") == 2
    assert _value(metrics, "vllm:num_requests_running") == 0
    assert _value(metrics, "vllm:kv_cache_usage_perc") == 0


async def test_closing_early_counts_an_abort_and_frees_everything() -> None:
    metrics = SimMetrics("m")
    config = SimConfig(name="p", max_model_len=100, decode_ms_per_token=1.0, kv_cache_tokens=100)
    engine = Engine(config, metrics)
    events = engine.run((SequencePlan(40, ("a", " b", " c"), "length"),), priority=0)
    await anext(events)
    assert _value(metrics, "vllm:num_requests_running") == 1
    # The prompt and the whole output budget are held from admission: (40 + 3) / 100.
    assert _value(metrics, "vllm:kv_cache_usage_perc") == pytest.approx(0.43)
    await events.aclose()
    assert _value(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert _value(metrics, "vllm:num_requests_running") == 0
    assert _value(metrics, "vllm:kv_cache_usage_perc") == 0


async def test_stop_fast_forwards_in_flight_generation() -> None:
    """Paced, the 8 tokens take 8 minutes; stopped, they all come at once. The 60 s bound is
    for a broken engine, not a speed figure."""
    engine = Engine(SimConfig(name="p", decode_ms_per_token=60_000.0), SimMetrics("m"))
    plan = SequencePlan(1, tuple("abcdefgh"), "length")

    async def drain() -> int:
        return len([event async for event in engine.run((plan,), priority=0)])

    task = asyncio.create_task(drain())
    await until(lambda: engine.admission.running == 1, timeout_s=10, what="the run to start")
    engine.stop()
    assert await asyncio.wait_for(task, 60) == 8
