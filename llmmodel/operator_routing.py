"""The routing ConfigMap the operator writes: the base routing YAML merged with every planned
LLMModel whose objects are its own, validated, and merged a model at a time when the whole does
not validate (so one bad model does not freeze the routing of the others).

Uses :mod:`llmmodel.operator_plan` and :mod:`llmmodel.operator_status`; :mod:`llmmodel.operator`
calls :func:`build_routing`, :func:`write_routing`, :func:`routed_models` and :func:`base_changed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from llmmodel.kube_api import FIELD_MANAGER, KubeApi
from llmmodel.operator_plan import NamespacePlan, OperatorSettings, Toolkit, crash_error
from llmmodel.operator_status import Verdict
from llmmodel.plans import ModelPlan
from routing.errors import ConfigError

ROUTING_KEY = "routing.yaml"
BASE_VERSION = "llm-sidecar.dev/base-resource-version"
"""The routing ConfigMap's note of the base ConfigMap version it was merged from."""


def controlled_by(live: dict[str, Any], uid: str) -> bool:
    """Whether ``live`` names the LLMModel of ``uid`` as its controller owner."""
    refs = live.get("metadata", {}).get("ownerReferences") or []
    return any(isinstance(r, dict) and r.get("uid") == uid and r.get("controller") is True for r in refs)


LiveKey = tuple[str, str, str]
"""An object's (apiVersion, kind, name) in the namespace reconciled."""


def live_key(obj: dict[str, Any]) -> LiveKey:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


async def foreign_objects(api: KubeApi, planned: NamespacePlan, namespace: str,
                          live: dict[LiveKey, dict[str, Any]]) -> dict[str, str]:
    """Each planned model some of whose objects exist without it as their controller (made by
    hand, or another model's): applying them (forced) would take them over, and deleting the
    model would then garbage-collect them. Such a model is neither applied nor routed. The
    planned objects that exist go into ``live``."""
    out = {}
    for name, objects in planned.objects.items():
        foreign = []
        for item in objects:
            found = await api.get(item["apiVersion"], item["kind"], namespace, item["metadata"]["name"])
            if found is None:
                continue
            live[live_key(item)] = found
            if not controlled_by(found, planned.uids.get(name, "")):
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
    live: dict[LiveKey, dict[str, Any]] = field(default_factory=dict)
    """The planned objects that exist, as read before anything was applied."""


async def build_routing(api: KubeApi, settings: OperatorSettings, toolkit: Toolkit,
                        planned: NamespacePlan, namespace: str) -> RoutingBuild:
    """Base routing YAML + every planned model whose objects are its own. When the whole does
    not validate, the models are merged a unit at a time, oldest first, and a unit that breaks
    it is refused, so one bad model does not freeze the routing of the others. When no model
    merges at all, nothing is written (the old routing keeps serving: a base edit or a merge
    bug must not drop every model) and every model counts as refused."""
    live: dict[LiveKey, dict[str, Any]] = {}
    foreign = await foreign_objects(api, planned, namespace, live)
    base = await api.get("v1", "ConfigMap", namespace, settings.base_configmap)
    out = RoutingBuild(base=base, not_owned=foreign, live=live)
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
