"""extproc settles the token reservations of responses it read itself, many per rate-limit call.

Envoy settles a reservation with a second rate-limit call per request (``apply_on_stream_done``,
:mod:`routing.ratelimits`): one gRPC round trip, and about half the ratelimit service's CPU per
non-streamed request (docs/decisions/0005-settlement-batches.md).
When extproc read the response to its end and
knows its usage (every non-streamed answer, embeddings too, a sampled stream, an upstream
error), it builds the very token descriptors Envoy's stream-done call would carry
(:func:`settlement_for`, read off the same route rate limits, so the two cannot drift) and
hands them to a
:class:`SettlementBatcher`, which sends what gathered every few milliseconds (or once
``max_descriptors`` are queued) in one ``ShouldRateLimit`` call (below ``min_batch`` settlements
per interval it leaves them to Envoy: a batch of one costs more than Envoy's call); the
ratelimit service settles them in one store call (one ``EVALSHA`` per Redis slot group).

Exactly one of Envoy and extproc settles a request: the answer that ends the response carries
Envoy's ``llm_tokens`` and ``llm_done`` only when the batcher did not take the settlement
(disabled, quiet, queue full, draining), and without them Envoy sends no token descriptor (its
concurrency-slot release is unchanged; a request without a concurrency cap then makes no
stream-done call at all).

A batch the service does not answer (down, deadline missed) is not retried: its reservations
stand, the safe side (docs: Rate limits), as when Envoy's own stream-done call fails. Counted in
``llm_sidecar_extproc_settlements_total{result}`` and logged once per run of failures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from extproc.actions import Descriptor, Headers, Settlement
from extproc.hit_limits import Step, compile_actions, evaluate, once_per_config, route_limits
from routing.schema import RoutingConfig
from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.wire.names import DONE_METADATA_KEY, LEASE_METADATA_KEY, TOKENS_METADATA_KEY

log = get_logger("extproc.settlements")

MAX_BATCH_DESCRIPTORS = 256
"""A batch is sent once this many descriptors are queued (well under the service's cap,
:data:`ratelimit.request_bounds.MAX_DESCRIPTORS`)."""
MAX_PENDING_DESCRIPTORS = 16_384
"""Beyond this many queued or in flight (the service is slow), settlements go back to Envoy."""

Send = Callable[[tuple[Descriptor, ...]], Awaitable[bool]]
"""One rate-limit call carrying the descriptors; True when the service answered OK."""

Count = Callable[[str, int], None]
"""Counts settlements by result (``ok``, ``failed``, ``envoy``): result, requests."""

_TOKENS_KIND = {"generic_key": {"descriptor_key": "kind", "descriptor_value": "tokens"}}


def _settle_actions(config: RoutingConfig) -> list[list[dict[str, Any]]]:
    """The actions of the route's stream-done token rate limits."""
    return [limit["actions"] for limit in route_limits(config)
            if limit.get("apply_on_stream_done") and _TOKENS_KIND in limit["actions"]]


@once_per_config
def _settle_steps(config: RoutingConfig) -> tuple[tuple[Step, ...], ...]:
    """:func:`_settle_actions` compiled: every settled request runs them."""
    return tuple(compile_actions(actions, True) for actions in _settle_actions(config))


def settlement_for(config: RoutingConfig, headers: Headers, lease: str,
                   used: int) -> Settlement | None:
    """The token descriptors Envoy's stream-done call would send for a request routed with
    ``headers`` (extproc's own ``x-llm-*``, never the client's) under ``lease``, whose response
    used ``used`` tokens; None when the route has no token limit."""
    limits = _settle_steps(config)
    if not limits or not lease:
        return None
    metadata: Mapping[str, str] = {LEASE_METADATA_KEY: lease,
                                   TOKENS_METADATA_KEY: str(max(0, used)),
                                   DONE_METADATA_KEY: "1"}
    values = dict(headers)
    descriptors = tuple(d for d in (evaluate(steps, values, metadata) for steps in limits)
                        if d is not None)
    return Settlement(descriptors) if descriptors else None


class SettlementBatcher:
    """Queues settlements and sends them ``interval_s`` after the first of a batch arrived, or
    as soon as ``max_descriptors`` are queued; one call per batch (see the module docstring).
    Below ``min_batch`` settlements per interval it leaves them to Envoy (:meth:`offer`).

    :meth:`offer` never waits; :meth:`aclose` sends what is queued and waits for every call in
    flight (each bounded by the send's own deadline).
    """

    def __init__(self, send: Send, interval_s: float, count: Count, min_batch: int = 1,
                 max_descriptors: int = MAX_BATCH_DESCRIPTORS,
                 max_pending: int = MAX_PENDING_DESCRIPTORS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._clock = clock
        self._min_batch = min_batch
        self._window_start = -1e18
        self._window_offers = 0
        self._last_offers = 0
        """Settlements offered in the last whole interval: the rate a new batch expects."""
        self._interval_s = interval_s
        self._max_descriptors = max_descriptors
        self._max_pending = max_pending
        self._queue: list[Settlement] = []
        self._queued = 0
        """Descriptors in the queue."""
        self._in_flight = 0
        """Descriptors in calls not yet answered."""
        self._timer: asyncio.TimerHandle | None = None
        self._calls: set[asyncio.Task[None]] = set()
        self._closed = interval_s <= 0
        self._failing = False
        self._count = count

    @property
    def pending(self) -> int:
        """Settlements queued, not yet sent."""
        return len(self._queue)

    def offer(self, settlement: Settlement) -> bool:
        """Queue ``settlement``; False when Envoy must settle it instead (see the class).

        A batch costs extproc a gRPC call of its own, which for one settlement is dearer than
        Envoy's stream-done call (docs/decisions/0005-settlement-batches.md): a new batch
        is started only when the last
        interval saw ``min_batch`` settlements offered; joining a batch under way is free."""
        size = len(settlement.descriptors)
        now = self._clock()
        if now - self._window_start >= self._interval_s:
            whole = now - self._window_start < 2 * self._interval_s
            self._last_offers = self._window_offers if whole else 0
            self._window_start, self._window_offers = now, 0
        self._window_offers += 1
        if self._closed or self._queued + self._in_flight + size > self._max_pending \
                or (self._min_batch > 1 and not self._queue
                    and self._last_offers < self._min_batch):
            self._count("envoy", 1)
            return False
        self._queue.append(settlement)
        self._queued += size
        if self._queued >= self._max_descriptors:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._interval_s, self._flush)
        return True

    def _flush(self) -> None:
        """Send everything queued, in calls of at most ``max_descriptors`` (a settlement is
        never split)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch: list[Descriptor] = []
        count = 0
        for settlement in self._queue:
            if batch and len(batch) + len(settlement.descriptors) > self._max_descriptors:
                self._start(tuple(batch), count)
                batch, count = [], 0
            batch.extend(settlement.descriptors)
            count += 1
        if batch:
            self._start(tuple(batch), count)
        self._queue.clear()
        self._queued = 0

    def _start(self, descriptors: tuple[Descriptor, ...], requests: int) -> None:
        self._in_flight += len(descriptors)
        task = asyncio.get_running_loop().create_task(self._call(descriptors, requests))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _call(self, descriptors: tuple[Descriptor, ...], requests: int) -> None:
        try:
            ok = await self._send(descriptors)
        except Exception:  # a bug in the send must not lose the batcher: count and go on
            log.exception("extproc_settlement_send_failed")
            ok = False
        finally:
            self._in_flight -= len(descriptors)
        self._count("ok" if ok else "failed", requests)
        if not ok and not self._failing:
            self._failing = True
            log.warning("extproc_settlements_failing", requests=requests,
                        detail="the ratelimit service did not take a batch of settlements: "
                        "their reservations stand; logged once until a batch succeeds")
        elif ok and self._failing:
            self._failing = False
            log.info("extproc_settlements_recovered")

    async def aclose(self) -> None:
        """Stop taking settlements (later ones go to Envoy), send the queue, wait for every
        call in flight. Safe to call twice."""
        self._closed = True
        self._flush()
        while self._calls:
            await asyncio.gather(*tuple(self._calls), return_exceptions=True)
