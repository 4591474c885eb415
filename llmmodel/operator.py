"""``llm-sidecar operator``: LLMModel objects in a namespace become running pools and routes.

One reconcile per LLMModel, level-triggered and idempotent (server-side apply of everything, so
running it twice changes nothing):

1. plan the model beside the namespace's other LLMModels (a canary may be another declared
   model); a spec that cannot be planned sets ``Planned=False`` with the ``FILE:LINE`` message,
   posts a warning event and applies NOTHING (no retry loop: the spec must change first);
2. apply every object ``onboard`` writes for it, owned by the LLMModel (deleting the model
   garbage-collects them);
3. rebuild the routing ConfigMap from the base routing YAML and every LLMModel that plans
   (extproc and ratelimit reload the mounted file live); a routing YAML that does not validate is
   not written, the old one keeps serving;
4. write ``.status``: ``plan``, ``observedGeneration`` and the conditions ``Planned``,
   ``PoolsReady`` and ``Routed`` (``lastTransitionTime`` moves only when a status flips).

The kopf handlers (:mod:`llmmodel.operator_cli`) are thin: they call :func:`reconcile`,
:func:`refresh` (a timer) and :func:`remove` with the real API client; nothing here imports
kopf, so every step is tested by calling it.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from llmmodel.kube_api import FIELD_MANAGER, LLMMODEL_API_VERSION, LLMMODEL_KIND, KubeApi
from llmmodel.plans import ModelPlan
from llmmodel.spec import LoadedModel, model_from_object
from routing.errors import ConfigError, Problem

ROUTING_KEY = "routing.yaml"
ROUTING_NOT_UPDATED = "RoutingNotUpdated"
POOLS_MISSING = "DeploymentMissing"
BASE_VERSION = "llm-sidecar.dev/base-resource-version"
"""The routing ConfigMap's note of the base ConfigMap version it was merged from."""
READY_INTERVAL_S = 30.0
"""How often the timer re-reads the pools' Deployments for ``PoolsReady``."""

Emit = Callable[[str, str, str], None]
"""(``Normal``/``Warning``, reason, message): a Kubernetes event on the LLMModel."""


@dataclass(frozen=True)
class OperatorSettings:
    namespace: str
    image: str | None = None
    """The vLLM image of the pools' Deployments (None: the one ``onboard`` writes)."""
    routing_configmap: str = "llm-sidecar-routing"
    base_configmap: str = "llm-sidecar-routing-base"
    gpus_path: str | None = None
    allow_host_paths: bool = False
    """Whether an LLMModel may name a path of the GPU node as its ``modelPath`` (mounted with
    ``hostPath``). Off: whoever may create an LLMModel could otherwise have the operator mount
    any directory of a node (``/``, ``/etc``, a runtime socket) into a pod it creates."""


def host_path_problems(models: Sequence[LoadedModel]) -> list[Problem]:
    """A local ``modelPath`` (the model's or its canary's) of each of ``models``: refused by an
    operator started without ``--allow-host-paths``."""
    problems = []
    for model in models:
        for at, path in ((("spec", "modelPath"), model.spec.model_path),
                         (("spec", "canary", "modelPath"),
                          model.spec.canary.model_path if model.spec.canary else None)):
            if path is not None and "://" not in path:
                problems.append(model.problem(at, (
                    f"{path!r} is a path on the GPU node, mounted with hostPath: this operator "
                    "refuses it (start it with --allow-host-paths to allow it); use pvc://, "
                    "s3://, gs:// or hf://")))
    return problems


@dataclass(frozen=True)
class Toolkit:
    """The pure steps reconcile chains, as callables so tests can run reconcile against stand-ins
    while the planner is built elsewhere. :func:`default_toolkit` binds the real ones."""

    plan: Callable[[Sequence[LoadedModel]], list[ModelPlan]]
    objects: Callable[[ModelPlan, str], list[dict[str, Any]]]
    """(plan, namespace) → the Kubernetes objects ``onboard`` writes for it."""
    merge: Callable[[str, str, Sequence[ModelPlan], str], str]
    """(base routing text, its source name, plans, namespace) → the merged routing YAML."""


def routing_header(base_source: str, namespace: str) -> str:
    """The comment on top of the routing ConfigMap: who rewrites it and what to edit instead
    (an edit of the ConfigMap itself is lost at the next reconcile)."""
    return (f"Written by `llm-sidecar operator` from the base ConfigMap ({base_source}) and every "
            f"LLMModel of namespace {namespace}:\nedit those, not this; it is rewritten on every change.")


def default_toolkit(settings: OperatorSettings) -> Toolkit:
    """The planner, object writer and routing merge of :mod:`llmmodel`; the GPU inventory is
    loaded once here, so a bad ``--gpus`` file fails at startup (``ConfigError``)."""
    from llmmodel.catalog import load_gpus
    from llmmodel.k8s import model_objects
    from llmmodel.planner import plan_models
    from llmmodel.routing_merge import default_endpoints, merged_yaml

    inventory = load_gpus(settings.gpus_path)

    def objects(plan: ModelPlan, namespace: str) -> list[dict[str, Any]]:
        if settings.image is None:
            return model_objects(plan, namespace=namespace)
        return model_objects(plan, namespace=namespace, image=settings.image)

    def merge(base: str, source: str, plans: Sequence[ModelPlan], namespace: str) -> str:
        return merged_yaml(base, source, plans,
                           endpoints=lambda pool: default_endpoints(pool, namespace),
                           header_text=routing_header(source, namespace))

    def plan(models: Sequence[LoadedModel]) -> list[ModelPlan]:
        problems = [] if settings.allow_host_paths else host_path_problems(models)
        if problems:
            raise ConfigError(problems)
        return plan_models(models, inventory)

    return Toolkit(plan=plan, objects=objects, merge=merge)


@dataclass
class NamespacePlan:
    """The namespace's LLMModels planned together: a plan per model that plans, the error of
    each that does not, and ``joint`` when they plan alone but not together."""

    plans: dict[str, ModelPlan] = field(default_factory=dict)
    errors: dict[str, ConfigError] = field(default_factory=dict)
    joint: ConfigError | None = None


def plan_namespace(objs: Sequence[dict[str, Any]], namespace: str, toolkit: Toolkit) -> NamespacePlan:
    """Each model alone first (a bad one is set aside with its own error), then the good ones
    together (so a canary declared as another LLMModel gets no pool of its own)."""
    out = NamespacePlan()
    good: list[LoadedModel] = []
    for obj in objs:
        name = str(obj.get("metadata", {}).get("name", "?"))
        try:
            model = model_from_object(obj, f"{namespace}/{name}")
            toolkit.plan([model])
        except ConfigError as err:
            out.errors[name] = err
            continue
        good.append(model)
    try:
        out.plans = {plan.name: plan for plan in toolkit.plan(good)} if good else {}
    except ConfigError as err:
        out.joint = err
    return out


def live_models(items: Sequence[dict[str, Any]], *, without: str | None = None) -> list[dict[str, Any]]:
    """The LLMModels that still count: not being deleted, and not ``without``."""
    return [o for o in items if not o.get("metadata", {}).get("deletionTimestamp")
            and o.get("metadata", {}).get("name") != without]


def owned(obj: dict[str, Any], owner: dict[str, Any], namespace: str) -> dict[str, Any]:
    """``obj`` in ``namespace`` with the LLMModel as its controller owner. No
    ``blockOwnerDeletion``: setting it needs ``update`` on ``llmmodels/finalizers`` where the
    OwnerReferencesPermissionEnforcement admission plugin runs, and garbage collection
    happens without it."""
    out = copy.deepcopy(obj)
    meta = out.setdefault("metadata", {})
    meta["namespace"] = namespace
    meta["ownerReferences"] = [{
        "apiVersion": LLMMODEL_API_VERSION, "kind": LLMMODEL_KIND,
        "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"], "controller": True}]
    return out


@dataclass(frozen=True)
class Verdict:
    """One condition before it is stamped: ``status`` is ``True``, ``False`` or ``Unknown``."""

    type: str
    status: str
    reason: str
    message: str


async def rebuild_routing(api: KubeApi, settings: OperatorSettings, toolkit: Toolkit,
                          plans: Sequence[ModelPlan], namespace: str) -> tuple[Verdict, set[str]]:
    """Write the routing ConfigMap: base routing YAML + ``plans``. Returns how it went and the
    models the written (or, on failure, the current) ConfigMap routes."""
    from routing.loader import validate
    from routing.yamlsrc import load_yaml

    base = await api.get("v1", "ConfigMap", namespace, settings.base_configmap)
    text = (base or {}).get("data", {}).get(ROUTING_KEY)
    if not isinstance(text, str):
        return (Verdict("Routed", "False", "BaseConfigMissing",
                        f"ConfigMap {namespace}/{settings.base_configmap} has no {ROUTING_KEY}: "
                        "put the gateway's routing YAML there (it may declare no clusters or "
                        "models)"), await routed_models(api, settings, namespace))
    source = f"configmap/{settings.base_configmap}/{ROUTING_KEY}"
    try:
        merged = toolkit.merge(text, source, plans, namespace)
        validate(load_yaml(merged, f"configmap/{settings.routing_configmap}/{ROUTING_KEY}"))
    except ConfigError as err:
        return (Verdict("Routed", "False", "RoutingInvalid",
                        f"the routing YAML was not updated (the old one keeps serving): {err}"),
                await routed_models(api, settings, namespace))
    await api.apply({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": settings.routing_configmap, "namespace": namespace,
                     "labels": {"app.kubernetes.io/part-of": "llm-sidecar",
                                "app.kubernetes.io/managed-by": "llm-sidecar-operator"},
                     "annotations": {BASE_VERSION: _version(base)}},
        "data": {ROUTING_KEY: merged}}, field_manager=FIELD_MANAGER)
    return Verdict("Routed", "True", "RoutingUpdated", "routing ConfigMap updated"), _models_of(merged)


def _version(obj: dict[str, Any] | None) -> str:
    return str((obj or {}).get("metadata", {}).get("resourceVersion", ""))


async def base_changed(api: KubeApi, settings: OperatorSettings, namespace: str) -> bool:
    """True when the base routing ConfigMap is not the version the routing was last merged
    from (someone edited it): the timer then reconciles, as nothing watches ConfigMaps."""
    base = await api.get("v1", "ConfigMap", namespace, settings.base_configmap)
    if base is None:
        return False
    routing = await api.get("v1", "ConfigMap", namespace, settings.routing_configmap)
    merged_from = (routing or {}).get("metadata", {}).get("annotations", {}).get(BASE_VERSION)
    return bool(merged_from != _version(base))


async def routed_models(api: KubeApi, settings: OperatorSettings, namespace: str) -> set[str]:
    """The models the routing ConfigMap routes now."""
    current = await api.get("v1", "ConfigMap", namespace, settings.routing_configmap)
    return _models_of((current or {}).get("data", {}).get(ROUTING_KEY))


def _models_of(text: object) -> set[str]:
    try:
        doc = yaml.safe_load(text) if isinstance(text, str) else None
    except yaml.YAMLError:
        return set()
    models = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(models, dict):
        return set()
    # a declared canary model is served through its stable model's entry
    canaries = {entry["canary"].get("model") for entry in models.values()
                if isinstance(entry, dict) and isinstance(entry.get("canary"), dict)}
    return set(models) | {c for c in canaries if isinstance(c, str)}


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


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _announce(emit: Emit | None, verdicts: Sequence[Verdict], previous: Sequence[dict[str, Any]]) -> None:
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


async def reconcile(api: KubeApi, obj: dict[str, Any], *, settings: OperatorSettings,
                    toolkit: Toolkit | None = None, emit: Emit | None = None,
                    now: Callable[[], str] = _now) -> dict[str, Any]:
    """Bring the cluster to what ``obj`` (an LLMModel as the API returns it) declares; returns
    the status written. Raises :class:`KubeApiError` only when the API fails (kopf retries)."""
    tools = toolkit or default_toolkit(settings)
    meta = obj["metadata"]
    name, namespace = meta["name"], meta.get("namespace") or settings.namespace
    previous = (obj.get("status") or {}).get("conditions") or []
    others = live_models(await api.list_llmmodels(namespace), without=name)
    planned = plan_namespace([*others, obj], namespace, tools)
    error = planned.errors.get(name) or planned.joint
    status: dict[str, Any] = {} if meta.get("generation") is None else {
        "observedGeneration": meta["generation"]}
    if error is not None or name not in planned.plans:
        reason = "InvalidSpec" if name in planned.errors else "ConflictsWithOtherModels"
        routed = name in await routed_models(api, settings, namespace)
        old_ready = next((c for c in previous if c.get("type") == "PoolsReady"), None)
        verdicts = [
            Verdict("Planned", "False", reason, str(error or "not planned")),
            Verdict("PoolsReady", old_ready["status"], old_ready["reason"], old_ready["message"])
            if old_ready else Verdict("PoolsReady", "Unknown", "NotPlanned", "the model is not planned"),
            Verdict("Routed", "True" if routed else "False",
                    "StillRouted" if routed else "NotPlanned",
                    "routed by its last good spec until the routing is rebuilt" if routed
                    else "the routing ConfigMap does not route this model")]
    else:
        plan = planned.plans[name]
        objects = [owned(o, obj, namespace) for o in tools.objects(plan, namespace)]
        for item in objects:
            await api.apply(item, field_manager=FIELD_MANAGER)
        routing, models = await rebuild_routing(api, settings, tools, list(planned.plans.values()),
                                                namespace)
        if routing.status == "False" and name in models:
            routing = Verdict("Routed", "True", ROUTING_NOT_UPDATED, routing.message)
        elif routing.status == "True" and name not in models:
            routing = Verdict("Routed", "False", "NotRouted",
                              "the merged routing YAML does not name this model")
        verdicts = [Verdict("Planned", "True", "Planned",
                            f"{len(plan.pools)} pool(s), {len(objects)} object(s) applied"),
                    await pools_ready(api, objects, namespace), routing]
        status["plan"] = plan.as_json()
    _announce(emit, verdicts, previous)
    status["conditions"] = stamp(verdicts, previous, now())
    await api.patch_status(namespace, name, status)
    return status


async def refresh_pools_ready(api: KubeApi, obj: dict[str, Any], *, settings: OperatorSettings,
                              toolkit: Toolkit | None = None, emit: Emit | None = None,
                              now: Callable[[], str] = _now) -> dict[str, Any] | None:
    """The timer's job: re-read the pools' Deployments and update ``PoolsReady`` when it
    changed (a full reconcile when one is missing); returns the status written, or None."""
    tools = toolkit or default_toolkit(settings)
    meta = obj["metadata"]
    name, namespace = meta["name"], meta.get("namespace") or settings.namespace
    previous = (obj.get("status") or {}).get("conditions") or []
    if not any(c.get("type") == "Planned" and c.get("status") == "True" for c in previous):
        return None
    others = live_models(await api.list_llmmodels(namespace), without=name)
    plan = plan_namespace([*others, obj], namespace, tools).plans.get(name)
    if plan is None:
        return None
    verdict = await pools_ready(api, tools.objects(plan, namespace), namespace)
    if verdict.reason == POOLS_MISSING:  # deleted by hand: put them back
        return await reconcile(api, obj, settings=settings, toolkit=tools, emit=emit, now=now)
    old: dict[str, Any] = next((c for c in previous if c.get("type") == "PoolsReady"), {})
    if old.get("status") == verdict.status and old.get("message") == verdict.message:
        return None
    _announce(emit, [verdict], previous)
    stamped = stamp([verdict], previous, now())[0]
    conditions = [stamped if c.get("type") == "PoolsReady" else c for c in previous]
    if not old:
        conditions.append(stamped)
    status = {"conditions": conditions}
    await api.patch_status(namespace, name, status)
    return status


async def refresh(api: KubeApi, obj: dict[str, Any], *, settings: OperatorSettings,
                  toolkit: Toolkit | None = None, emit: Emit | None = None,
                  now: Callable[[], str] = _now) -> dict[str, Any] | None:
    """The timer of a planned model: a full reconcile when the base routing changed, else
    only ``PoolsReady``; returns the status written, or None."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    namespace = obj["metadata"].get("namespace") or settings.namespace
    if any(c.get("type") == "Planned" and c.get("status") == "True" for c in conditions) \
            and await base_changed(api, settings, namespace):
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
        verdict, _ = await rebuild_routing(api, settings, tools, list(planned.plans.values()), namespace)
    if emit is not None:
        emit("Normal" if verdict.status == "True" else "Warning", verdict.reason,
             f"removed from routing: {verdict.message}" if verdict.status == "True" else verdict.message)
    return verdict
