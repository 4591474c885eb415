"""The canary guard's verdicts as a routing input: one immutable value per change.

The guard (:mod:`extproc.canary.guard`) judges from finished requests and publishes a new
:class:`CanaryPolicy` when a canary trips; a stream reads the policy in force once, at its
request headers, and routes by it. Nothing that routes reaches into the guard or telemetry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from routing.compiled import Canary, ModelRoute


@dataclass(frozen=True)
class CanaryPolicy:
    """Which canaries this replica has stopped (its guard, or its verdict's rollback), keyed by
    (model, canary config): a changed ``canary:`` config is a new key, so it starts again."""

    stopped: frozenset[tuple[str, Canary]] = frozenset()

    def canary_for(self, model: ModelRoute) -> Canary | None:
        """The canary in force for ``model``: None when it has been stopped."""
        canary = model.canary
        if canary is None or not self.stopped:
            return canary
        return None if (model.name, canary) in self.stopped else canary


OPEN_CANARIES = CanaryPolicy()
"""No canary stopped (a replica without guards, and every replica at start)."""


class PolicySource(Protocol):
    """Where a stream reads the canaries in force (:class:`extproc.canary.guard.CanaryGuards`
    publishes them): the stream depends on this, not on the guard and its metrics."""

    @property
    def policy(self) -> CanaryPolicy: ...
