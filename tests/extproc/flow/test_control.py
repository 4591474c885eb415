"""The waiting line run on the event loop: released when room appears, picked at release,
refused after ``max_wait`` or for ``max_queue``, left by a client that hangs up."""

from __future__ import annotations

import asyncio
from typing import Literal

from prometheus_client import CollectorRegistry

from extproc.actions import Hold, Step, Waited
from extproc.flow.control import FlowControl
from extproc.flow.metrics import FlowMetrics

POOL = "pool"


class Pool:
    """Slots a fake pool has free; each pick takes one."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.picked: list[str] = []

    def room(self, cluster: str) -> bool:
        return self.free > 0

    def pick(self, name: str) -> tuple[str, ...]:
        self.free -= 1
        self.picked.append(name)
        return (f"pod-for-{name}",)


def hold(pool: Pool, name: str, priority: str = "low", tenant: str = "t",
         max_wait_s: float = 30.0, max_queue: int = 100,
         fairness: Literal["tenant", "none"] = "tenant") -> Hold:
    def resume(waited: Waited) -> Step:
        raise AssertionError("the stream resumes, not the queue")
    return Hold(POOL, priority, tenant, 10, max_wait_s, max_queue, 10**6, fairness,
                pick=lambda: pool.pick(name), resume=resume)


def control(pool: Pool) -> tuple[FlowControl, CollectorRegistry]:
    registry = CollectorRegistry()
    loop = asyncio.get_running_loop()
    return FlowControl(pool.room, FlowMetrics(registry), loop.time), registry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"cluster": POOL, **labels})
    return 0.0 if value is None else value


async def settled() -> None:
    for _ in range(3):  # done callbacks run a loop turn after the change
        await asyncio.sleep(0)


async def test_a_request_waits_until_room_appears_and_is_picked_then() -> None:
    pool = Pool(free=0)
    flow, registry = control(pool)
    assert flow.must_wait(POOL)
    waiting = asyncio.create_task(flow.wait(hold(pool, "a")))
    await settled()
    assert not waiting.done() and pool.picked == []  # nothing picked while it waits
    assert sample(registry, "llm_sidecar_flow_queue_depth", priority="low") == 1
    pool.free = 1
    flow.kick(POOL)
    waited = await waiting
    assert waited.pods == ("pod-for-a",) and waited.reason == "" and waited.waited_s >= 0
    assert pool.picked == ["a"]
    assert sample(registry, "llm_sidecar_flow_queue_depth", priority="low") == 0
    assert sample(registry, "llm_sidecar_flow_wait_seconds_count", priority="low") == 1


async def test_with_room_and_nobody_waiting_a_request_does_not_wait() -> None:
    pool = Pool(free=1)
    flow, _ = control(pool)
    assert not flow.must_wait(POOL)


async def test_others_waiting_make_a_new_request_wait_its_turn() -> None:
    pool = Pool(free=0)
    flow, _ = control(pool)
    first = asyncio.create_task(flow.wait(hold(pool, "first")))
    await settled()
    pool.free = 1  # room, but someone waits already: the queue decides
    assert flow.must_wait(POOL)
    second = asyncio.create_task(flow.wait(hold(pool, "second")))
    await settled()
    assert first.done() and not second.done()  # the one that waited went first
    assert pool.picked == ["first"]
    second.cancel()


async def test_high_goes_before_low_that_waited_longer() -> None:
    pool = Pool(free=0)
    flow, _ = control(pool)
    low = asyncio.create_task(flow.wait(hold(pool, "low", "low")))
    await settled()
    high = asyncio.create_task(flow.wait(hold(pool, "high", "high")))
    await settled()
    pool.free = 1
    flow.kick(POOL)
    await high
    assert pool.picked == ["high"] and not low.done()
    pool.free = 1
    flow.kick(POOL)
    await low
    assert pool.picked == ["high", "low"]


async def test_max_wait_refuses_and_nothing_is_picked() -> None:
    pool = Pool(free=0)
    flow, registry = control(pool)
    waited = await flow.wait(hold(pool, "a", max_wait_s=0.05))
    assert waited.pods is None and waited.reason == "max_wait" and waited.waited_s >= 0.04
    assert pool.picked == []
    assert flow.depth(POOL) == 0
    assert sample(registry, "llm_sidecar_flow_rejected_total", priority="low",
                  reason="max_wait") == 1
    pool.free = 1
    flow.kick(POOL)  # room later picks nothing for it
    assert pool.picked == []


async def test_max_queue_refuses_the_newest_low_for_a_high() -> None:
    pool = Pool(free=0)
    flow, registry = control(pool)
    old = asyncio.create_task(flow.wait(hold(pool, "old", max_queue=2)))
    new = asyncio.create_task(flow.wait(hold(pool, "new", max_queue=2)))
    await settled()
    high = asyncio.create_task(flow.wait(hold(pool, "high", "high", max_queue=2)))
    refused = await new
    assert refused.pods is None and refused.reason == "max_queue"
    assert sample(registry, "llm_sidecar_flow_rejected_total", priority="low",
                  reason="max_queue") == 1
    pool.free = 2
    flow.kick(POOL)
    assert (await high).pods == ("pod-for-high",) and (await old).pods == ("pod-for-old",)


async def test_a_client_that_hangs_up_leaves_the_queue() -> None:
    pool = Pool(free=0)
    flow, registry = control(pool)
    gone = asyncio.create_task(flow.wait(hold(pool, "gone")))
    stays = asyncio.create_task(flow.wait(hold(pool, "stays")))
    await settled()
    gone.cancel()
    await settled()
    assert flow.depth(POOL) == 1
    assert sample(registry, "llm_sidecar_flow_abandoned_total", priority="low") == 1
    pool.free = 5
    flow.kick(POOL)
    await stays
    assert pool.picked == ["stays"]  # nothing was picked (or counted open) for the gone one


async def test_a_client_gone_in_the_same_turn_as_its_release_gets_no_pick() -> None:
    """Cancelled, its callback not run yet, when room appears: skipped, not picked for."""
    pool = Pool(free=0)
    flow, _ = control(pool)
    gone = asyncio.create_task(flow.wait(hold(pool, "gone")))
    await settled()
    gone.cancel()
    await asyncio.sleep(0)  # the task has cancelled its future; the callback is pending
    pool.free = 1
    flow.kick(POOL)
    assert pool.picked == []
    await settled()
    assert flow.depth(POOL) == 0


async def test_a_failing_pick_still_releases_the_request() -> None:
    pool = Pool(free=0)
    flow, _ = control(pool)

    def broken() -> tuple[str, ...]:
        raise RuntimeError("bug")
    bad = Hold(POOL, "low", "t", 10, 30.0, 100, 10**6, "tenant", pick=broken,
               resume=lambda waited: (_ for _ in ()).throw(AssertionError()))
    waiting = asyncio.create_task(flow.wait(bad))
    await settled()
    pool.free = 1
    flow.kick(POOL)
    assert (await waiting).pods == ()  # Envoy balances it: never stranded
