"""Deadlines sharing one timer (``Deadlines.run``) end calls as ``asyncio.timeout`` does: the
same outcome for every way a call can end, whatever else is in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from sidecar_runtime.process.deadlines import Deadlines

Outcome = str
Runner = Callable[[Callable[[], Awaitable[int]], float], Coroutine[Any, Any, int]]


async def with_asyncio_timeout(call: Callable[[], Awaitable[int]], timeout_s: float) -> int:
    async with asyncio.timeout(timeout_s):
        return await call()


def ending(what: str, hold: asyncio.Event) -> Callable[[], Awaitable[int]]:
    async def call() -> int:
        if what == "hangs":
            await asyncio.Event().wait()
        if what == "waits for the test":
            await hold.wait()
        if what == "raises":
            raise ValueError("boom")
        if what == "raises TimeoutError itself":
            raise TimeoutError("inner")
        if what == "swallows its cancellation":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                return 2
        return 1
    return call


async def outcome(run: Runner,
                  what: str, timeout_s: float, outer_cancel: bool) -> Outcome:
    hold = asyncio.Event()
    task = asyncio.create_task(run(ending(what, hold), timeout_s))
    if outer_cancel:
        await asyncio.sleep(0)  # the call is waiting inside
        task.cancel()
    try:
        return f"returned {await task}"
    except asyncio.CancelledError:
        return "cancelled"
    except Exception as exc:
        return type(exc).__name__


WHAT = ("returns", "hangs", "raises", "raises TimeoutError itself", "swallows its cancellation")


@pytest.mark.parametrize("what", WHAT)
@pytest.mark.parametrize("timeout_s", [0.0, -1.0, 0.005, 60.0])
@pytest.mark.parametrize("outer_cancel", [False, True])
async def test_a_call_ends_as_under_asyncio_timeout(what: str, timeout_s: float,
                                                    outer_cancel: bool) -> None:
    if what in ("hangs", "swallows its cancellation") and timeout_s == 60.0 and not outer_cancel:
        return  # would wait the minute under both: nothing to compare
    deadlines = Deadlines()
    expected = await outcome(with_asyncio_timeout, what, timeout_s, outer_cancel)
    assert await outcome(deadlines.run, what, timeout_s, outer_cancel) == expected


async def test_many_calls_in_flight_each_end_by_their_own_deadline() -> None:
    """Calls of two timeouts interleaved, some done early, some hanging: the hanging ones time
    out, the others return, none waits for another's deadline."""
    deadlines = Deadlines()
    release = asyncio.Event()

    async def quick() -> int:
        await release.wait()
        return 1

    async def hang() -> int:
        await asyncio.Event().wait()
        return 0

    tasks = []
    for n in range(40):
        call = hang if n % 3 == 0 else quick
        tasks.append(asyncio.create_task(deadlines.run(call, 0.01 if n % 2 else 0.02)))
    await asyncio.sleep(0)
    release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for n, result in enumerate(results):
        if n % 3 == 0:
            assert isinstance(result, TimeoutError), n
        else:
            assert result == 1, n


async def test_a_long_deadline_still_pending_keeps_its_call_alive() -> None:
    deadlines = Deadlines()
    long = asyncio.create_task(deadlines.run(asyncio.Event().wait, 60.0))
    with pytest.raises(TimeoutError):
        await deadlines.run(asyncio.Event().wait, 0.001)
    await asyncio.sleep(0)
    assert not long.done()
    long.cancel()
    with pytest.raises(asyncio.CancelledError):
        await long


async def test_nothing_is_kept_once_every_call_is_done() -> None:
    deadlines = Deadlines()

    async def one() -> int:
        return 1
    for _ in range(100):
        assert await deadlines.run(one, 0.001) == 1
    queues = deadlines._queues
    for _ in range(10_000):  # until the one timer fires and finds them all done
        if not queues:
            break
        await asyncio.sleep(0.001)
    assert not queues


def test_a_new_event_loop_starts_afresh() -> None:
    deadlines = Deadlines()

    async def twice() -> None:
        with pytest.raises(TimeoutError):
            await deadlines.run(asyncio.Event().wait, 0.001)
        long = asyncio.create_task(deadlines.run(asyncio.Event().wait, 60.0))
        await asyncio.sleep(0)
        long.cancel()

    asyncio.run(twice())
    asyncio.run(twice())  # the first loop's queue and timer are not this loop's


async def cancelled_again_after_its_deadline(
        run: Runner) -> Outcome:
    """The deadline cancels the call, which holds on; then someone else cancels it too."""
    first = asyncio.Event()

    async def call() -> int:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            first.set()
        await asyncio.Event().wait()
        return 1

    task = asyncio.create_task(run(call, 0.001))
    await first.wait()
    task.cancel()
    try:
        return f"returned {await task}"
    except asyncio.CancelledError:
        return "cancelled"
    except Exception as exc:
        return type(exc).__name__


async def test_a_cancellation_besides_the_deadlines_stays_a_cancellation() -> None:
    expected = await cancelled_again_after_its_deadline(with_asyncio_timeout)
    assert expected == "cancelled"
    assert await cancelled_again_after_its_deadline(Deadlines().run) == expected
