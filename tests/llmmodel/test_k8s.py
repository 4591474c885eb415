"""The Kubernetes objects of a planned model: valid for the API server, carrying every planned
flag and resource, and SLO alerts on metrics extproc really exports; the LLMModel CRD's schema
is one Kubernetes accepts and matches what ``llm-sidecar plan`` accepts."""

from __future__ import annotations

import pathlib
import re
from typing import Any, get_args

import jsonschema
import pytest
import yaml
from kubernetes_validate import ValidationError, latest_version, validate

from extproc.records import Outcome
from llmmodel.alerts import WINDOWS
from llmmodel.crd import crd_object
from llmmodel.k8s import ADAPTER_RULE, MODEL_LABEL, POOL_LABEL, WAITING_METRIC, model_objects
from tests.llmmodel.factories import model_plan

REPO = pathlib.Path(__file__).resolve().parents[2]
CORE_KINDS = ("Deployment", "HorizontalPodAutoscaler", "Service", "CustomResourceDefinition")


def objects(**kwargs: Any) -> list[dict[str, Any]]:
    return model_objects(model_plan(**kwargs), namespace="llm")


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return found


@pytest.mark.parametrize("model_path", ["pvc://models/contract-v2", "s3://models/contract-v2.gguf",
                                        "hf://meta-llama/Llama-2-13b-hf", "gs://bucket/llama",
                                        "/mnt/models/llama"])
def test_core_objects_match_their_kubernetes_schema(model_path: str) -> None:
    docs = [*objects(model_path=model_path, gpus=2, replicas={"min": 1, "max": 4},
                     canary={"model": "contract-review-v3", "percent": 5}), crd_object()]
    checked = [d for d in docs if d["kind"] in CORE_KINDS]
    assert {d["kind"] for d in checked} == set(CORE_KINDS)
    for doc in checked:
        validate(doc, latest_version(), strict=True)


def test_the_schema_check_would_catch_a_misspelt_field() -> None:
    deployment = next(iter(of_kind(objects(), "Deployment").values()))
    container(deployment)["resources"]["limit"] = {}
    with pytest.raises(ValidationError):
        validate(deployment, latest_version(), strict=True)


def test_the_deployment_runs_vllm_with_every_planned_flag_and_resource() -> None:
    plan = model_plan(contexts=(2048, 32768), gpus=2, replicas={"min": 2, "max": 4})
    deployments = of_kind(model_objects(plan, namespace="llm"), "Deployment")
    assert set(deployments) == {p.name for p in plan.pools}
    for pool in plan.pools:
        deployment = deployments[pool.name]
        vllm = container(deployment)
        args = vllm["args"]
        assert args[:6] == ["--model", "/models/contract-v2", "--served-model-name",
                            "contract-review-v2", "--port", "8000"]
        assert args[6:] == list(pool.vllm_args)  # every flag, in the planner's order
        limits = vllm["resources"]["limits"]
        assert limits == {"nvidia.com/gpu": "2", "memory": str(pool.host_memory_bytes)}
        assert vllm["resources"]["requests"] == limits
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert vllm[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert vllm["ports"] == [{"name": "http", "containerPort": 8000}]
        spec = deployment["spec"]
        assert "replicas" not in spec  # the HPA sizes it (min 2, max 4)
        pod = spec["template"]["spec"]
        assert pod["nodeSelector"] == {"llm-sidecar.dev/gpu-class": "A100-80GB"}
        # tensor parallel 2: the workers' /dev/shm is memory, not the container's 64 MiB
        assert {"name": "shm", "mountPath": "/dev/shm"} in vllm["volumeMounts"]
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()


def test_one_gpu_needs_no_shared_memory_volume() -> None:
    pod = next(iter(of_kind(objects(), "Deployment").values()))["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["models"]


@pytest.mark.parametrize(("model_path", "image", "fetch", "loaded"), [
    ("pvc://models/contract-v2", "vllm/vllm-openai:v0.10.2", None, "/models/contract-v2"),
    ("s3://models/contract-v2.gguf", "amazon/aws-cli", "aws s3 cp s3://models/contract-v2.gguf",
     "/models/models/contract-v2.gguf"),
    ("s3://models/llama/", "amazon/aws-cli", "aws s3 sync s3://models/llama/", "/models/models/llama"),
    ("hf://meta-llama/Llama-2-13b-hf", "vllm/vllm-openai:v0.10.2",
     "huggingface-cli download meta-llama/Llama-2-13b-hf", "/models/meta-llama/Llama-2-13b-hf"),
    ("gs://bucket/llama", "google-cloud-cli", "gcloud storage cp -r gs://bucket/llama",
     "/models/bucket/llama"),
    ("/mnt/models/llama", "vllm/vllm-openai:v0.10.2", None, "/models/llama"),
])
def test_an_init_container_fetches_the_weights_and_reads_them_into_the_page_cache(
        model_path: str, image: str, fetch: str | None, loaded: str) -> None:
    deployment = next(iter(of_kind(objects(model_path=model_path), "Deployment").values()))
    pod = deployment["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    script = init["command"][2]
    assert image in init["image"]
    if fetch is not None:
        assert fetch in script
    else:
        assert "aws" not in script and "download" not in script
    assert f"find {loaded} -type f -exec cat {{}} + > /dev/null" in script
    assert ("env" in init) is model_path.startswith("hf://")  # the optional HF_TOKEN Secret
    assert container(deployment)["args"][1] == loaded
    mount = container(deployment)["volumeMounts"][0]
    assert loaded.startswith(mount["mountPath"]) and mount["readOnly"] is True


def test_a_pvc_model_mounts_its_claim_read_only() -> None:
    pod = next(iter(of_kind(objects(), "Deployment").values()))["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "models",
                               "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}]


def test_service_inference_pool_and_pod_monitor_select_the_pools_pods() -> None:
    docs = objects(canary={"model": "contract-review-v3", "percent": 5})
    deployments = of_kind(docs, "Deployment")
    for kind in ("Service", "InferencePool", "PodMonitor"):
        assert set(of_kind(docs, kind)) == set(deployments), kind
    for name, deployment in deployments.items():
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        service = of_kind(docs, "Service")[name]["spec"]
        assert service["clusterIP"] == "None"
        assert service["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]
        assert service["selector"].items() <= pod_labels.items()
        pool = of_kind(docs, "InferencePool")[name]
        assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
        assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert pool["spec"]["targetPorts"] == [{"number": 8000}]
        assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 50051}
        monitor = of_kind(docs, "PodMonitor")[name]["spec"]
        assert monitor["selector"]["matchLabels"].items() <= pod_labels.items()
        assert monitor["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics",
                                                   "interval": "15s"}]
    canary = container(deployments["contract-review-v2-canary"])["args"]
    assert canary[canary.index("--served-model-name") + 1] == "contract-review-v3"


def test_every_object_has_namespace_and_labels_in_a_fixed_order() -> None:
    plan = model_plan(contexts=(2048, 4096, 8192))
    docs = model_objects(plan, namespace="llm")
    assert docs == model_objects(plan, namespace="llm")
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Deployment"] * 3 + ["Service"] * 3 + ["NetworkPolicy"] * 3 + \
        ["InferencePool"] * 3 + ["PodMonitor"] * 3 + ["PrometheusRule"]
    for doc in docs:
        assert doc["metadata"]["namespace"] == "llm"
        assert doc["metadata"]["labels"][MODEL_LABEL] == "contract-review-v2"
        if doc["kind"] != "PrometheusRule":
            assert doc["metadata"]["labels"][POOL_LABEL] == doc["metadata"]["name"]


def _metric_labels(name: str) -> set[str]:
    """The labels ``docs/reference/metrics.md`` lists for metric ``name``."""
    text = (REPO / "docs" / "reference" / "metrics.md").read_text()
    section = text.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
    labels = re.search(r"- Labels: (.*)", section)
    assert labels is not None
    return set(re.findall(r"`(\w+)`", labels.group(1)))


def rules(sla: dict[str, str]) -> list[dict[str, Any]]:
    rule = of_kind(objects(sla=sla), "PrometheusRule")["contract-review-v2-slo"]
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_slo_alerts_read_the_metrics_extproc_exports() -> None:
    every = rules({"p99Latency": "200ms", "availability": "99.95%"})
    exprs = "\n".join(r["expr"] for r in every)
    assert {"model", "outcome"} <= _metric_labels("llm_sidecar_requests")
    assert "model" in _metric_labels("gen_ai_server_time_to_first_token_seconds")
    series = set(re.findall(r"\b([a-z_]+(?:_total|_bucket|_count))\{", exprs))
    assert series == {"llm_sidecar_requests_total",
                      "gen_ai_server_time_to_first_token_seconds_bucket",
                      "gen_ai_server_time_to_first_token_seconds_count"}
    outcomes = set(re.findall(r'outcome(?:=|!~)"([a-z_|]+)"', exprs))
    assert {o for group in outcomes for o in group.split("|")} <= set(get_args(Outcome))


def test_burn_rate_alerts_follow_the_sre_workbook_windows() -> None:
    alerts = {r["alert"]: r for r in rules({"p99Latency": "250ms", "availability": "99.95%"})
              if "alert" in r}
    assert [(w.long, w.short, w.burn_rate, w.severity) for w in WINDOWS] == [
        ("1h", "5m", 14.4, "page"), ("6h", "30m", 6.0, "page"), ("3d", "6h", 1.0, "ticket")]
    fast = alerts["LLMModelAvailabilityBurnRate1h"]
    # budget 0.05%: 14.4 x 0.0005 of requests failing over both 1h and 5m pages
    assert fast["expr"] == ('llmmodel:availability_errors:ratio_rate1h{model="contract-review-v2"}'
                            ' > 0.0072\nand\n'
                            'llmmodel:availability_errors:ratio_rate5m{model="contract-review-v2"}'
                            ' > 0.0072')
    assert fast["labels"]["severity"] == "page"
    assert alerts["LLMModelTTFTBurnRate3d"]["labels"]["severity"] == "ticket"
    assert "> 0.01\n" in alerts["LLMModelTTFTBurnRate3d"]["expr"]  # 1x the 1% of a P99
    assert len(alerts) == 6


@pytest.mark.parametrize(("sla", "le", "note"), [
    ("250ms", "0.25", ""), ("200ms", "0.25", "judged at the histogram's next bucket bound"),
    ("1s", "1.0", ""), ("2.6s", "5.0", "judged at the histogram's next bucket bound"),
    ("600s", "300.0", "above the histogram's largest bucket")])
def test_the_ttft_slo_is_judged_at_the_bucket_at_or_above_the_sla(sla: str, le: str,
                                                                  note: str) -> None:
    every = rules({"p99Latency": sla})
    slow = next(r for r in every if r.get("record") == "llmmodel:ttft_slow:ratio_rate5m")
    assert f'le="{le}"' in slow["expr"]
    summary = next(r for r in every if r.get("alert") == "LLMModelTTFTBurnRate1h")["annotations"]
    assert (note in summary["summary"]) if note else ("SLA" not in summary["summary"])


def _walk(node: dict[str, Any], path: str = "") -> list[str]:
    """Where ``node`` breaks Kubernetes' structural schema rules."""
    bad = []
    for key in ("$ref", "$defs", "const", "title", "default"):
        if key in node:
            bad.append(f"{path}: {key}")
    if node.get("additionalProperties") is False or (
            "additionalProperties" in node and "properties" in node):
        bad.append(f"{path}: additionalProperties")
    if "type" not in node and not (node.get("x-kubernetes-int-or-string")
                                   or node.get("x-kubernetes-preserve-unknown-fields")):
        bad.append(f"{path}: no type")
    for junctor in ("anyOf", "oneOf", "allOf"):
        for choice in node.get(junctor, []):
            if set(choice) & {"type", "description", "default"}:
                bad.append(f"{path}: {junctor} with type or description")
    for name, child in node.get("properties", {}).items():
        bad += _walk(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            bad += _walk(node[key], f"{path}[{key}]")
    return bad


def test_the_crd_schema_is_structural_and_accepts_what_the_loader_accepts() -> None:
    crd = crd_object()
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    assert _walk(schema) == []
    assert crd["metadata"]["name"] == "llmmodels.llm-sidecar.dev"
    assert version["subresources"] == {"status": {}}
    status = schema["properties"]["status"]["properties"]
    assert status["plan"]["x-kubernetes-preserve-unknown-fields"] is True
    assert {c["name"] for c in version["additionalPrinterColumns"]} == {
        "GPU", "Pools", "Planned", "Ready", "Age"}
    spec = schema["properties"]["spec"]
    good = model_plan(limits={"model": {"requests": "40/s", "burst": 5}},
                      canary={"model": "v3", "percent": 5}).model.located.data["spec"]
    jsonschema.Draft4Validator(spec).validate(good)  # OpenAPI v3 bounds are draft 4's
    for bad in ({**good, "quantization": "q9"}, {**good, "replicas": {"min": -1}},
                {**good, "limits": {"model": {"burst": 0}}}, {k: v for k, v in good.items()
                                                              if k != "gpuRequest"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft4Validator(spec).validate(bad)


def test_only_the_gateway_extproc_and_prometheus_reach_a_pools_vllm_port() -> None:
    plan = model_plan()
    for pool in plan.pools:
        [doc] = [d for d in model_objects(plan, namespace="llm")
                 if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == pool.name]
        assert doc["metadata"]["namespace"] == "llm"
        assert doc["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": pool.name}}
        assert doc["spec"]["policyTypes"] == ["Ingress"]
        sources = [frm for rule in doc["spec"]["ingress"] for frm in rule["from"]]
        assert [s.get("podSelector", {}).get("matchLabels") for s in sources] == [
            {"app.kubernetes.io/name": "llm-gateway"},
            {"app.kubernetes.io/name": "llm-sidecar-extproc"},
            {"app.kubernetes.io/name": "prometheus"}]
        assert {p["port"] for rule in doc["spec"]["ingress"] for p in rule["ports"]} == {"http"}
        [deployment] = [d for d in model_objects(plan, namespace="llm")
                        if d["kind"] == "Deployment" and d["metadata"]["name"] == pool.name]
        pod = deployment["spec"]["template"]
        assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == pool.name
        assert [p["name"] for p in pod["spec"]["containers"][0]["ports"]] == ["http"]


def test_pool_pods_run_unprivileged_and_without_an_api_token() -> None:
    for doc in model_objects(model_plan(), namespace="llm"):
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        for container in [*pod["initContainers"], *pod["containers"]]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["privileged"] is False
            assert context["capabilities"] == {"drop": ["ALL"]}
        validate(doc, latest_version(), strict=True)


def test_a_model_with_room_to_grow_gets_an_autoscaler_per_serving_pool() -> None:
    plan = model_plan(contexts=(2048, 65536), replicas={"min": 2, "max": 6},
                      canary={"model": "contract-review-v3", "percent": 5})
    docs = model_objects(plan, namespace="llm")
    hpas, deployments = of_kind(docs, "HorizontalPodAutoscaler"), of_kind(docs, "Deployment")
    serving = {p.name for p in plan.serving_pools}
    assert set(hpas) == serving and serving < set(deployments)
    for name, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["metadata"]["namespace"] == "llm"
        spec = hpa["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 6)
        [metric] = spec["metrics"]
        assert metric["type"] == "Pods"
        assert metric["pods"]["metric"] == {"name": "vllm_num_requests_waiting"}
        assert metric["pods"]["target"]["type"] == "AverageValue"
        # the Deployment leaves replicas to the HPA: a forced re-apply would reset them
        assert "replicas" not in deployments[name]["spec"]
        validate(hpa, latest_version(), strict=True)
        validate(deployments[name], latest_version(), strict=True)
    # a quarter of --max-num-seqs waiting per pod; a one-sequence pool scales at one waiting
    assert hpas["contract-review-v2-2k"]["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "16"
    assert hpas["contract-review-v2-64k"]["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "1"
    # the canary pool gets a small share of the traffic: one replica, no HPA
    assert deployments["contract-review-v2-canary"]["spec"]["replicas"] == 1
    assert [d["kind"] for d in docs[:len(deployments) + len(hpas)]] == \
        ["Deployment"] * len(deployments) + ["HorizontalPodAutoscaler"] * len(hpas)


@pytest.mark.parametrize("replicas", [{"min": 3, "max": 3}, {"min": 1, "max": 1}])
def test_a_fixed_size_model_keeps_its_replicas_and_gets_no_autoscaler(replicas: dict[str, int]) -> None:
    docs = objects(replicas=replicas, canary={"model": "contract-review-v3", "percent": 5})
    assert of_kind(docs, "HorizontalPodAutoscaler") == {}
    sizes = {name: d["spec"]["replicas"] for name, d in of_kind(docs, "Deployment").items()}
    assert sizes == {"contract-review-v2-2k": replicas["min"], "contract-review-v2-4k": replicas["min"],
                     "contract-review-v2-canary": 1}


def test_min_zero_runs_one_pod_since_an_hpa_cannot_scale_to_zero() -> None:
    hpas = of_kind(objects(replicas={"min": 0, "max": 3}), "HorizontalPodAutoscaler")
    assert {(h["spec"]["minReplicas"], h["spec"]["maxReplicas"]) for h in hpas.values()} == {(1, 3)}


def test_the_schema_check_would_catch_a_bad_autoscaler() -> None:
    hpa = next(iter(of_kind(objects(replicas={"min": 1, "max": 2}), "HorizontalPodAutoscaler").values()))
    validate(hpa, latest_version(), strict=True)
    hpa["spec"]["metrics"][0]["pods"]["target"]["averageValues"] = "3"
    with pytest.raises(ValidationError):
        validate(hpa, latest_version(), strict=True)


def test_the_documented_adapter_rule_serves_the_metric_the_autoscaler_reads() -> None:
    """The HPA asks the custom metrics API for :data:`WAITING_METRIC` of each pod; the rule
    documented for prometheus-adapter must serve that name, from vLLM's gauge, per pod."""
    [rule] = yaml.safe_load(ADAPTER_RULE)["rules"]
    assert rule["name"]["as"] == WAITING_METRIC
    assert re.fullmatch(rule["name"]["matches"], "vllm:num_requests_waiting")
    assert rule["seriesQuery"].startswith("vllm:num_requests_waiting{")
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                              "pod": {"resource": "pod"}}
    assert "by (<<.GroupBy>>)" in rule["metricsQuery"]
    hpa = next(iter(of_kind(objects(replicas={"min": 1, "max": 2}), "HorizontalPodAutoscaler").values()))
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == WAITING_METRIC
