"""The operator's deploy manifests: ``python -m llmmodel.operator_deploy`` writes
``deploy/operator/`` (``--check`` lists stale files and exits 1; a test runs it).

``kubectl apply -k deploy/operator -n NAMESPACE`` into the gateway's namespace: the CRD, a
service account, a namespaced Role and its binding, and one operator replica. Least privilege:

- no ClusterRole. kopf observes namespaces and CRDs cluster-wide only when scanning is on; the
  operator turns it off and serves its own namespace (``kopf_settings``), and API discovery is
  open to every authenticated account. Standalone: no KopfPeering objects either.
- per resource only the verbs the code uses: ``get`` first (an object that exists without the
  LLMModel as its owner is left alone), server-side apply is ``patch``, plus ``create``
  when the object does not exist yet (the API server authorizes that create with the object's
  name: k8s.io/apiserver ``pkg/endpoints/handlers/patch.go``, ``createAuthorizerAttributes``,
  so the ConfigMap rules can name their ConfigMaps). ``list`` and ``delete`` only on the kinds
  a model's objects are (``llmmodel.operator_prune``: objects a spec edit dropped); everything
  else goes with its LLMModel through owner references and the garbage collector.
- the RoleBinding's subject has no namespace: RBAC then takes the binding's own (kubernetes
  ``pkg/registry/rbac/validation/rule.go``, ``appliesToUser``), so ``-n`` places it all.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from routing.render import dump
from routing.render.deploy import IMAGE
from sidecar_runtime.process.files import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = "python -m llmmodel.operator_deploy"
OUT = "deploy/operator"
NAME = "llm-sidecar-operator"
HEALTH_PORT = 8080
ROUTING_CONFIGMAP = "llm-sidecar-routing"
BASE_CONFIGMAP = "llm-sidecar-routing-base"
LABELS = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/part-of": "llm-sidecar"}


def _rule(group: str, resources: list[str], verbs: list[str],
          names: list[str] | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"apiGroups": [group], "resources": resources, "verbs": verbs}
    if names:
        rule["resourceNames"] = names
    return rule


def rules() -> list[dict[str, Any]]:
    """The Role's rules, each with the code that needs it."""
    # an ownership check (get), then server-side apply (create, patch) of a model's objects
    # and, once the routing no longer names them, list by model label and delete those dropped
    applied = ["get", "create", "patch", "list", "delete"]
    return [
        # kopf: watch the LLMModels, patch its finalizer and progress annotations onto them
        _rule("llm-sidecar.dev", ["llmmodels"], ["get", "list", "watch", "patch"]),
        _rule("llm-sidecar.dev", ["llmmodels/status"], ["patch"]),  # reconcile's .status
        _rule("", ["events"], ["create"]),  # kopf.event on the LLMModel
        _rule("", ["configmaps"], ["get"], [BASE_CONFIGMAP, ROUTING_CONFIGMAP]),
        _rule("", ["configmaps"], ["create", "patch"], [ROUTING_CONFIGMAP]),  # get: above
        _rule("", ["services"], applied),
        _rule("apps", ["deployments"], applied),  # get: PoolsReady too
        _rule("autoscaling", ["horizontalpodautoscalers"], applied),  # replicas.max > min
        _rule("networking.k8s.io", ["networkpolicies"], applied),  # who reaches a pool
        _rule("inference.networking.k8s.io", ["inferencepools"], applied),
        _rule("monitoring.coreos.com", ["podmonitors", "prometheusrules"], applied),
    ]


def rbac() -> list[dict[str, Any]]:
    meta = {"name": NAME, "labels": LABELS}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": rules()},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAME},
         "subjects": [{"kind": "ServiceAccount", "name": NAME}]},
    ]


def deployment() -> dict[str, Any]:
    """One replica, replaced (not rolled) so two never reconcile at once (kopf's deployment
    advice); non-root, read-only root, every capability dropped."""
    probe = {"httpGet": {"path": "/healthz", "port": "health"}, "initialDelaySeconds": 10,
             "periodSeconds": 15, "timeoutSeconds": 5, "failureThreshold": 4}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": NAME, "labels": LABELS},
        "spec": {
            "replicas": 1, "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {"app.kubernetes.io/name": NAME}},
            "template": {"metadata": {"labels": LABELS}, "spec": {
                "serviceAccountName": NAME,
                "securityContext": {"runAsNonRoot": True, "runAsUser": 10001,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{
                    "name": "operator", "image": IMAGE, "imagePullPolicy": "IfNotPresent",
                    "args": ["operator", "--standalone", "--liveness", f"0.0.0.0:{HEALTH_PORT}",
                             "--routing-configmap", ROUTING_CONFIGMAP,
                             "--base-configmap", BASE_CONFIGMAP],
                    "ports": [{"name": "health", "containerPort": HEALTH_PORT}],
                    "livenessProbe": probe,
                    "resources": {"requests": {"cpu": "50m", "memory": "128Mi"},
                                  "limits": {"memory": "384Mi"}},
                    "securityContext": {"allowPrivilegeEscalation": False,
                                        "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                }],
                "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "16Mi"}}],
            }}}}


def _header(what: str) -> str:
    return f"# Generated by `{COMMAND}`; edit llmmodel/operator_deploy.py and run it again.\n# {what}\n"


def artifacts() -> dict[str, str]:
    """Path relative to the repository → the text it must hold."""
    from llmmodel.crd import crd_object

    docs = {"crd.yaml": [crd_object()], "rbac.yaml": rbac(), "deployment.yaml": [deployment()]}
    files = {f"{OUT}/{name}": _header("The LLMModel operator (llm-sidecar operator).")
             + "---\n".join(dump(doc) for doc in items) for name, items in docs.items()}
    files[f"{OUT}/kustomization.yaml"] = _header(
        f"kubectl apply -k {OUT} -n NAMESPACE (the gateway's namespace)") + dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": list(docs)})
    return files


def main(argv: Sequence[str] | None = None) -> int:
    return generate(sys.argv[1:] if argv is None else argv, artifacts, ROOT, COMMAND)


if __name__ == "__main__":
    raise SystemExit(main())
