"""``llm-sidecar operator``: LLMModel objects in a namespace become running pools and routes.

One reconcile per LLMModel, level-triggered and idempotent (server-side apply of everything, so
running it twice changes nothing):

1. plan the model beside the namespace's other LLMModels (a canary may be another declared
   model); a spec that cannot be planned sets ``Planned=False`` with the ``FILE:LINE`` message,
   posts a warning event and applies NOTHING (no retry loop: the spec must change first); a
   crash of the planner on one model is that model's ``PlanningFailed``, not the others';
2. build the routing YAML from the base routing YAML and every LLMModel that plans and whose
   objects are its own (one that exists without the model as its controller: ``ObjectNotOwned``);
   a model the merge refuses is left out (``RoutingRefused``) so the others are still routed;
3. apply every object ``onboard`` writes for the model, owned by the LLMModel (deleting the
   model garbage-collects them), unless step 1 or 2 held it back; then write the routing
   ConfigMap (extproc and ratelimit reload the mounted file live); when no model merges, nothing
   is written and the old routing keeps serving; once the ConfigMap is written, delete the
   model's objects its spec no longer declares (a dropped context's pool, a stale autoscaler:
   :mod:`llmmodel.operator_prune`), so no route points at a deleted pool (event ``Pruned``);
4. write ``.status``: ``plan``, ``observedGeneration`` and the conditions ``Planned``,
   ``PoolsReady`` and ``Routed`` (``lastTransitionTime`` moves only when a status flips).

The kopf handlers (:mod:`llmmodel.operator_cli`) are thin: they call :func:`reconcile`,
:func:`refresh` (a timer) and :func:`remove` with the real API client; nothing here imports
kopf, so every step is tested by calling it. This module chains the steps; the steps live in
:mod:`llmmodel.operator_plan` (settings, toolkit, step 1), :mod:`llmmodel.operator_routing`
(steps 2 and 3's ConfigMap) and :mod:`llmmodel.operator_status` (step 4's conditions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmmodel.kube_api import FIELD_MANAGER, KubeApi
from llmmodel.operator_handover import hand_over_replicas
from llmmodel.operator_plan import OperatorSettings, Toolkit, default_toolkit, live_models, plan_namespace
from llmmodel.operator_prune import model_selector, prune, pruned_message
from llmmodel.operator_routing import base_changed, build_routing, live_key, routed_models, write_routing
from llmmodel.operator_status import (
    NOT_OWNED,
    PLANNING_FAILED,
    POOLS_MISSING,
    ROUTING_NOT_UPDATED,
    ROUTING_REFUSED,
    Emit,
    Verdict,
    announce,
    pools_ready,
    stamp,
    unapplied,
    utc_now,
)

__all__ = ["READY_INTERVAL_S", "RETRIED", "Emit", "OperatorSettings", "Toolkit", "Verdict", "default_toolkit",
           "reconcile", "refresh", "refresh_pools_ready", "remove"]
"""What the kopf adapter and callers outside the operator's modules import from here."""

RETRIED = (NOT_OWNED, ROUTING_REFUSED)
"""Planned reasons the timer reconciles again: they clear when something else changes (the
object in the way is deleted, a clashing model or base entry goes)."""
READY_INTERVAL_S = 30.0
"""How often the timer re-reads the pools' Deployments for ``PoolsReady``."""


async def reconcile(api: KubeApi, obj: dict[str, Any], *, settings: OperatorSettings,
                    toolkit: Toolkit | None = None, emit: Emit | None = None,
                    now: Callable[[], str] = utc_now) -> dict[str, Any]:
    """Bring the cluster to what ``obj`` (an LLMModel as the API returns it) declares; returns
    the status written. Raises :class:`KubeApiError` only when the API fails (kopf retries).
    The model's objects are applied only once the routing with it has validated, and only when
    none of them exists without it as their owner."""
    tools = toolkit or default_toolkit(settings)
    meta = obj["metadata"]
    name, namespace = meta["name"], meta.get("namespace") or settings.namespace
    previous = (obj.get("status") or {}).get("conditions") or []
    others = live_models(await api.list_llmmodels(namespace), without=name)
    planned = plan_namespace([*others, obj], namespace, tools)
    error = planned.errors.get(name) or planned.joint
    status: dict[str, Any] = {} if meta.get("generation") is None else {
        "observedGeneration": meta["generation"]}
    not_routed = Verdict("Routed", "False", "NotPlanned", "the routing ConfigMap does not route this model")
    if error is not None or name not in planned.plans:
        reason = PLANNING_FAILED if name in planned.failed or (
            name not in planned.errors and planned.joint_failed) else (
            "InvalidSpec" if name in planned.errors else "ConflictsWithOtherModels")
        routed = name in await routed_models(api, settings, namespace)
        verdicts = unapplied(previous,
                              Verdict("Planned", "False", reason, str(error or "not planned")),
                              routed, not_routed)
    else:
        plan, objects = planned.plans[name], planned.objects[name]
        build = await build_routing(api, settings, tools, planned, namespace)
        applied = name not in build.not_owned and name not in build.refused
        if applied:
            for item in objects:
                # A pool the HPA sizes from now on (its live copy read by build_routing).
                await hand_over_replicas(api, item, build.live.get(live_key(item)))
                await api.apply(item, field_manager=FIELD_MANAGER)
        routing, models = await write_routing(api, settings, build, namespace)
        if applied and build.text is not None:  # routed without the dropped pools: delete them
            pruned = await prune(api, namespace, str(meta.get("uid") or ""),
                                 model_selector(name, objects), objects)
            if pruned and emit is not None:
                emit("Normal", "Pruned", pruned_message(pruned))
        if name in build.not_owned:
            verdicts = unapplied(previous,
                                  Verdict("Planned", "False", NOT_OWNED, build.not_owned[name]),
                                  name in models, not_routed)
        elif name in build.refused:
            message = build.refused[name]
            verdicts = unapplied(
                previous, Verdict("Planned", "False", ROUTING_REFUSED, (
                    "planned, but nothing was applied: the routing YAML cannot take this model "
                    "(see Routed)")), name in models,
                Verdict("Routed", "False", ROUTING_REFUSED, (
                    f"the routing YAML was written without this model: {message}") if build.text
                    else routing.message),
                Verdict("Routed", "True", ROUTING_NOT_UPDATED, routing.message))
        else:
            if routing.status == "False" and name in models:
                routing = Verdict("Routed", "True", ROUTING_NOT_UPDATED, routing.message)
            elif routing.status == "True" and name not in models:
                routing = Verdict("Routed", "False", "NotRouted",
                                  "the merged routing YAML does not name this model")
            verdicts = [Verdict("Planned", "True", "Planned",
                                f"{len(plan.pools)} pool(s), {len(objects)} object(s) applied"),
                        await pools_ready(api, objects, namespace), routing]
        if applied:  # else the status keeps the plan that runs (a merge patch)
            status["plan"] = plan.as_json()
    announce(emit, verdicts, previous)
    status["conditions"] = stamp(verdicts, previous, now())
    await api.patch_status(namespace, name, status)
    return status


async def refresh_pools_ready(api: KubeApi, obj: dict[str, Any], *, settings: OperatorSettings,
                              toolkit: Toolkit | None = None, emit: Emit | None = None,
                              now: Callable[[], str] = utc_now) -> dict[str, Any] | None:
    """The timer's job: re-read the pools' Deployments and update ``PoolsReady`` when it
    changed (a full reconcile when one is missing); returns the status written, or None."""
    tools = toolkit or default_toolkit(settings)
    meta = obj["metadata"]
    name, namespace = meta["name"], meta.get("namespace") or settings.namespace
    previous = (obj.get("status") or {}).get("conditions") or []
    if not any(c.get("type") == "Planned" and c.get("status") == "True" for c in previous):
        return None
    others = live_models(await api.list_llmmodels(namespace), without=name)
    objects = plan_namespace([*others, obj], namespace, tools).objects.get(name)
    if objects is None:
        return None
    verdict = await pools_ready(api, objects, namespace)
    if verdict.reason == POOLS_MISSING:  # deleted by hand: put them back
        return await reconcile(api, obj, settings=settings, toolkit=tools, emit=emit, now=now)
    old: dict[str, Any] = next((c for c in previous if c.get("type") == "PoolsReady"), {})
    if old.get("status") == verdict.status and old.get("message") == verdict.message:
        return None
    announce(emit, [verdict], previous)
    stamped = stamp([verdict], previous, now())[0]
    conditions = [stamped if c.get("type") == "PoolsReady" else c for c in previous]
    if not old:
        conditions.append(stamped)
    status = {"conditions": conditions}
    await api.patch_status(namespace, name, status)
    return status


async def refresh(api: KubeApi, obj: dict[str, Any], *, settings: OperatorSettings,
                  toolkit: Toolkit | None = None, emit: Emit | None = None,
                  now: Callable[[], str] = utc_now) -> dict[str, Any] | None:
    """The timer of a model: a full reconcile when the base routing changed, or when it was
    held back by something outside its spec (:data:`RETRIED`), else only ``PoolsReady``;
    returns the status written, or None."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    namespace = obj["metadata"].get("namespace") or settings.namespace
    planned: dict[str, Any] = next((c for c in conditions if c.get("type") == "Planned"), {})
    if (planned.get("status") == "False" and planned.get("reason") in RETRIED) or \
            (planned.get("status") == "True" and await base_changed(api, settings, namespace)):
        return await reconcile(api, obj, settings=settings, toolkit=toolkit, emit=emit, now=now)
    return await refresh_pools_ready(api, obj, settings=settings, toolkit=toolkit, emit=emit, now=now)


async def remove(api: KubeApi, obj: dict[str, Any], *, settings: OperatorSettings,
                 toolkit: Toolkit | None = None, emit: Emit | None = None) -> Verdict:
    """The model is being deleted: route without it. Its objects go with their owner."""
    tools = toolkit or default_toolkit(settings)
    name = obj["metadata"]["name"]
    namespace = obj["metadata"].get("namespace") or settings.namespace
    others = live_models(await api.list_llmmodels(namespace), without=name)
    planned = plan_namespace(others, namespace, tools)
    if planned.joint is not None:
        verdict = Verdict("Routed", "False", "RoutingInvalid",
                          f"the routing YAML was not updated: {planned.joint}")
    else:
        build = await build_routing(api, settings, tools, planned, namespace)
        verdict, _ = await write_routing(api, settings, build, namespace)
    if emit is not None:
        emit("Normal" if verdict.status == "True" else "Warning", verdict.reason,
             f"removed from routing: {verdict.message}" if verdict.status == "True" else verdict.message)
    return verdict
