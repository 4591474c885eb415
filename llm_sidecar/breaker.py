"""A circuit breaker on plain data: after a backend failure, skip the backend for a cooldown,
then let one probe through (half-open); its outcome closes or reopens the breaker.

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
    state: BreakerState = BreakerState.CLOSED
    opened_at: float = 0.0
    probe_started: float = 0.0

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

    def failure(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self.opened_at = now
