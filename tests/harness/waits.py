"""Waiting on a condition in a test, never sleeping then asserting."""

from __future__ import annotations

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
