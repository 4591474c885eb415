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
   is written and the old routing keeps serving;
4. write ``.status``: ``plan``, ``observedGeneration`` and the conditions ``Planned``,
   ``PoolsReady`` and ``Routed`` (``lastTransitionTime`` moves only when a status flips).

The kopf handlers (:mod:`llmmodel.operator_cli`) are thin: they call :func:`reconcile`,
:func:`refresh` (a timer) and :func:`remove` with the real API client; nothing here imports
kopf, so every step is tested by calling it.
"""

from __future__ import annotations

import copy
import datetime
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from llmmodel.k8s import node_paths, relative_path_problems
from llmmodel.kube_api import FIELD_MANAGER, LLMMODEL_API_VERSION, LLMMODEL_KIND, KubeApi
from llmmodel.plans import ModelPlan
from llmmodel.spec import LoadedModel, model_from_object
from routing.errors import ConfigError, Problem

ROUTING_KEY = "routing.yaml"
ROUTING_NOT_UPDATED = "RoutingNotUpdated"
PLANNING_FAILED = "PlanningFailed"
"""Planned=False: the planner or object writer crashed on this model (a bug, logged)."""
NOT_OWNED = "ObjectNotOwned"
"""Planned=False: an object the model would apply exists and is not controlled by it."""
ROUTING_REFUSED = "RoutingRefused"
"""Planned=False and Routed=False: the merged routing YAML refuses this model (the others are
routed without it), so nothing of it is applied."""
RETRIED = (NOT_OWNED, ROUTING_REFUSED)
"""Planned reasons the timer reconciles again: they clear when something else changes (the
object in the way is deleted, a clashing model or base entry goes)."""
POOLS_MISSING = "DeploymentMissing"
BASE_VERSION = "llm-sidecar.dev/base-resource-version"
"""The routing ConfigMap's note of the base ConfigMap version it was merged from."""
READY_INTERVAL_S = 30.0
"""How often the timer re-reads the pools' Deployments for ``PoolsReady``."""

log = logging.getLogger(__name__)

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
    allow_gateway_limits: bool = False
    """Whether an LLMModel may set ``limits.tenant`` or ``limits.api_key``. Those merge into the
    gateway's levels of that name, limiting every model's callers: off, a namespace user who may
    only create LLMModels cannot change them."""


def host_path_problems(models: Sequence[LoadedModel]) -> list[Problem]:
    """A local ``modelPath`` (the model's or its canary's) of each of ``models``: refused by an
    operator started without ``--allow-host-paths``."""
    return [model.problem(at, (
        f"{path!r} is a path on the GPU node, mounted with hostPath: this operator refuses it "
        "(start it with --allow-host-paths to allow it); use pvc://, s3://, gs:// or hf://"))
        for model in models for at, path in node_paths(model)]


def gateway_limit_problems(models: Sequence[LoadedModel]) -> list[Problem]:
    """``limits.tenant`` and ``limits.api_key`` of each of ``models``: refused by an operator
    started without ``--allow-gateway-limits``."""
    problems = []
    for model in models:
        limits = model.spec.limits
        for key in ("tenant", "api_key"):
            if limits is not None and getattr(limits, key) is not None:
                problems.append(model.problem(("spec", "limits", key), (
                    f"limits.{key} changes the gateway's {key} limits of every model: this "
                    "operator refuses it (start it with --allow-gateway-limits to allow it); "
                    "limits.model limits this model alone")))
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
        problems = (relative_path_problems(models) if settings.allow_host_paths
                    else host_path_problems(models))
        if not settings.allow_gateway_limits:
            problems += gateway_limit_problems(models)
        if problems:
            raise ConfigError(problems)
        return plan_models(models, inventory)

    return Toolkit(plan=plan, objects=objects, merge=merge)


@dataclass
class NamespacePlan:
    """The namespace's LLMModels planned together: a plan and its objects per model that plans,
    the error of each that does not (``failed``: those whose planning crashed), and ``joint``
    when they plan alone but not together."""

    plans: dict[str, ModelPlan] = field(default_factory=dict)
    objects: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Each planned model's objects, owned by it: what reconcile applies."""
    errors: dict[str, ConfigError] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    joint: ConfigError | None = None
    joint_failed: bool = False
    uids: dict[str, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    """Model names, oldest first: who keeps its routing when two cannot be merged together."""


def crash_error(source: str, step: str, err: Exception) -> ConfigError:
    """An unexpected exception of ``step`` (a bug, or input the planner was not hardened
    against), logged with its traceback, as the short ``source:1:`` message a status shows."""
    log.error("%s: %s failed", source, step, exc_info=err)
    text = str(err).splitlines()[0][:200] if str(err).strip() else ""
    return ConfigError.at(source, 1, (
        f"{step} failed: {type(err).__name__}{': ' + text if text else ''} (an operator bug: "
        "its log has the details)"))


def plan_namespace(objs: Sequence[dict[str, Any]], namespace: str, toolkit: Toolkit) -> NamespacePlan:
    """Each model alone first (a bad one is set aside with its own error, a crash included, so
    it never stops the others), then the good ones together (so a canary declared as another
    LLMModel gets no pool of its own)."""
    out = NamespacePlan()
    good: list[LoadedModel] = []
    for obj in sorted(objs, key=lambda o: (str(o.get("metadata", {}).get("creationTimestamp", "")),
                                           str(o.get("metadata", {}).get("name", "?")))):
        meta = obj.get("metadata", {})
        name = str(meta.get("name", "?"))
        out.order.append(name)
        out.uids[name] = str(meta.get("uid", ""))
        try:
            model = model_from_object(obj, f"{namespace}/{name}")
            toolkit.plan([model])
        except ConfigError as err:
            out.errors[name] = err
            continue
        except Exception as err:  # one model's crash must not stop the others
            out.errors[name] = crash_error(f"{namespace}/{name}", "planning", err)
            out.failed.add(name)
            continue
        good.append(model)
    try:
        plans = toolkit.plan(good) if good else []
    except ConfigError as err:
        out.joint = err
        return out
    except Exception as err:  # each model still gets its status
        out.joint = crash_error(namespace, f"planning {', '.join(m.name for m in good)} together", err)
        out.joint_failed = True
        return out
    owners = {str(o.get("metadata", {}).get("name")): o for o in objs}
    for plan in plans:
        try:
            out.objects[plan.name] = [owned(o, owners[plan.name], namespace)
                                      for o in toolkit.objects(plan, namespace)]
        except Exception as err:  # as above, for the object writer
            out.errors[plan.name] = crash_error(f"{namespace}/{plan.name}", "writing its objects", err)
            out.failed.add(plan.name)
            continue
        out.plans[plan.name] = plan
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


def controlled_by(live: dict[str, Any], uid: str) -> bool:
    """Whether ``live`` names the LLMModel of ``uid`` as its controller owner."""
    refs = live.get("metadata", {}).get("ownerReferences") or []
    return any(isinstance(r, dict) and r.get("uid") == uid and r.get("controller") is True for r in refs)


async def foreign_objects(api: KubeApi, planned: NamespacePlan, namespace: str) -> dict[str, str]:
    """Each planned model some of whose objects exist without it as their controller (made by
    hand, or another model's): applying them (forced) would take them over, and deleting the
    model would then garbage-collect them. Such a model is neither applied nor routed."""
    out = {}
    for name, objects in planned.objects.items():
        foreign = []
        for item in objects:
            live = await api.get(item["apiVersion"], item["kind"], namespace, item["metadata"]["name"])
            if live is not None and not controlled_by(live, planned.uids.get(name, "")):
                foreign.append(f"{item['kind']} {namespace}/{item['metadata']['name']}")
        if foreign:
            one = len(foreign) == 1
            out[name] = (f"{', '.join(foreign)} already exist{'s' if one else ''} and this LLMModel "
                         f"does not own {'it' if one else 'them'}: nothing of the model was applied "
                         f"(delete or rename {'that object' if one else 'those objects'}, or rename "
                         "the model)")
    return out


def merge_units(plans: dict[str, ModelPlan], order: Sequence[str]) -> list[list[str]]:
    """The planned models in ``order``, grouped so a model and the declared model it names as
    its canary are routed (or refused) together: neither merges without the other."""
    group = {name: {name} for name in plans}
    for plan in plans.values():
        canary = plan.model.spec.canary
        if canary is not None and canary.model in plans:
            joined = group[plan.name] | group[canary.model]
            for name in joined:
                group[name] = joined
    rank = {name: i for i, name in enumerate(order)}
    units, seen = [], set()
    for name in sorted(plans, key=lambda n: (rank.get(n, len(rank)), n)):
        if name not in seen:
            seen |= group[name]
            units.append(sorted(group[name], key=lambda n: (rank.get(n, len(rank)), n)))
    return units


@dataclass
class RoutingBuild:
    """The routing YAML reconcile would write: ``text`` (None: write nothing, ``failure`` says
    why), the models the merge refused and those whose objects are not theirs (neither is in
    ``text``), each with its message."""

    base: dict[str, Any] | None
    text: str | None = None
    failure: Verdict | None = None
    refused: dict[str, str] = field(default_factory=dict)
    not_owned: dict[str, str] = field(default_factory=dict)


async def build_routing(api: KubeApi, settings: OperatorSettings, toolkit: Toolkit,
                        planned: NamespacePlan, namespace: str) -> RoutingBuild:
    """Base routing YAML + every planned model whose objects are its own. When the whole does
    not validate, the models are merged a unit at a time, oldest first, and a unit that breaks
    it is refused, so one bad model does not freeze the routing of the others. When no model
    merges at all, nothing is written (the old routing keeps serving: a base edit or a merge
    bug must not drop every model) and every model counts as refused."""
    from routing.loader import validate
    from routing.yamlsrc import load_yaml

    foreign = await foreign_objects(api, planned, namespace)
    base = await api.get("v1", "ConfigMap", namespace, settings.base_configmap)
    out = RoutingBuild(base=base, not_owned=foreign)
    text = (base or {}).get("data", {}).get(ROUTING_KEY)
    if not isinstance(text, str):
        out.failure = Verdict("Routed", "False", "BaseConfigMissing",
                              f"ConfigMap {namespace}/{settings.base_configmap} has no {ROUTING_KEY}: "
                              "put the gateway's routing YAML there (it may declare no clusters or "
                              "models)")
        return out
    source = f"configmap/{settings.base_configmap}/{ROUTING_KEY}"
    plans = {name: plan for name, plan in planned.plans.items() if name not in foreign}

    def attempt(names: Sequence[str], adding: Sequence[str]) -> str:
        try:
            merged = toolkit.merge(text, source, [plans[n] for n in names], namespace)
            validate(load_yaml(merged, f"configmap/{settings.routing_configmap}/{ROUTING_KEY}"))
        except ConfigError:
            raise
        except Exception as err:  # a merge crash refuses these models only
            raise crash_error(namespace, f"merging {', '.join(adding) or 'no model'} into the routing",
                              err) from None
        return merged

    try:
        out.text = attempt(list(plans), list(plans))
        return out
    except ConfigError as err:
        whole = err
    accepted: list[str] = []
    for unit in merge_units(plans, planned.order):
        try:
            out.text = attempt([*accepted, *unit], unit)
            accepted += unit
        except ConfigError as err:
            out.refused.update({name: str(err) for name in unit})
    if out.text is None:  # no model merges: most likely the base, or a merge bug hitting all
        out.refused = {name: str(whole) for name in plans}
        out.failure = Verdict("Routed", "False", "RoutingInvalid",
                              f"the routing YAML was not updated (the old one keeps serving): {whole}")
    return out


async def write_routing(api: KubeApi, settings: OperatorSettings, build: RoutingBuild,
                        namespace: str) -> tuple[Verdict, set[str]]:
    """Write the built routing ConfigMap. Returns how it went and the models the written (or,
    when nothing was written, the current) ConfigMap routes."""
    if build.text is None:
        failure = build.failure or Verdict("Routed", "False", "RoutingInvalid", "no routing YAML")
        return failure, await routed_models(api, settings, namespace)
    await api.apply({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": settings.routing_configmap, "namespace": namespace,
                     "labels": {"app.kubernetes.io/part-of": "llm-sidecar",
                                "app.kubernetes.io/managed-by": "llm-sidecar-operator"},
                     "annotations": {BASE_VERSION: _version(build.base)}},
        "data": {ROUTING_KEY: build.text}}, field_manager=FIELD_MANAGER)
    return Verdict("Routed", "True", "RoutingUpdated", "routing ConfigMap updated"), _models_of(build.text)


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


def _unapplied(previous: Sequence[dict[str, Any]], planned: Verdict, routed: bool,
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


async def reconcile(api: KubeApi, obj: dict[str, Any], *, settings: OperatorSettings,
                    toolkit: Toolkit | None = None, emit: Emit | None = None,
                    now: Callable[[], str] = _now) -> dict[str, Any]:
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
        verdicts = _unapplied(previous,
                              Verdict("Planned", "False", reason, str(error or "not planned")),
                              routed, not_routed)
    else:
        plan, objects = planned.plans[name], planned.objects[name]
        build = await build_routing(api, settings, tools, planned, namespace)
        applied = name not in build.not_owned and name not in build.refused
        if applied:
            for item in objects:
                await api.apply(item, field_manager=FIELD_MANAGER)
        routing, models = await write_routing(api, settings, build, namespace)
        if name in build.not_owned:
            verdicts = _unapplied(previous,
                                  Verdict("Planned", "False", NOT_OWNED, build.not_owned[name]),
                                  name in models, not_routed)
        elif name in build.refused:
            message = build.refused[name]
            verdicts = _unapplied(
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
    objects = plan_namespace([*others, obj], namespace, tools).objects.get(name)
    if objects is None:
        return None
    verdict = await pools_ready(api, objects, namespace)
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
