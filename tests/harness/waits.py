"""Waiting on a condition in a test, never sleeping then asserting."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable


def wait_for(condition: Callable[[], object], *, timeout: float, what: str,
             interval: float = 0.02) -> None:
    """Return once ``condition()`` is truthy; fail naming ``what`` after ``timeout`` seconds
    (a bound for a broken system, not a performance figure: set it generously)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def until(condition: Callable[[], object], *, timeout_s: float, what: str,
                interval: float = 0.02) -> None:
    """:func:`wait_for` inside an event loop: the loop keeps running while it waits, and
    ``condition`` may be a coroutine function (a store read, a metrics scrape)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval)
