"""Routing YAML → an Istio ``EnvoyFilter`` (``envoyfilter.yaml``) for proxies Istio manages.

Istio builds the listeners; the EnvoyFilter patches them, for one context (``istio.context``):

1. inserts the ext_proc filter, then the ratelimit filter, each before ``envoy.filters.http.router``
   in every HTTP connection manager of the context, so the order is ext_proc → ratelimit → router;
2. adds the two gRPC clusters (extproc, ratelimit) those filters call;
3. merges OpenAI-JSON local replies into the HTTP connection manager, and the early removal of
   client-sent ``x-llm-*`` headers (always: Istio's routes match ``x-llm-cluster`` before
   extproc answers, and cannot match extproc's dynamic metadata as ``render``'s bootstrap does).

The route ``rate_limits`` travel inside the ratelimit filter's own config: Envoy applies
filter-level ``rate_limits`` to every route, and honours ``hits_addend`` (token charging) only
there, so no route of Istio's needs patching. Pools are reached the Istio way (a VirtualService
routing on ``x-llm-cluster``, DestinationRules, ServiceEntries: see docs/operations/istio.md).
"""

from __future__ import annotations

from typing import Any

from routing.render.clusters import TYPE, service_clusters
from routing.render.envoy import (
    UNDERSCORE_HEADERS_DROPPED,
    early_header_mutations,
    ext_proc_filter,
    local_reply_config,
    ratelimit_filter,
)
from routing.schema import RoutingConfig

HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE = ("type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
            ".HttpConnectionManager")
ROUTER = "envoy.filters.http.router"
NAME = "llm-sidecar"


def _listener_match(config: RoutingConfig, sub_filter: str | None) -> dict[str, Any]:
    chain_filter: dict[str, Any] = {"name": HCM}
    if sub_filter is not None:
        chain_filter["subFilter"] = {"name": sub_filter}
    listener: dict[str, Any] = {"filterChain": {"filter": chain_filter}}
    if config.istio.port is not None:
        listener["portNumber"] = config.istio.port
    return {"context": config.istio.context, "listener": listener}


def config_patches(config: RoutingConfig) -> list[dict[str, Any]]:
    """The EnvoyFilter's ``configPatches``, applied by Istio in this order."""
    filters = [ext_proc_filter(config)]
    if config.rate_limits is not None:
        filters.append(ratelimit_filter(config))
    patches: list[dict[str, Any]] = [
        {"applyTo": "HTTP_FILTER", "match": _listener_match(config, ROUTER),
         "patch": {"operation": "INSERT_BEFORE", "value": value}}
        for value in filters
    ]
    patches += [
        {"applyTo": "CLUSTER", "match": {"context": config.istio.context},
         "patch": {"operation": "ADD", "value": cluster}}
        for cluster in service_clusters(config)
    ]
    # No client's own x-llm-cluster may pick the pool (the VirtualService routes on it, before
    # extproc answers or when it never sees a body) nor its x-llm-tenant the buckets.
    hcm = {TYPE: HCM_TYPE, "local_reply_config": local_reply_config(),
           **UNDERSCORE_HEADERS_DROPPED, **early_header_mutations()}
    patches.append({
        "applyTo": "NETWORK_FILTER", "match": _listener_match(config, None),
        "patch": {"operation": "MERGE", "value": {"name": HCM, "typed_config": hcm}},
    })
    return patches


def envoy_filter(config: RoutingConfig) -> dict[str, Any]:
    """The ``EnvoyFilter`` resource (networking.istio.io/v1alpha3)."""
    metadata: dict[str, Any] = {"name": NAME, "labels": {"app.kubernetes.io/name": NAME}}
    if config.istio.namespace is not None:
        metadata["namespace"] = config.istio.namespace
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": metadata,
        "spec": {
            "workloadSelector": {"labels": config.istio.selector},
            "configPatches": config_patches(config),
        },
    }
