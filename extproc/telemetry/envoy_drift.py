"""Envoy running a bootstrap the routing YAML no longer renders
(docs: Checking, editor support and live reload).

Envoy reads its bootstrap once; extproc and ratelimit reload the YAML live. An edit that only
``render`` and an Envoy restart can apply (a new cluster or endpoint list, a service address,
``rate_limits:`` added to a file that had none, ``telemetry.envoy_usage``) used to be half
applied in silence: extproc routed to a cluster Envoy did not have, or a new limit was never
asked for. The bootstrap ``render`` writes sends its fingerprint with every request
(:data:`~sidecar_runtime.wire.names.BOOTSTRAP_HEADER`); extproc compares it with the one its
running config renders, and says when they differ.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from sidecar_runtime.process.logs import get_logger

log = get_logger("extproc.telemetry.envoy_drift")

STALE_WINDOW_S = 60.0
"""The gauge stays 1 this long after the last request that came through a stale Envoy."""
MAX_TOLD = 64
"""Distinct (Envoy, config) fingerprint pairs logged, at most (a log line each)."""


class EnvoyDrift:
    """``observe(seen, expected)`` for each request whose Envoy fingerprint differs from the
    config's: the gauge ``extproc_envoy_bootstrap_stale`` and one warning per pair."""

    def __init__(self, registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = -math.inf
        self._told: set[tuple[str, str]] = set()
        gauge = Gauge("extproc_envoy_bootstrap_stale",
                      "1 when a request of the last minute came through an Envoy whose "
                      "bootstrap is not the one the running routing YAML renders: run "
                      "llm-sidecar render and restart Envoy.", registry=registry)
        gauge.set_function(self.stale)

    def stale(self) -> float:
        return 1.0 if self._clock() - self._last < STALE_WINDOW_S else 0.0

    def observe(self, seen: str, expected: str) -> None:
        self._last = self._clock()
        pair = (seen[:32], expected)
        if pair in self._told or len(self._told) >= MAX_TOLD:
            return
        self._told.add(pair)
        log.warning("envoy_bootstrap_stale", envoy=pair[0], config=expected,
                    detail="Envoy runs a bootstrap the routing YAML no longer renders (a cluster, "
                           "an endpoint, a service address, rate_limits: added or removed): run "
                           "llm-sidecar render and restart Envoy")
