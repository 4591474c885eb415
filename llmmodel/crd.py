"""The ``LLMModel`` CustomResourceDefinition, its schema generated from
:class:`llmmodel.spec.LLMModelSpec` so the cluster and ``llm-sidecar plan`` accept the same
fields.

Kubernetes takes a *structural* OpenAPI v3 schema (apiextensions.k8s.io/v1): no ``$ref``, a
``type`` on every node (except ``x-kubernetes-int-or-string`` and
``x-kubernetes-preserve-unknown-fields`` nodes), no ``type``/``description``/``default`` inside
``anyOf``, ``exclusiveMinimum`` as a boolean beside ``minimum``, no ``const``, and no
``additionalProperties: false`` (unknown fields are pruned instead). Defaults are left to the
loader, so the API server stores what the team wrote.
"""

from __future__ import annotations

from typing import Any

from llmmodel.spec import API_VERSION, KIND, LLMModelSpec

GROUP, VERSION = API_VERSION.split("/")
PLURAL = "llmmodels"
_KEPT = ("type", "description", "required", "enum", "minimum", "maximum", "minLength",
         "maxLength", "pattern", "minItems", "maxItems", "format")


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Pydantic's JSON schema ``node`` as a structural schema (``$ref`` of ``defs`` inlined)."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return structural(merged, defs)
    for junctor in ("anyOf", "oneOf"):
        if junctor in node:
            choices = [c for c in node[junctor] if c.get("type") != "null"]
            rest = {k: v for k, v in node.items() if k != junctor}
            if len(choices) == 1:
                return structural({**choices[0], **rest}, defs)
            types = {c.get("type") for c in choices}
            out: dict[str, Any] = {}
            if "description" in rest:
                out["description"] = rest["description"]
            if types == {"string", "integer"}:
                out["x-kubernetes-int-or-string"] = True
            else:  # e.g. a number or a string: the loader checks it
                out["x-kubernetes-preserve-unknown-fields"] = True
            return out
    out = {key: node[key] for key in _KEPT if key in node}
    if "const" in node:
        out["enum"] = [node["const"]]
    for bound, flag in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), int | float) and not isinstance(node.get(bound), bool):
            out[flag] = node[bound]
            out[bound] = True
    if "properties" in node:
        out["properties"] = {k: structural(v, defs) for k, v in node["properties"].items()}
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(node["additionalProperties"], defs)
    if isinstance(node.get("items"), dict):
        out["items"] = structural(node["items"], defs)
    return out


def spec_schema() -> dict[str, Any]:
    raw = LLMModelSpec.model_json_schema(by_alias=True)
    return structural(raw, raw.get("$defs", {}))


def _status_schema() -> dict[str, Any]:
    condition = {"type": "object", "required": ["type", "status"], "properties": {
        "type": {"type": "string"},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer"}}}
    return {"type": "object", "properties": {
        "plan": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                 "description": "The planner's pools (llm-sidecar plan --json of this model)."},
        "conditions": {"type": "array", "items": condition, "x-kubernetes-list-type": "map",
                       "x-kubernetes-list-map-keys": ["type"],
                       "description": "Planned, PoolsReady, Routed."},
        "observedGeneration": {"type": "integer"}}}


def _condition_column(name: str, condition: str) -> dict[str, Any]:
    return {"name": name, "type": "string",
            "jsonPath": f'.status.conditions[?(@.type=="{condition}")].status'}


def crd_object() -> dict[str, Any]:
    """``llmmodels.llm-sidecar.dev``, namespaced, with the status subresource."""
    schema = {"type": "object", "required": ["spec"], "properties": {
        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
        "metadata": {"type": "object"}, "spec": spec_schema(), "status": _status_schema()}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}",
                     "labels": {"app.kubernetes.io/part-of": "llm-sidecar"}},
        "spec": {
            "group": GROUP, "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": KIND.lower(), "kind": KIND,
                      "listKind": f"{KIND}List", "shortNames": ["llmm"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": schema},
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "GPU", "type": "string", "jsonPath": ".status.plan.pools[0].gpu_class"},
                    {"name": "Pools", "type": "string", "jsonPath": ".status.plan.pools[*].name"},
                    _condition_column("Planned", "Planned"),
                    _condition_column("Ready", "PoolsReady"),
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}],
            }]}}
