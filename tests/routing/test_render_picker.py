"""What ``render`` writes for ``endpoint_picker`` pools: Envoy, Istio and Kubernetes.

How Envoy behaves with it is in tests/e2e/test_endpoint_picker.py; here, the shapes and that
Envoy accepts them (``envoy --mode validate``).
"""

from __future__ import annotations

import copy
import pathlib
import subprocess
from typing import Any

import yaml

from routing.loader import validate as validate_config
from routing.render.clusters import override_host_policy
from routing.render.deploy import EXTPROC, GATEWAY, kubernetes
from routing.render.envoy import bootstrap
from routing.render.istio import envoy_filter
from routing.schema import RoutingConfig
from routing.yamlsrc import Located
from sidecar_runtime.process.procs import envoy_binary
from tests.harness import istio_patch
from tests.harness.gateway import default_doc
from tests.routing.test_render import hcm_of, validate

DESTINATION = "x-gateway-destination-endpoint"


def config(picked: tuple[str, ...] = ("vllm-long",), **extra: Any) -> RoutingConfig:
    doc = default_doc()
    doc["clusters"]["vllm-long"]["endpoints"] = ["vllm-long.llm.svc:8000"]
    for name in picked:
        doc["clusters"][name]["endpoint_picker"] = {}
    doc.update(extra)
    return validate_config(Located("t.yaml", doc, {}))


def clusters_of(rendered: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in rendered["static_resources"]["clusters"]}


def ext_proc_of(hcm: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = next(f for f in hcm["http_filters"]
                                 if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    return found


def test_a_picked_pool_follows_the_pick_by_metadata_only(tmp_path: pathlib.Path) -> None:
    rendered = bootstrap(config())
    pools = clusters_of(rendered)
    picked = pools["vllm-long"]
    assert "lb_policy" not in picked
    policy = picked["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    override = policy["typed_config"]
    # Metadata only: a header source would let whoever sets the header pick the pod.
    assert override["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION}]}}]
    fallback = override["fallback_policy"]["policies"][0]["typed_extension_config"]
    assert fallback["name"] == "envoy.load_balancing_policies.least_request"
    # The pools without a picker keep least request, and the health checks stay on all.
    assert [n for n, c in pools.items() if c.get("lb_policy") == "LEAST_REQUEST"] == [
        "vllm-short", "vllm-canary", "embed"]
    assert all("health_checks" in pools[n] for n in ("vllm-short", "vllm-long"))
    hcm = hcm_of(rendered)
    assert ext_proc_of(hcm)["metadata_options"] == {
        "receiving_namespaces": {"untyped": ["llm_sidecar", "envoy.lb"]}}
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(rendered))
    validate(path)


def test_without_a_picker_extproc_cannot_write_envoy_lb() -> None:
    hcm = hcm_of(bootstrap(config(picked=())))
    assert ext_proc_of(hcm)["metadata_options"] == {
        "receiving_namespaces": {"untyped": ["llm_sidecar"]}}


def test_a_client_destination_header_is_removed_before_routing_with_or_without_a_picker() -> None:
    for picked in ((), ("vllm-long",)):
        hcm = hcm_of(bootstrap(config(picked=picked)))
        strip = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
        assert {"remove_on_match": {"key_matcher": {"prefix": DESTINATION}}} in strip


def test_the_istio_filter_takes_the_pick_and_strips_the_client_header(
        tmp_path: pathlib.Path) -> None:
    resource = envoy_filter(config(istio={"context": "GATEWAY", "port": 8080}))
    gateway, contexts = istio_patch.gateway_bootstrap(8080)
    patched, applied = istio_patch.apply(gateway, contexts, "gateway", resource)
    assert all(applied), applied
    hcm = hcm_of(patched)
    assert ext_proc_of(hcm)["metadata_options"]["receiving_namespaces"]["untyped"] == [
        "llm_sidecar", "envoy.lb"]
    mutations = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert {"remove_on_match": {"key_matcher": {"prefix": DESTINATION}}} in mutations
    # No patch touches Istio's own pool clusters (see the next test).
    assert [p["patch"]["operation"] for p in resource["spec"]["configPatches"]
            if p["applyTo"] == "CLUSTER"] == ["ADD"]
    path = tmp_path / "istio.yaml"
    path.write_text(yaml.safe_dump(patched))
    validate(path)


def test_why_istio_pool_clusters_are_not_patched(tmp_path: pathlib.Path) -> None:
    """Istio may make its cluster of a headless Service (what a picker resolves pods from) an
    ORIGINAL_DST passthrough; Envoy refuses one with the override_host policy merged in, and
    one refused cluster would have the gateway reject istiod's whole cluster update."""
    gateway, _ = istio_patch.gateway_bootstrap(8080)
    cluster = gateway["static_resources"]["clusters"][0]
    passthrough = {"name": cluster["name"], "type": "ORIGINAL_DST",
                   "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "10s"}
    cluster.clear()
    cluster.update(passthrough)
    ok = tmp_path / "ok.yaml"
    ok.write_text(yaml.safe_dump(gateway))
    validate(ok)
    merged = copy.deepcopy(gateway)
    merged["static_resources"]["clusters"][0]["load_balancing_policy"] = override_host_policy()
    refused = tmp_path / "refused.yaml"
    refused.write_text(yaml.safe_dump(merged))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(refused)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0
    assert "cluster provided LB not specified" in result.stdout + result.stderr


def test_kubernetes_lets_extproc_reach_only_picked_pools() -> None:
    manifests = kubernetes(config(picked=("vllm-short",)), "")
    policies = {d["metadata"]["name"]: d for d in manifests["networkpolicies.yaml"]}

    def sources(pool: str) -> list[str]:
        ingress = policies[f"{pool}-ingress"]["spec"]["ingress"]
        return [s["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
                for rule in ingress for s in rule["from"]]

    assert sources("vllm-short") == [GATEWAY, EXTPROC]
    assert sources("embed") == [GATEWAY]
    services = {d["metadata"]["name"]: d for d in manifests["pools.yaml"]
                if d["kind"] == "Service"}
    assert services["vllm-short"]["spec"]["clusterIP"] == "None"  # one A record per pod
