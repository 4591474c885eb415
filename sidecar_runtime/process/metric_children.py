"""Labelled children of a Prometheus metric, looked up once each.

``metric.labels(...)`` validates the values and takes a lock on every call, about 1 µs; on a
path run for every message or decision that adds up. For label values from a fixed, small set
(phases, levels, kinds, results) the child is kept here instead. Never for values a client
chooses: this keeps every child it was asked for.
"""

from __future__ import annotations

from typing import Any


class Children:
    """The children of ``metric`` by label values, made on first use."""

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._made: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._made.get(values)
        if child is None:
            child = self._made[values] = self._metric.labels(*values)
        return child
