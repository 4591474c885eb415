"""deploy/: memory bounds (Redis maxmemory and eviction per role, Envoy's heap under its
container limit) and the NetworkPolicies (who reaches whom), on the generated files."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from routing.render.deploy import REDIS_BUCKETS, REDIS_CACHE
from tests.routing.test_deploy import REPO, by_kind, compose, manifests

EXTPROC, RATELIMIT, GATEWAY = "llm-sidecar-extproc", "llm-sidecar-ratelimit", "llm-gateway"
MiB = 1024 * 1024


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def mib(quantity: str) -> int:
    """A memory quantity as Kubernetes (``768Mi``, ``1Gi``) or compose (``768m``) write it."""
    for suffix, factor in (("Gi", 1024), ("Mi", 1), ("g", 1024), ("m", 1)):
        if quantity.endswith(suffix):
            return int(quantity.removesuffix(suffix)) * factor
    raise ValueError(quantity)


def redis_of_compose(service: str) -> dict[str, Any]:
    services = compose()["services"]
    host = urlsplit(services[service]["environment"]["LLM_SIDECAR_REDIS_URL"]).hostname
    found: dict[str, Any] = services[str(host)]
    return found


@pytest.mark.parametrize(("service", "policy"), [
    (RATELIMIT, "noeviction"),   # buckets and leases: never evicted (an evicted bucket is full)
    (EXTPROC, "allkeys-lru"),    # the cache: the least recently used vectors go first
])
def test_each_service_has_its_own_redis_with_its_eviction_policy(service: str,
                                                                 policy: str) -> None:
    redis = redis_of_compose(service)
    assert flag(redis["command"], "--maxmemory-policy") == policy
    maxmemory_mib = int(flag(redis["command"], "--maxmemory").removesuffix("mb"))
    assert 0 < maxmemory_mib < mib(redis["mem_limit"])


def test_bucket_keys_and_cache_entries_never_share_a_redis() -> None:
    buckets, cache = redis_of_compose(RATELIMIT), redis_of_compose(EXTPROC)
    assert buckets is not cache
    deployments = by_kind(manifests(), "Deployment")
    secret = by_kind(manifests(), "Secret")["llm-sidecar"]["stringData"]
    hosts = {}
    for service in (EXTPROC, RATELIMIT):
        env = deployments[service]["spec"]["template"]["spec"]["containers"][0]["env"]
        ref = next(e for e in env if e["name"] == "LLM_SIDECAR_REDIS_URL")
        hosts[service] = urlsplit(secret[ref["valueFrom"]["secretKeyRef"]["key"]]).hostname
    assert hosts == {EXTPROC: REDIS_CACHE.name, RATELIMIT: REDIS_BUCKETS.name}
    for role in (REDIS_BUCKETS, REDIS_CACHE):
        container = deployments[role.name]["spec"]["template"]["spec"]["containers"][0]
        assert flag(container["args"], "--maxmemory-policy") == role.policy
        limit = mib(container["resources"]["limits"]["memory"])
        assert int(flag(container["args"], "--maxmemory").removesuffix("mb")) < limit


def test_envoys_heap_limit_is_below_its_container_limit() -> None:
    docs = manifests()
    routing = yaml.safe_load(by_kind(docs, "ConfigMap")["llm-sidecar-routing"]["data"]
                             ["routing.yaml"])
    heap = routing["envoy"]["max_heap_bytes"]
    pod = by_kind(docs, "Deployment")[GATEWAY]["spec"]["template"]["spec"]
    envoy = next(c for c in pod["containers"] if c["name"] == "envoy")
    limit = mib(envoy["resources"]["limits"]["memory"]) * MiB
    assert 0.5 * limit <= heap <= 0.8 * limit
    gateway = compose()["services"][GATEWAY]
    compose_routing = yaml.safe_load((REPO / "deploy" / "compose" / "routing.yaml").read_text())
    assert compose_routing["envoy"]["max_heap_bytes"] <= 0.8 * mib(gateway["mem_limit"]) * MiB


def pods() -> dict[str, dict[str, Any]]:
    """Deployment name → its pod template."""
    return {name: d["spec"]["template"]
            for name, d in by_kind(manifests(), "Deployment").items()}


def selected(selector: dict[str, Any]) -> list[str]:
    labels = selector.get("matchLabels", {})
    return [name for name, pod in pods().items()
            if labels.items() <= pod["metadata"]["labels"].items()]


def reachability() -> set[tuple[str, str, str]]:
    """(source, target, port) every policy allows; ``prometheus`` for the metrics rule."""
    allowed = set()
    for policy in by_kind(manifests(), "NetworkPolicy").values():
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        [target] = selected(spec["podSelector"])
        container_ports = {p["name"] for c in pods()[target]["spec"]["containers"]
                           for p in c.get("ports", [])}
        for rule in spec["ingress"]:
            for peer in rule["from"]:
                if "namespaceSelector" in peer:  # only Prometheus comes from other namespaces
                    assert peer["podSelector"]["matchLabels"] == {
                        "app.kubernetes.io/name": "prometheus"}
                    sources = ["prometheus"]
                else:
                    sources = selected(peer["podSelector"])
                    assert len(sources) == 1, peer
                for port in rule["ports"]:
                    assert port["port"] in container_ports, (target, port)
                    allowed |= {(source, target, port["port"]) for source in sources}
    return allowed


def test_only_the_gateway_reaches_the_services_and_pools_and_each_redis_its_one_user() -> None:
    pools = [name for name, pod in pods().items()
             if pod["spec"]["containers"][0]["name"] == "vllm"]
    assert pools  # the example's simulated pools
    assert reachability() == {
        (GATEWAY, EXTPROC, "grpc"), ("prometheus", EXTPROC, "metrics"),
        (GATEWAY, RATELIMIT, "grpc"), (EXTPROC, RATELIMIT, "grpc"),  # extproc charges hits
        ("prometheus", RATELIMIT, "metrics"),
        (RATELIMIT, REDIS_BUCKETS.name, "redis"), (EXTPROC, REDIS_CACHE.name, "redis"),
        *((GATEWAY, pool, "http") for pool in pools),
        (EXTPROC, "vllm-short", "http"),  # its endpoint picker reads the pods' /metrics
        (EXTPROC, "vllm-canary", "http"),  # the canary verdict's shadow requests
    }


def test_every_pod_but_the_gateway_refuses_what_no_policy_allows() -> None:
    """A pod no policy selects accepts every connection: only the gateway may be one."""
    covered = {name for policy in by_kind(manifests(), "NetworkPolicy").values()
               for name in selected(policy["spec"]["podSelector"])}
    assert set(pods()) - covered == {GATEWAY}
