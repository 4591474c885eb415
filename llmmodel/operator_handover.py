"""A Deployment the operator stops sizing keeps its replicas until its HorizontalPodAutoscaler
sizes it (docs: LLMModel).

When ``replicas.max`` rises above ``min`` the pool's Deployment is applied without
``spec.replicas`` (the HPA's from then on). Server-side apply removes a field its applier stops
sending when no other field manager owns it, and ``replicas`` then falls back to its default,
1, until the HPA's next sync (~15 s): a pool of 3 pods would run 1. Kubernetes' documented way
out ("Transferring ownership", server-side apply) is for a second field manager to apply the same
value first: the field is then shared, and the operator's apply without it leaves it, at its
value, to the other manager, whose ownership the HPA's own update takes over.
"""

from __future__ import annotations

from typing import Any

from llmmodel.kube_api import FIELD_MANAGER, KubeApi

HANDOVER_MANAGER = "llm-sidecar-handover-to-hpa"
"""The field manager that holds a Deployment's ``replicas`` between the operator and the HPA."""


def owns_replicas(live: dict[str, Any], manager: str) -> bool:
    """Whether ``manager``'s server-side apply owns ``spec.replicas`` of the object ``live``
    (its ``metadata.managedFields``)."""
    for entry in live.get("metadata", {}).get("managedFields") or ():
        if entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        spec = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        if "f:replicas" in spec:
            return True
    return False


async def hand_over_replicas(api: KubeApi, desired: dict[str, Any],
                             live: dict[str, Any] | None) -> bool:
    """Before ``desired`` is applied: when it is a Deployment without ``spec.replicas`` whose
    ``live`` copy (None: none exists) has replicas the operator owns, :data:`HANDOVER_MANAGER`
    applies the live value first. True when it did."""
    if desired.get("kind") != "Deployment" or "replicas" in (desired.get("spec") or {}) \
            or live is None:
        return False
    replicas = (live.get("spec") or {}).get("replicas")
    if not isinstance(replicas, int) or not owns_replicas(live, FIELD_MANAGER):
        return False
    meta = desired["metadata"]
    await api.apply({"apiVersion": desired["apiVersion"], "kind": "Deployment",
                     "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                     "spec": {"replicas": replicas}}, field_manager=HANDOVER_MANAGER)
    return True
