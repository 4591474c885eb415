"""prometheus_client internals the generated metrics page reads (prometheus-client>=0.21,<1).

A registry keeps no public list of its collectors, and a labelled metric no public list of its
label names; ``llm_sidecar.docs_gen`` lists every metric, childless ones too, from both.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter

_probe = CollectorRegistry()
_name = "probe"  # a name, not a metric of ours: never served
if not hasattr(_probe, "_collector_to_names") or not hasattr(
        Counter(_name, "probe", ["a"], registry=_probe), "_labelnames"):  # pragma: no cover
    raise ImportError("prometheus_client no longer has _collector_to_names / _labelnames: "
                      "llm_sidecar.docs_gen needs prometheus-client>=0.21,<1 (pyproject.toml)")
del _probe, _name


def collectors(registry: CollectorRegistry) -> list[Any]:
    """Every collector registered in ``registry``, in registration order."""
    return list(registry._collector_to_names)


def label_names(metric: Any) -> tuple[str, ...]:
    """The label names of a labelled metric or a metric family (empty when it has none)."""
    return tuple(getattr(metric, "_labelnames", ()))
