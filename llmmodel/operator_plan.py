"""The operator's settings and the namespace's LLMModels planned together.

:class:`OperatorSettings` (the flags), :class:`Toolkit` (the pure steps reconcile chains, with
:func:`default_toolkit` binding the real planner, object writer and routing merge) and
:func:`plan_namespace`, which plans each model alone and then all together, so a bad or crashing
model gets its own error and never stops the others. Imports no other operator module.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmmodel.k8s import node_paths, relative_path_problems
from llmmodel.kube_api import LLMMODEL_API_VERSION, LLMMODEL_KIND
from llmmodel.plans import ModelPlan
from llmmodel.spec import LoadedModel, model_from_object
from routing.errors import ConfigError, Problem

log = logging.getLogger(__name__)


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
    """(base routing text, its source name, plans, namespace) → the merged routing YAML, which
    ``check`` passes (:func:`llmmodel.routing_merge.merged_yaml` validates what it writes);
    raises :class:`ConfigError` otherwise."""


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
