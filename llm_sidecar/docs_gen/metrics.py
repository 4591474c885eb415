"""The metrics reference (``docs/reference/metrics.md``) from the registries the services build.

The registries are built as the running services build theirs (example config, default
settings) and read for what is registered, so a metric added in code is on the page at the
next run without anyone listing it here.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from sidecar_runtime.compat.prometheus_internals import collectors, label_names


@dataclass(frozen=True)
class MetricDoc:
    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    services: tuple[str, ...]

    @property
    def series(self) -> tuple[str, ...]:
        """The names of its samples on ``/metrics``."""
        if self.kind == "counter":
            return (f"{self.name}_total",)
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def _registered(registry: CollectorRegistry) -> Iterator[tuple[str, str, str, tuple[str, ...]]]:
    """(name, type, help, label names) of each metric of ``registry``, childless ones too.

    prometheus_client keeps no public list of a registry's collectors, nor of a labelled
    metric's label names: :mod:`sidecar_runtime.compat.prometheus_internals` reads them."""
    for collector in collectors(registry):
        if isinstance(collector, MetricWrapperBase):
            family = next(iter(collector.describe()))
            yield family.name, family.type, family.documentation, label_names(collector)
            continue
        for family in collector.collect():  # a custom collector (the picker's per-pod gauges)
            names = label_names(family)
            names = names or tuple(sorted({k for s in family.samples for k in s.labels}))
            yield family.name, family.type, family.documentation, names


def service_registries() -> dict[str, CollectorRegistry]:
    """Service → the registry its ``/metrics`` serves, built as the running service builds it
    (example config, default settings), without serving."""
    from extproc.adapters.service import ExtprocService
    from ratelimit.service import RateLimitService
    from sidecar_runtime.process.service_process import grpc_server
    from sidecar_runtime.process.settings import Settings
    from sidecar_runtime.process.workers import Supervisor

    config = str(resources.files("llm_sidecar").joinpath("example.yaml"))
    settings = Settings.model_construct(dev_mode=True)

    async def build() -> dict[str, CollectorRegistry]:
        extproc = ExtprocService(config, settings)
        ratelimit = RateLimitService(config, settings)
        for service in (extproc, ratelimit):
            grpc_server(service.name, service.max_message_bytes, settings, service.registry)
        # The supervisor's socket folder goes with this temporary one (tempfile.tempdir is
        # the documented default of mkdtemp's dir).
        previous = tempfile.tempdir
        with tempfile.TemporaryDirectory() as scratch:
            tempfile.tempdir = scratch
            try:
                supervisor = Supervisor("extproc", 2, lambda _i, _s: [], "127.0.0.1", 0, 1.0)
            finally:
                tempfile.tempdir = previous
        return {"extproc": extproc.registry, "ratelimit": ratelimit.registry,
                "supervisor (`--workers N`)": supervisor.registry}

    with structlog.testing.capture_logs():  # the services' start-up warnings are not the page's
        return asyncio.run(build())


def registered_metrics() -> list[MetricDoc]:
    """Every metric the services register, by name; one registered by several services (the
    gRPC server's) is one entry naming them all."""
    found: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    services: dict[str, list[str]] = {}
    for service, registry in service_registries().items():
        for name, kind, text, labels in _registered(registry):
            if found.setdefault(name, (kind, text, labels)) != (kind, text, labels):
                raise AssertionError(f"metric {name} is registered twice, differently")
            services.setdefault(name, []).append(service)
    return [MetricDoc(name, *found[name], tuple(services[name])) for name in sorted(found)]


def metrics_page() -> str:
    metrics = registered_metrics()
    lines = ["# Metrics reference\n",
             "Every Prometheus metric of extproc and ratelimit, on each service's `/metrics` "
             "(`--metrics-port`). A counter is exposed as `NAME_total`, a histogram as "
             "`NAME_bucket`, `NAME_sum` and `NAME_count`; prometheus_client adds a `_created` "
             "sample to the counters and histograms it keeps itself. With `--workers N` the "
             "supervisor serves its workers' metrics merged, plus its own.\n",
             "| metric | type | service |", "|---|---|---|"]
    lines += [f"| [`{m.name}`](#{m.name}) | {m.kind} | {', '.join(m.services)} |"
              for m in metrics]
    lines.append("")
    for m in metrics:
        lines.append(f"## `{m.name}`\n")
        lines.append(f"{' '.join(m.help.split())}\n")
        lines.append(f"- Type: {m.kind}")
        lines.append(f"- Series: {', '.join(f'`{s}`' for s in m.series)}")
        labels = ", ".join(f"`{label}`" for label in m.labels) or "none"
        lines.append(f"- Labels: {labels}")
        lines.append(f"- Service: {', '.join(m.services)}\n")
    return "\n".join(lines)
