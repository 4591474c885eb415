"""Prometheus metrics of config reloads, for any service that holds a reloadable snapshot.

A reload that fails keeps the old config: the counter and the ``last_reload_ok`` gauge are how
an operator (or an alert) learns that the file on disk is not the config that runs.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge


class ReloadMetrics:
    """``on_result`` callback for :class:`sidecar_runtime.process.reload.Reloader`."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.reloads = Counter(
            f"{prefix}_config_reloads",
            "Routing YAML reloads by result: ok (swapped in) or error (rejected, old config kept).",
            ["result"], registry=registry)
        self.last_ok = Gauge(
            f"{prefix}_config_last_reload_ok",
            "1 when the last change of the file was applied, 0 when it was rejected.",
            registry=registry)
        self.applied_at = Gauge(
            f"{prefix}_config_applied_timestamp_seconds",
            "Unix time the running config was loaded (start or last successful reload).",
            registry=registry)
        for result in ("ok", "error"):
            self.reloads.labels(result)
        self.last_ok.set(1)
        self.applied_at.set(time.time())

    def __call__(self, ok: bool, _message: str) -> None:
        self.reloads.labels("ok" if ok else "error").inc()
        self.last_ok.set(1 if ok else 0)
        if ok:
            self.applied_at.set(time.time())
