"""KV-cache admission: who fits, who waits, and that nothing waits forever."""

from __future__ import annotations

import asyncio

import pytest

from simulator.admission import Admission, Need, clamp, fits
from simulator.generation import SequencePlan


@pytest.mark.parametrize(
    ("held", "need", "expected"),
    [
        (Need(0, 0), Need(1, 100), True),  # an empty pod takes a request that fills the cache
        (Need(1, 60), Need(1, 40), True),  # exactly full is allowed
        (Need(1, 60), Need(1, 41), False),  # one token over the cache waits
        (Need(3, 0), Need(1, 1), True),
        (Need(4, 0), Need(1, 1), False),  # the batch is full even with room in the cache
        (Need(3, 99), Need(2, 1), False),  # both limits are checked
    ],
)
def test_fits_checks_batch_and_kv(held: Need, need: Need, expected: bool) -> None:
    assert fits(held, need, max_sequences=4, kv_capacity=100) is expected


@pytest.mark.parametrize(
    ("need", "expected"),
    [
        (Need(1, 50), Need(1, 50)),
        (Need(9, 50), Need(4, 50)),  # more sequences than the batch: takes the whole batch
        (Need(1, 250), Need(1, 100)),  # bigger than the cache: takes the whole cache
    ],
)
def test_clamp_lets_an_oversized_request_run_alone(need: Need, expected: Need) -> None:
    assert clamp(need, max_sequences=4, kv_capacity=100) == expected
    assert fits(Need(0, 0), clamp(need, 4, 100), 4, 100)


def test_kv_need_is_prompt_plus_output_budget() -> None:
    assert SequencePlan(40, ("a", " b", " c"), "length").kv_tokens == 43
    assert SequencePlan(7, (), "stop").kv_tokens == 7  # an embedding holds only its input


async def test_a_request_waits_while_the_kv_cache_is_full() -> None:
    admission = Admission(8, lambda: None, kv_capacity=100)
    await admission.acquire(1, priority=0, kv_tokens=70)
    assert admission.kv_used == 70
    waiter = asyncio.create_task(admission.acquire(1, priority=0, kv_tokens=40))
    await asyncio.sleep(0)
    assert (admission.running, admission.waiting, waiter.done()) == (1, 1, False)
    admission.release(1, kv_tokens=70)
    assert await waiter == 1
    assert (admission.running, admission.waiting, admission.kv_used) == (1, 0, 40)


async def test_head_of_line_is_not_overtaken_by_a_smaller_request() -> None:
    """vLLM's scheduler stops at the first waiting request that does not fit."""
    admission = Admission(8, lambda: None, kv_capacity=100)
    await admission.acquire(1, priority=0, kv_tokens=60)
    order: list[str] = []

    async def run(name: str, kv: int) -> None:
        await admission.acquire(1, priority=0, kv_tokens=kv)
        order.append(name)

    big = asyncio.create_task(run("big", 90))
    await asyncio.sleep(0)
    small = asyncio.create_task(run("small", 10))  # would fit now, but big is ahead
    await asyncio.sleep(0)
    assert order == [] and admission.waiting == 2
    admission.release(1, kv_tokens=60)
    await asyncio.gather(big, small)
    assert order == ["big", "small"]
    assert admission.kv_used == 100


async def test_a_request_bigger_than_the_cache_runs_alone_then_frees_it() -> None:
    admission = Admission(8, lambda: None, kv_capacity=100)
    assert await admission.acquire(1, priority=0, kv_tokens=250) == 1
    assert admission.kv_used == 100
    waiter = asyncio.create_task(admission.acquire(1, priority=0, kv_tokens=1))
    await asyncio.sleep(0)
    assert not waiter.done()
    admission.release(1, kv_tokens=250)
    await waiter
    assert admission.kv_used == 1


async def test_a_cancelled_kv_waiter_leaves_the_queue_and_holds_nothing() -> None:
    admission = Admission(8, lambda: None, kv_capacity=100)
    await admission.acquire(1, priority=0, kv_tokens=100)
    waiter = asyncio.create_task(admission.acquire(1, priority=0, kv_tokens=50))
    behind = asyncio.create_task(admission.acquire(1, priority=1, kv_tokens=50))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert admission.waiting == 1
    admission.release(1, kv_tokens=100)
    await behind
    assert (admission.running, admission.waiting, admission.kv_used) == (1, 0, 50)
