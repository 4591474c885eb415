"""The Kubernetes objects of one planned model: per pool a vLLM Deployment with the planned
flags, its headless Service, an InferencePool, a PodMonitor and, when ``replicas.max`` is above
``replicas.min``, a HorizontalPodAutoscaler (:func:`autoscaler`); per model a PrometheusRule of
SLO burn-rate alerts (:mod:`llmmodel.alerts`).

Weights: every pod reads them once before vLLM starts, in an init container (``cat`` of every
file to ``/dev/null``), so the node's page cache holds them and vLLM's own load runs at memory
speed; the startup probe then mostly waits for that read. Remote weights (s3://, gs://, hf://)
are first fetched into an ``emptyDir``; the cluster provides the credentials (IRSA, Workload
Identity, an ``HF_TOKEN`` secret) as it does for any pod.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Sequence
from typing import Any

from llmmodel.alerts import prometheus_rule
from llmmodel.plans import ModelPlan, PoolPlan
from llmmodel.routing_merge import POOL_PORT
from llmmodel.spec import LoadedModel
from routing.errors import Problem
from routing.render.deploy import EXTPROC, GATEWAY
from routing.render.netpol import policy
from routing.yamlsrc import Path

DEFAULT_IMAGE = "vllm/vllm-openai:v0.10.2"
"""The vLLM the planned flags are written for: ``--runner pooling`` (embedding pools) came in
v0.10.1 (vllm-project/vllm#21470) and replaced ``--task embed``."""
MODEL_LABEL = "llm-sidecar.dev/model"
POOL_LABEL = "llm-sidecar.dev/pool"
GPU_CLASS_LABEL = "llm-sidecar.dev/gpu-class"
"""Node label naming the GPU class of the catalog (``A100-80GB``); GPU Feature Discovery's
``nvidia.com/gpu.product`` spells products its own way (``NVIDIA-A100-SXM4-80GB``), so nodes
are labelled with the catalog's name: ``kubectl label node N llm-sidecar.dev/gpu-class=...``."""
EXTPROC_SERVICE = EXTPROC
"""extproc is the pools' endpoint picker (it names the pod as the inference extension's
protocol does); its Service and gRPC port as ``deploy/k8s`` names them."""
EXTPROC_PORT = 50051
MOUNT = "/models"
HF_TOKEN_SECRET = "hf-token"
"""Secret (key ``token``) whose value the fetch of an hf:// model sends, when it exists."""
AWS_CLI_IMAGE = "amazon/aws-cli:2.22.35"
GCLOUD_IMAGE = "gcr.io/google.com/cloudsdktool/google-cloud-cli:502.0.0-slim"
_KIND_ORDER = ("Deployment", "HorizontalPodAutoscaler", "Service", "NetworkPolicy",
               "InferencePool", "PodMonitor", "PrometheusRule")
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]")


def label_value(text: str) -> str:
    """``text`` as a label value: 63 characters of ``[A-Za-z0-9_.-]``, alphanumeric at the ends."""
    return _LABEL_VALUE.sub("-", text)[:63].strip("-_.") or "x"


def labels(plan: ModelPlan, pool: PoolPlan | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/part-of": "llm-sidecar",
           "app.kubernetes.io/managed-by": "llm-sidecar-onboard", MODEL_LABEL: plan.name}
    if pool is not None:
        out["app.kubernetes.io/name"] = pool.name
        out[POOL_LABEL] = pool.name
    return out


def _warm(path: str) -> str:
    quoted = shlex.quote(path)
    return f"find {quoted} -type f -exec cat {{}} + > /dev/null\necho page cache warmed: {quoted}"


def node_paths(model: LoadedModel) -> list[tuple[Path, str]]:
    """(where, path) of each ``modelPath`` of ``model`` (its own, its canary's) that is a path on
    the GPU node: the pods mount it with ``hostPath``."""
    canary = model.spec.canary
    found = [(("spec", "modelPath"), model.spec.model_path),
             (("spec", "canary", "modelPath"), canary.model_path if canary else None)]
    return [(at, path) for at, path in found if path is not None and "://" not in path]


def relative_path_problems(models: Sequence[LoadedModel]) -> list[Problem]:
    """A relative path on the GPU node cannot be mounted (``hostPath`` needs an absolute one);
    ``plan`` reads it from here, but a Deployment has no "here"."""
    return [model.problem(at, (
        f"{path!r} is relative: a pod mounts a local modelPath from the GPU node (hostPath), "
        "which needs an absolute path like /mnt/models/NAME"))
        for model in models for at, path in node_paths(model) if not posixpath.isabs(path)]


CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False, "privileged": False,
    "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
"""The pools' containers (vLLM and the weights' init container): no privilege, no capability,
the runtime's default syscall filter. Not ``runAsNonRoot``: the vLLM image runs as root and
writes its caches under ``/root``."""


def weights(model_path: str, image: str) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """(the ``models`` volume, the path vLLM loads, the ``weights`` init container) for one
    of the forms ``spec.modelPath`` takes."""
    scheme, sep, rest = model_path.partition("://")
    mount: dict[str, Any] = {"name": "models", "mountPath": MOUNT}
    fetch = ""
    if not sep:  # a path on the GPU node
        volume: dict[str, Any] = {"name": "models", "hostPath": {"path": model_path}}
        path = posixpath.join(MOUNT, posixpath.basename(model_path.rstrip("/")) or "model")
        mount = {"name": "models", "mountPath": path, "readOnly": True}
    elif scheme == "pvc":
        claim, _, inner = rest.partition("/")
        volume = {"name": "models", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        path = posixpath.join(MOUNT, inner) if inner else MOUNT
        mount["readOnly"] = True
    else:
        volume = {"name": "models", "emptyDir": {}}
        path = posixpath.join(MOUNT, rest.strip("/"))
        src, dst = shlex.quote(model_path), shlex.quote(path)
        if scheme == "hf":  # the vLLM image ships huggingface_hub's CLI
            fetch = f"huggingface-cli download {shlex.quote(rest)} --local-dir {dst}"
        elif scheme == "s3":
            fetch = f"aws s3 {'cp' if rest.endswith('.gguf') else 'sync'} {src} {dst}"
            image = AWS_CLI_IMAGE
        else:
            fetch = f"mkdir -p {shlex.quote(posixpath.dirname(path))}\ngcloud storage cp -r {src} {dst}"
            image = GCLOUD_IMAGE
    script = "set -eu\n" + (fetch + "\n" if fetch else "") + _warm(path)
    init: dict[str, Any] = {"name": "weights", "image": image, "imagePullPolicy": "IfNotPresent",
                            "command": ["sh", "-c", script], "volumeMounts": [mount],
                            "securityContext": CONTAINER_SECURITY}
    if scheme == "hf":  # gated models need a token; the Secret is optional for open ones
        init["env"] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": HF_TOKEN_SECRET, "key": "token", "optional": True}}}]
    return volume, path, init


def _probe(period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


def startup_failures(pool: PoolPlan) -> int:
    """Startup probe tries, 10 s apart: 10 minutes, and 10 s more per GiB of weights (loading
    onto the GPUs and CUDA graph capture grow with the model)."""
    return 60 + pool.weights_bytes // (1 << 30)


def _unless_planned(pool: PoolPlan, *flags: tuple[str, str]) -> list[str]:
    """``flags`` the planner did not set itself (vLLM refuses a flag given twice only by
    taking the last, which would hide a disagreement)."""
    return [part for flag, value in flags if flag not in pool.vllm_args for part in (flag, value)]


def deployment(plan: ModelPlan, pool: PoolPlan, *, namespace: str, image: str) -> dict[str, Any]:
    volume, path, init = weights(pool.model_path, image)
    gpus = str(pool.gpus_per_replica)
    memory = str(pool.host_memory_bytes)
    args = [*_unless_planned(pool, ("--model", path), ("--served-model-name", pool.serves),
                             ("--port", str(POOL_PORT))), *pool.vllm_args]
    mounts: list[dict[str, Any]] = [{"name": "models", "mountPath": init["volumeMounts"][0]["mountPath"],
                                     "readOnly": True}]
    volumes = [volume]
    if pool.tensor_parallel_size > 1:
        # Tensor-parallel workers share tensors through /dev/shm, which a container's default
        # 64 MiB cannot hold.
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    pod_labels = labels(plan, pool)
    container = {
        "name": "vllm", "image": image, "imagePullPolicy": "IfNotPresent", "args": args,
        "ports": [{"name": "http", "containerPort": POOL_PORT}],
        "resources": {"limits": {"nvidia.com/gpu": gpus, "memory": memory},
                      "requests": {"nvidia.com/gpu": gpus, "memory": memory}},
        "volumeMounts": mounts,
        "securityContext": CONTAINER_SECURITY,
        "startupProbe": _probe(10, startup_failures(pool)),
        "readinessProbe": _probe(5, 3),
        "livenessProbe": _probe(10, 6),
    }
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": pool.name, "namespace": namespace, "labels": pod_labels},
        "spec": {
            **({} if autoscaled(plan, pool) else {"replicas": fixed_replicas(plan, pool)}),
            "selector": {"matchLabels": {POOL_LABEL: pool.name}},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "terminationGracePeriodSeconds": 60,
                    # vLLM never calls the Kubernetes API: no token for a compromised pod to use.
                    "automountServiceAccountToken": False,
                    "nodeSelector": {GPU_CLASS_LABEL: label_value(pool.gpu_class)},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                     "effect": "NoSchedule"}],
                    "initContainers": [init],
                    "containers": [container],
                    "volumes": volumes,
                }}}}


WAITING_METRIC = "vllm_num_requests_waiting"
"""The per-pod metric the HorizontalPodAutoscalers read from the custom metrics API
(``custom.metrics.k8s.io``): vLLM's gauge ``vllm:num_requests_waiting`` (requests queued for
the running batch) as prometheus-adapter exposes it. Kubernetes itself serves no such metric:
the cluster needs prometheus-adapter (or another custom metrics server) with a rule that
serves vLLM's series under this name, per pod: :data:`ADAPTER_RULE`. The vLLM production
stack's own adapter rule uses the same name (vllm-project/production-stack
``observability/prom-adapter.yaml``, which sums it per namespace). Without such a rule the HPA
reports ``FailedGetPodsMetric`` and leaves the replicas where they are (at least
``minReplicas``): nothing breaks, nothing scales."""
ADAPTER_RULE = """\
rules:
- seriesQuery: 'vllm:num_requests_waiting{namespace!="",pod!=""}'
  resources:
    overrides:
      namespace: {resource: namespace}
      pod: {resource: pod}
  name:
    matches: "^vllm:num_requests_waiting$"
    as: "vllm_num_requests_waiting"
  metricsQuery: 'sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)'
"""
"""The prometheus-adapter rule the cluster needs for :data:`WAITING_METRIC`, in the adapter's
config file (the prometheus-adapter Helm chart takes the list as ``rules.custom``). Nothing here
installs it: the adapter and its config belong to the cluster's monitoring. ``namespace`` and
``pod`` are the labels the PodMonitor's scrape attaches to every series of a pool's pods."""
SCALE_DOWN_WINDOW_S = 600
"""Scale-down waits for 10 minutes of lower proposals, and removes one pod per 5 minutes: an
empty queue says capacity suffices, not how much of it is spare, so the HPA would otherwise
drop straight to ``minReplicas`` after every burst, and a GPU pod takes minutes (page-cache
warm-up, weight load, CUDA graphs: :func:`startup_failures`) to come back."""


def autoscaled(plan: ModelPlan, pool: PoolPlan) -> bool:
    """Whether an HPA sizes ``pool``: a pool of the model's own name whose ``replicas.max`` is
    above ``replicas.min``. A canary pool gets a small share of the traffic and keeps one
    replica (:func:`fixed_replicas`)."""
    replicas = plan.model.spec.replicas
    return pool.serves == plan.name and replicas.max > replicas.min


def fixed_replicas(plan: ModelPlan, pool: PoolPlan) -> int:
    """The Deployment's ``replicas`` when no HPA sizes the pool: one for a canary pool, else
    ``replicas.min`` (equal to ``max``)."""
    return 1 if pool.serves != plan.name else plan.model.spec.replicas.min


def waiting_target(pool: PoolPlan) -> int:
    """Requests waiting per pod, on average, above which the HPA adds pods: a quarter of the
    pool's ``--max-num-seqs``, at least one.

    vLLM queues a request only when its running batch (``max_num_seqs`` sequences, or the KV
    cache) is full; a queued request starts when running ones finish. A backlog of a quarter
    batch per pod costs each newcomer about a quarter of a request's run time before its first
    token, which the time-to-first-token SLO notices, while shorter queues are bursts the next
    few engine steps absorb. A pool of one sequence (above 32K context) scales when on average
    one request waits per pod: the second request's first token then waits for the whole first
    request."""
    return max(1, pool.max_num_seqs // 4)


def autoscaler(plan: ModelPlan, pool: PoolPlan, *, namespace: str) -> dict[str, Any]:
    """The pool's HorizontalPodAutoscaler (``autoscaling/v2``): ``replicas.min`` to
    ``replicas.max`` pods, on the queue metric :data:`WAITING_METRIC` (which needs
    prometheus-adapter; see there).

    ``minReplicas`` is ``max(1, replicas.min)``: an HPA scales to zero only behind the alpha
    ``HPAScaleToZero`` feature gate, so ``min: 0`` runs one pod. The pool's Deployment then
    carries no ``replicas``: the operator applies it with force on every reconcile, and a
    ``replicas`` there would reset what the HPA set. (A Deployment that had one before keeps
    its value: :mod:`llmmodel.operator_handover` hands the field over first.)"""
    replicas = plan.model.spec.replicas
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": pool.name, "namespace": namespace, "labels": labels(plan, pool)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": pool.name},
            "minReplicas": max(1, replicas.min), "maxReplicas": replicas.max,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": WAITING_METRIC},
                "target": {"type": "AverageValue", "averageValue": str(waiting_target(pool))}}}],
            "behavior": {"scaleDown": {
                "stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S,
                "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}]}},
        }}


def service(plan: ModelPlan, pool: PoolPlan, *, namespace: str) -> dict[str, Any]:
    """Headless: its DNS name lists every ready pod (the routing YAML's endpoint)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": pool.name, "namespace": namespace, "labels": labels(plan, pool)},
            "spec": {"clusterIP": "None", "selector": {POOL_LABEL: pool.name},
                     "ports": [{"name": "http", "port": POOL_PORT, "targetPort": "http"}]}}


def inference_pool(plan: ModelPlan, pool: PoolPlan, *, namespace: str) -> dict[str, Any]:
    """The Gateway API Inference Extension's ``InferencePool`` (v1: ``selector.matchLabels``,
    ``targetPorts``, ``endpointPickerRef``), for gateways that route by it."""
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": pool.name, "namespace": namespace, "labels": labels(plan, pool)},
            "spec": {"selector": {"matchLabels": {POOL_LABEL: pool.name}},
                     "targetPorts": [{"number": POOL_PORT}],
                     "endpointPickerRef": {"name": EXTPROC_SERVICE, "kind": "Service",
                                           "port": {"number": EXTPROC_PORT},
                                           "failureMode": "FailClose"}}}


def pod_monitor(plan: ModelPlan, pool: PoolPlan, *, namespace: str) -> dict[str, Any]:
    """Prometheus scrapes vLLM's own ``/metrics`` (``vllm:*``) of every pod of the pool."""
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": {"name": pool.name, "namespace": namespace, "labels": labels(plan, pool)},
            "spec": {"selector": {"matchLabels": {POOL_LABEL: pool.name}},
                     "podMetricsEndpoints": [{"port": "http", "path": "/metrics",
                                              "interval": "15s"}]}}


def network_policy(plan: ModelPlan, pool: PoolPlan, *, namespace: str) -> dict[str, Any]:
    """Only the gateway (Envoy), extproc (the picker's scrapes, the canary verdict's shadows) and
    Prometheus reach a pool's vLLM port, as ``render``'s policies admit to its own pools: a
    vLLM server checks no caller, so any other pod of the cluster could spend its GPUs."""
    doc = policy(pool.name, [([GATEWAY, EXTPROC], ["http"]), ([], ["http"])])
    doc["metadata"] = {"name": pool.name, "namespace": namespace,
                       "labels": labels(plan, pool)}
    return doc


def model_objects(plan: ModelPlan, *, namespace: str,
                  image: str = DEFAULT_IMAGE) -> list[dict[str, Any]]:
    """Every object of ``plan``, sorted by kind then name."""
    out: list[dict[str, Any]] = []
    for pool in plan.pools:
        if autoscaled(plan, pool):
            out.append(autoscaler(plan, pool, namespace=namespace))
        out += [deployment(plan, pool, namespace=namespace, image=image),
                service(plan, pool, namespace=namespace),
                network_policy(plan, pool, namespace=namespace),
                inference_pool(plan, pool, namespace=namespace),
                pod_monitor(plan, pool, namespace=namespace)]
    out.append(prometheus_rule(plan, namespace=namespace, labels=labels(plan)))
    return sorted(out, key=lambda o: (_KIND_ORDER.index(o["kind"]), o["metadata"]["name"]))
