"""Kubernetes NetworkPolicies of the deployment: who may open a connection to whom.

Only the gateway (Envoy) reaches extproc, ratelimit and the pools; extproc also reaches
ratelimit (it charges cache hits and settles reservations itself), the pods of
``endpoint_picker`` pools (their metrics) and of compared canary pools (shadow requests); only
ratelimit reaches the buckets Redis
and only extproc the cache Redis.
The metrics ports answer Prometheus (pods labelled ``app.kubernetes.io/name: prometheus``, in
any namespace, as the Prometheus Operator and its Helm charts label them). Each policy selects
one component's pods, which makes them refuse any ingress it does not list; the gateway itself
gets none (clients reach it from anywhere).
Probes need no rule: Kubernetes always lets a pod's own node reach it.
"""

from __future__ import annotations

from typing import Any

LABEL = "app.kubernetes.io/name"
PART_OF = {"app.kubernetes.io/part-of": "llm-sidecar"}
PROMETHEUS = {"namespaceSelector": {},
              "podSelector": {"matchLabels": {LABEL: "prometheus"}}}


def _pods(name: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": {LABEL: name}}}


def policy(target: str, rules: list[tuple[list[str], list[str]]]) -> dict[str, Any]:
    """Ingress to ``target``'s pods: each rule is (pods allowed, container port names); a rule
    with no pods allows Prometheus."""
    ingress = []
    for sources, ports in rules:
        ingress.append({
            "from": [_pods(source) for source in sources] if sources else [PROMETHEUS],
            "ports": [{"protocol": "TCP", "port": port} for port in ports],
        })
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": f"{target}-ingress", "labels": {LABEL: target, **PART_OF}},
        "spec": {"podSelector": {"matchLabels": {LABEL: target}}, "policyTypes": ["Ingress"],
                 "ingress": ingress},
    }


def network_policies(*, gateway: str, extproc: str, ratelimit: str, redis_of: dict[str, str],
                     pools: list[str], picked: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """The policies for the named components; ``redis_of`` maps a Redis to its one user;
    ``picked`` pools also admit extproc: ``endpoint_picker`` pools, whose pods' vLLM
    ``/metrics`` it scrapes (vLLM serves them on its API port, so the rule is for that port),
    and compared canary pools, which get its shadow requests."""
    out = [
        policy(extproc, [([gateway], ["grpc"]), ([], ["metrics"])]),
        policy(ratelimit, [([gateway, extproc], ["grpc"]), ([], ["metrics"])]),
        *(policy(redis, [([user], ["redis"])]) for redis, user in redis_of.items()),
        *(policy(pool, [([gateway, extproc] if pool in picked else [gateway], ["http"])])
          for pool in pools),
    ]
    return out
