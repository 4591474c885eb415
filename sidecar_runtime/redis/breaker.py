"""A circuit breaker on plain data: after ``failures_to_open`` consecutive backend failures,
skip the backend for a cooldown, then let one probe through (half-open); its outcome closes or
reopens the breaker.

Why more than one failure: a missed deadline is ambiguous. A frozen Redis misses every
deadline, but so does a healthy one when this process's own event loop is starved of CPU for a
moment; opening on one such miss turns a 50 ms hiccup into a whole cooldown without Redis
(with ``on_backend_error: allow``, a second of unlimited admission). Requiring a few in a row
keeps a real outage cheap (a few deadlines at most) and ignores lone misses.

The clock reading is passed in, so the state machine is tested without sleeping. Shared by the
rate limiter's bucket store and extproc's embedding cache: each Redis user keeps its own breaker.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class BreakerState(IntEnum):
    """Values are what the ``*_breaker_state`` gauges show."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass
class Breaker:
    cooldown_s: float
    failures_to_open: int = 1
    """Consecutive failures (no success between them) that open a closed breaker."""
    state: BreakerState = BreakerState.CLOSED
    opened_at: float = 0.0
    probe_started: float = 0.0
    failures: int = 0
    """Consecutive failures seen while closed."""

    def allow(self, now: float) -> bool:
        """May this caller use the backend now? In half-open only the probe may; a probe
        that never reported back is replaced after another cooldown."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if now - self.opened_at < self.cooldown_s:
                return False
            self.state = BreakerState.HALF_OPEN
            self.probe_started = now
            return True
        if now - self.probe_started >= self.cooldown_s:
            self.probe_started = now
            return True
        return False

    def success(self) -> None:
        self.state = BreakerState.CLOSED
        self.failures = 0

    def inconclusive(self) -> None:
        """A call that could not tell whether the backend works (it needed only a part already
        known to be down, and sent nothing): the failure count stands, and a half-open probe's
        turn goes to the next caller at once instead of after another cooldown."""
        if self.state is BreakerState.HALF_OPEN:
            self.probe_started = float("-inf")

    def failure(self, now: float) -> bool:
        """Count a failure; True when it opened the breaker (a closed breaker reaching
        ``failures_to_open``, or a failed half-open probe)."""
        if self.state is BreakerState.CLOSED:
            self.failures += 1
            if self.failures < self.failures_to_open:
                return False
        elif self.state is BreakerState.OPEN:
            # A late reply of a call started before the breaker opened: keep the cooldown.
            return False
        self.state = BreakerState.OPEN
        self.opened_at = now
        self.failures = 0
        return True
