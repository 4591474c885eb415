"""Envoy running a bootstrap the routing YAML no longer renders: said by a gauge and one log
line per pair, never by failing a request."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from extproc.stream import StreamState
from extproc.telemetry.envoy_drift import STALE_WINDOW_S, EnvoyDrift
from sidecar_runtime.wire.names import BOOTSTRAP_HEADER
from tests.extproc.helpers import snapshot


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stale(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("extproc_envoy_bootstrap_stale")


def test_the_gauge_says_stale_for_a_minute_after_the_last_stale_request() -> None:
    registry, clock = CollectorRegistry(), Clock()
    drift = EnvoyDrift(registry, clock)
    assert stale(registry) == 0
    with capture_logs() as logs:
        drift.observe("aaaa", "bbbb")
        drift.observe("aaaa", "bbbb")  # the same pair: said once
        drift.observe("cccc", "bbbb")
    assert [(e["event"], e["envoy"]) for e in logs] == [("envoy_bootstrap_stale", "aaaa"),
                                                        ("envoy_bootstrap_stale", "cccc")]
    assert stale(registry) == 1
    clock.now += STALE_WINDOW_S + 1
    assert stale(registry) == 0


def test_a_request_tells_it_only_when_its_envoys_fingerprint_differs() -> None:
    told: list[tuple[str, str]] = []
    snap = snapshot()
    for header in ({}, {BOOTSTRAP_HEADER: snap.envoy_fingerprint}, {BOOTSTRAP_HEADER: "other"}):
        state = StreamState(snap, b"s", on_stale=lambda seen, want: told.append((seen, want)))
        state.handle("request_headers", {":path": "/v1/models", ":method": "GET", **header},
                     b"", True)
    assert told == [("other", snap.envoy_fingerprint)]
