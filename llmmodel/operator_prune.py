"""Deleting the objects an LLMModel no longer declares.

Server-side apply only adds and updates: when a spec edit drops a context (its pool's Deployment
would keep its GPUs), lowers ``replicas.max`` to ``min`` (a stale HorizontalPodAutoscaler would
fight ``replicas``) or drops an inline canary, the old objects would stay until the LLMModel is
deleted. After a reconcile has applied a model's objects AND written the routing ConfigMap
without the dropped pools, :func:`prune` lists each kind the operator writes by the model's
label and deletes those the LLMModel controls (its uid, ``controller: true``) that were not just
applied. The label alone proves nothing: another model's objects or a hand-made copy carrying it
are never touched. :mod:`llmmodel.operator` calls it; it uses :mod:`llmmodel.operator_routing`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmmodel.k8s import MODEL_LABEL
from llmmodel.kube_api import KubeApi
from llmmodel.operator_routing import controlled_by

PRUNED_KINDS: tuple[tuple[str, str], ...] = (
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("apps/v1", "Deployment"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("v1", "Service"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)
"""(apiVersion, kind) of every object ``model_objects`` writes, in deletion order: the
autoscaler before the Deployment it scales, the NetworkPolicy last so a pool's pods stay
fenced while they are going."""


def model_selector(name: str, objects: Sequence[dict[str, Any]]) -> str:
    """The label selector of the model's objects: the model label they carry (its name)."""
    for obj in objects:
        value = (obj.get("metadata", {}).get("labels") or {}).get(MODEL_LABEL)
        if isinstance(value, str) and value:
            return f"{MODEL_LABEL}={value}"
    return f"{MODEL_LABEL}={name}"


async def prune(api: KubeApi, namespace: str, uid: str, selector: str,
                applied: Sequence[dict[str, Any]]) -> list[str]:
    """Delete the objects matching ``selector`` that the LLMModel of ``uid`` controls and that
    are not among ``applied``; returns ``Kind/name`` of each deleted. A :class:`KubeApiError`
    stops it where it is (the next reconcile finishes the job)."""
    if not uid:  # no uid, no proof of ownership
        return []
    keep = {(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in applied}
    pruned = []
    for api_version, kind in PRUNED_KINDS:
        for live in await api.list_labelled(api_version, kind, namespace, selector):
            name = live.get("metadata", {}).get("name")
            if not isinstance(name, str) or (api_version, kind, name) in keep \
                    or not controlled_by(live, uid):
                continue
            await api.delete(api_version, kind, namespace, name)
            pruned.append(f"{kind}/{name}")
    return pruned


def pruned_message(pruned: Sequence[str]) -> str:
    """The ``Pruned`` event's message."""
    return f"deleted {len(pruned)} object(s) the spec no longer declares: {', '.join(pruned)}"
