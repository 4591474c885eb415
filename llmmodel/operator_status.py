"""The LLMModel's conditions: the reasons they carry, a :class:`Verdict` per condition, how they
are stamped (``lastTransitionTime`` moves only on a flip) and announced as events, and
``PoolsReady`` read from the pools' Deployments.

The bottom of the operator's modules: it imports none of them (:mod:`llmmodel.operator`,
:mod:`llmmodel.operator_routing` use it).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llmmodel.kube_api import KubeApi

ROUTING_NOT_UPDATED = "RoutingNotUpdated"
PLANNING_FAILED = "PlanningFailed"
"""Planned=False: the planner or object writer crashed on this model (a bug, logged)."""
NOT_OWNED = "ObjectNotOwned"
"""Planned=False: an object the model would apply exists and is not controlled by it."""
ROUTING_REFUSED = "RoutingRefused"
"""Planned=False and Routed=False: the merged routing YAML refuses this model (the others are
routed without it), so nothing of it is applied."""
POOLS_MISSING = "DeploymentMissing"

Emit = Callable[[str, str, str], None]
"""(``Normal``/``Warning``, reason, message): a Kubernetes event on the LLMModel."""


@dataclass(frozen=True)
class Verdict:
    """One condition before it is stamped: ``status`` is ``True``, ``False`` or ``Unknown``."""

    type: str
    status: str
    reason: str
    message: str


async def pools_ready(api: KubeApi, objects: Sequence[dict[str, Any]], namespace: str) -> Verdict:
    """True when every pool's Deployment has a ready pod (or is scaled to zero)."""
    lines, ready, missing = [], True, False
    for obj in objects:
        if obj.get("kind") != "Deployment":
            continue
        name = obj["metadata"]["name"]
        live = await api.get("apps/v1", "Deployment", namespace, name)
        if live is None:
            lines.append(f"{name} does not exist")
            ready, missing = False, True
            continue
        desired = int(live.get("spec", {}).get("replicas", 1))
        have = int(live.get("status", {}).get("readyReplicas") or 0)
        ready = ready and (have >= 1 or desired == 0)
        lines.append(f"{name} {have}/{desired} ready")
    reason = "PodsReady" if ready else POOLS_MISSING if missing else "PodsNotReady"
    return Verdict("PoolsReady", "True" if ready else "False", reason, "; ".join(lines) or "no pools")


def stamp(verdicts: Sequence[Verdict], previous: Sequence[dict[str, Any]], now: str) -> list[dict[str, Any]]:
    """Conditions as Kubernetes writes them; ``lastTransitionTime`` kept while status holds."""
    before = {c.get("type"): c for c in previous if isinstance(c, dict)}
    out = []
    for v in verdicts:
        old = before.get(v.type)
        since = old["lastTransitionTime"] if old and old.get("status") == v.status \
            and old.get("lastTransitionTime") else now
        out.append({"type": v.type, "status": v.status, "reason": v.reason, "message": v.message,
                    "lastTransitionTime": since})
    return out


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def announce(emit: Emit | None, verdicts: Sequence[Verdict], previous: Sequence[dict[str, Any]]) -> None:
    """An event per condition that flipped, or whose failure message changed: a warning for a
    failure, so ``kubectl describe`` shows why once, not on every resync."""
    if emit is None:
        return
    before = {c.get("type"): c for c in previous if isinstance(c, dict)}
    for v in verdicts:
        old = before.get(v.type, {})
        failing = v.reason == ROUTING_NOT_UPDATED or (
            v.status == "False" and v.type != "PoolsReady" and v.reason != "NotPlanned")
        if old.get("status") == v.status and not (failing and old.get("message") != v.message):
            continue
        if failing:
            emit("Warning", v.reason, v.message)
        elif v.status == "True":
            emit("Normal", v.reason, f"{v.type}: {v.message}")


def unapplied(previous: Sequence[dict[str, Any]], planned: Verdict, routed: bool,
               routed_false: Verdict, routed_true: Verdict | None = None) -> list[Verdict]:
    """The verdicts of a model nothing was applied for: ``planned`` says why, ``PoolsReady``
    keeps what it was (its last good spec may still run), ``Routed`` follows the ConfigMap."""
    old_ready = next((c for c in previous if c.get("type") == "PoolsReady"), None)
    still = Verdict("Routed", "True", "StillRouted",
                    "routed by its last good spec until the routing is rebuilt")
    return [planned,
            Verdict("PoolsReady", old_ready["status"], old_ready["reason"], old_ready["message"])
            if old_ready else Verdict("PoolsReady", "Unknown", "NotPlanned", "the model is not planned"),
            (routed_true or still) if routed else routed_false]
