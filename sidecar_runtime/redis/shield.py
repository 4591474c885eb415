"""The one guarded call to a shared backend (Redis): a deadline, a circuit breaker, and one log
line per outage, for the rate limiter's buckets and extproc's embedding cache alike.

A dead or frozen backend costs a few deadlines per breaker cooldown (``failures_to_open``), not
one per request, and is tried again by itself (half-open probe). A Redis Cluster master that is
down (:class:`NodeDown`) fails only its own keys and says nothing about the rest, so it neither
opens nor closes the breaker. A call cancelled mid-way (Envoy reset the stream) counts as a
failure: a half-open probe is never left hanging until the next cooldown.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sidecar_runtime.process.deadlines import Deadlines
from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.redis.breaker import Breaker, BreakerState

T = TypeVar("T")


class BackendError(Exception):
    """The backend failed, missed its deadline, or was skipped while the breaker is open: the
    caller applies its policy (the rate limiter's ``on_backend_error``, the cache's bypass)."""


class NodeDown(BackendError):
    """A Redis Cluster master holding some of the keys is down (the others answer): handled like
    any backend error, but not a sign that the backend as a whole is failing."""


class BreakerOpen(BackendError):
    """Skipped without trying: the breaker is open."""


READY_RETRY_S = 0.1
"""How often :func:`ready_within` asks a backend that refused again."""


async def ready_within(attempt: Callable[[], Awaitable[object]], bound_s: float,
                       retry_s: float = READY_RETRY_S) -> Exception | None:
    """Get a backend ready at start-up (connections, TLS, AUTH, scripts) before the first
    request's deadline has to pay for it: ``attempt()`` until it returns, asked again every
    ``retry_s`` after a :class:`BackendError` (a Redis started beside the service may not
    listen yet), for ``bound_s`` in all (one that hangs is given up at the bound). None when
    it got ready, else the last error: the caller logs it and serves, its requests taking
    their backend-error policy until the backend answers. The breaker is left to requests."""
    deadline = time.monotonic() + bound_s
    while True:
        try:
            await asyncio.wait_for(attempt(), max(deadline - time.monotonic(), retry_s))
            return None
        except (TimeoutError, BackendError) as exc:
            if time.monotonic() + retry_s >= deadline:
                return exc
        await asyncio.sleep(retry_s)


class Shield:
    """Deadline + breaker + log-once around the calls to one backend.

    ``on_error(op, reason)`` counts each failure (reason ``timeout``, ``error``,
    ``node_down`` or ``breaker_open``; ``op`` as given to :meth:`call`); ``on_state(state)``
    publishes the breaker state at each call, when it differs from the one last published (a
    gauge set takes a lock; unchanged, it is skipped: what the gauge shows is the same).
    ``failed_event`` / ``recovered_event`` name the two log lines of an outage.
    """

    def __init__(self, *, cooldown_s: float, failures_to_open: int, logger: str,
                 failed_event: str, recovered_event: str, skip_detail: str,
                 on_error: Callable[[str, str], None], on_state: Callable[[BreakerState], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._breaker = Breaker(cooldown_s, failures_to_open=max(1, failures_to_open))
        self._log = get_logger(logger)
        self._failed_event = failed_event
        self._recovered_event = recovered_event
        self._skip_detail = skip_detail
        self._on_error = on_error
        self._on_state = on_state
        self._clock = clock
        self._published = self._breaker.state
        self._deadlines = Deadlines()
        on_state(self._published)

    @property
    def state(self) -> BreakerState:
        return self._breaker.state

    @property
    def cooldown_s(self) -> float:
        return self._breaker.cooldown_s

    async def call(self, call: Callable[[], Awaitable[T]], timeout_s: float, op: str = "") -> T:
        """``call()`` within ``timeout_s``; raises :class:`BreakerOpen`, :class:`NodeDown` or
        :class:`BackendError` (a missed deadline included) instead of waiting longer.
        ``op`` names the operation in the outage's log line."""
        if not self._breaker.allow(self._clock()):
            self._on_error(op, "breaker_open")
            raise BreakerOpen("backend skipped: circuit breaker open")
        self._publish()
        reported = False
        try:
            # The deadline as asyncio.timeout keeps it (not wait_for: no extra Task per call),
            # with one timer for all the calls in flight (sidecar_runtime/process/deadlines.py).
            result = await self._deadlines.run(call, timeout_s)
            if self._breaker.state is not BreakerState.CLOSED:
                self._log.info(self._recovered_event)
            self._breaker.success()
            reported = True
            return result
        except TimeoutError:
            message = f"backend missed its {timeout_s * 1000:.0f} ms deadline"
            self._fail("timeout", message, op)
            reported = True
            raise BackendError(message) from None
        except NodeDown:
            self._on_error(op, "node_down")
            self._breaker.inconclusive()
            reported = True
            raise
        except BackendError as exc:
            self._fail("error", str(exc), op)
            reported = True
            raise
        finally:
            if not reported:  # cancelled or an unexpected error: do not leave a probe hanging
                self._breaker.failure(self._clock())
            self._publish()

    def _publish(self) -> None:
        state = self._breaker.state
        if state is not self._published:
            self._published = state
            self._on_state(state)

    def _fail(self, reason: str, message: str, op: str) -> None:
        self._on_error(op, reason)
        was_closed = self._breaker.state is BreakerState.CLOSED
        if self._breaker.failure(self._clock()) and was_closed:  # once per outage
            fields = {"op": op} if op else {}
            self._log.warning(self._failed_event, error=message, **fields,
                              detail=f"{self._skip_detail} for {self._breaker.cooldown_s:g} s "
                                     "at a time")
