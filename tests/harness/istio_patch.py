"""What istiod does with our EnvoyFilter, for the parts it uses, on Istio-shaped bootstraps.

There is no istiod here, so the tests build bootstraps shaped like the config Istio generates
for a sidecar (``virtualInbound`` on 15006 with a filter chain per port, ``virtualOutbound`` on
15001) and for an ingress gateway (``0.0.0.0_8080``), apply the EnvoyFilter's patches with
Istio's semantics (context, portNumber, filter and sub-filter matches; INSERT_BEFORE, ADD,
MERGE as proto merge), and hand the result to ``envoy --mode validate``.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

HCM = "envoy.filters.network.http_connection_manager"
TYPE = "@type"
API = "type.googleapis.com/envoy."
Proxy = Literal["sidecar", "gateway"]
CONTEXTS: dict[Proxy, set[str]] = {"sidecar": {"SIDECAR_INBOUND", "SIDECAR_OUTBOUND"},
                                   "gateway": {"GATEWAY"}}


def _typed(name: str, type_: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "typed_config": {TYPE: API + type_, **fields}}


def _http_filters() -> list[dict[str, Any]]:
    return [
        _typed("envoy.filters.http.fault", "extensions.filters.http.fault.v3.HTTPFault"),
        _typed("envoy.filters.http.cors", "extensions.filters.http.cors.v3.Cors"),
        _typed("envoy.filters.http.router", "extensions.filters.http.router.v3.Router"),
    ]


def _hcm(stat_prefix: str, route_name: str, vhost: str, cluster: str) -> dict[str, Any]:
    return _typed(
        HCM, "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix=stat_prefix, normalize_path=True, use_remote_address=False,
        route_config={"name": route_name, "validate_clusters": False, "virtual_hosts": [{
            "name": vhost, "domains": ["*"], "routes": [{
                "name": "default", "match": {"prefix": "/"},
                "route": {"cluster": cluster, "timeout": "0s"}}]}]},
        http_filters=_http_filters())


def _tcp_proxy(cluster: str) -> dict[str, Any]:
    return _typed("envoy.filters.network.tcp_proxy", "extensions.filters.network.tcp_proxy.v3.TcpProxy",
                  stat_prefix=cluster, cluster=cluster)


def _static(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "type": "STATIC", "connect_timeout": "10s", "load_assignment": {
        "cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}


def _original_dst(name: str) -> dict[str, Any]:
    return {"name": name, "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "10s"}


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "0.0.0.0", "port_value": port}}


def sidecar_bootstrap(app_port: int = 8000) -> tuple[dict[str, Any], dict[str, str]]:
    """A sidecar's config, and the context of each listener."""
    inbound_cluster = f"inbound|{app_port}||"
    bootstrap = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
        "static_resources": {
            "listeners": [
                {"name": "virtualOutbound", "address": _address(15001),
                 "traffic_direction": "OUTBOUND", "use_original_dst": True,
                 "filter_chains": [{"name": "virtualOutbound-catchall-tcp",
                                    "filters": [_tcp_proxy("PassthroughCluster")]}]},
                {"name": "virtualInbound", "address": _address(15006),
                 "traffic_direction": "INBOUND",
                 "listener_filters": [_typed("envoy.filters.listener.original_dst",
                                             "extensions.filters.listener.original_dst.v3"
                                             ".OriginalDst")],
                 "filter_chains": [
                     {"name": f"0.0.0.0_{app_port}",
                      "filter_chain_match": {"destination_port": app_port},
                      "filters": [_hcm(f"inbound_0.0.0.0_{app_port}", inbound_cluster,
                                       f"inbound|http|{app_port}", inbound_cluster)]},
                     {"name": "virtualInbound-catchall-tcp",
                      "filters": [_tcp_proxy("InboundPassthroughCluster")]},
                 ]},
            ],
            "clusters": [_static(inbound_cluster, app_port), _original_dst("PassthroughCluster"),
                         _original_dst("InboundPassthroughCluster"),
                         {"name": "BlackHoleCluster", "type": "STATIC", "connect_timeout": "10s"}],
        },
    }
    return bootstrap, {"virtualOutbound": "SIDECAR_OUTBOUND", "virtualInbound": "SIDECAR_INBOUND"}


def gateway_bootstrap(port: int = 8080) -> tuple[dict[str, Any], dict[str, str]]:
    """An ingress gateway's config (one HTTP server), and the context of its listener."""
    upstream = "outbound|8000||vllm-short.llm.svc.cluster.local"
    cluster = {"name": upstream, "type": "STRICT_DNS", "connect_timeout": "10s",
               "load_assignment": {"cluster_name": upstream, "endpoints": [{"lb_endpoints": [
                   {"endpoint": {"address": {"socket_address": {
                       "address": "vllm-short.llm.svc.cluster.local", "port_value": 8000}}}}]}]}}
    bootstrap = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
        "static_resources": {
            "listeners": [{"name": f"0.0.0.0_{port}", "address": _address(port),
                           "traffic_direction": "OUTBOUND",
                           "filter_chains": [{"filters": [
                               _hcm(f"outbound_0.0.0.0_{port}", f"http.{port}", f"*:{port}",
                                    upstream)]}]}],
            "clusters": [cluster, {"name": "BlackHoleCluster", "type": "STATIC",
                                   "connect_timeout": "10s"}],
        },
    }
    return bootstrap, {f"0.0.0.0_{port}": "GATEWAY"}


def _context_ok(match: dict[str, Any], context: str) -> bool:
    wanted = match.get("context", "ANY")
    return bool(wanted == "ANY" or wanted == context)


def _port_ok(listener_match: dict[str, Any], listener: dict[str, Any],
             chain: dict[str, Any]) -> bool:
    port = listener_match.get("portNumber")
    if port is None:
        return True
    return bool(listener["address"]["socket_address"]["port_value"] == port
                or chain.get("filter_chain_match", {}).get("destination_port") == port)


def merge(into: dict[str, Any], value: dict[str, Any]) -> None:
    """Proto merge: messages merge field by field, repeated fields append, scalars replace."""
    for key, item in value.items():
        if isinstance(item, dict) and isinstance(into.get(key), dict):
            merge(into[key], item)
        elif isinstance(item, list) and isinstance(into.get(key), list):
            into[key].extend(copy.deepcopy(item))
        else:
            into[key] = copy.deepcopy(item)


def apply(bootstrap: dict[str, Any], contexts: dict[str, str], proxy: Proxy,
          envoy_filter: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """The patched bootstrap, and how many objects each patch changed."""
    out = copy.deepcopy(bootstrap)
    resources = out["static_resources"]
    applied: list[int] = []
    for patch in envoy_filter["spec"]["configPatches"]:
        match, operation = patch.get("match", {}), patch["patch"]["operation"]
        value = patch["patch"].get("value", {})
        count = 0
        if patch["applyTo"] == "CLUSTER":
            assert operation == "ADD", operation
            if any(_context_ok(match, c) for c in CONTEXTS[proxy]):
                resources["clusters"].append(copy.deepcopy(value))
                count += 1
        else:
            listener_match = match.get("listener", {})
            filter_match = listener_match.get("filterChain", {}).get("filter", {})
            for listener in resources["listeners"]:
                if not _context_ok(match, contexts[listener["name"]]):
                    continue
                for chain in listener["filter_chains"]:
                    if not _port_ok(listener_match, listener, chain):
                        continue
                    for network_filter in chain["filters"]:
                        if filter_match.get("name") not in (None, network_filter["name"]):
                            continue
                        count += _patch_filter(patch["applyTo"], operation, value,
                                               filter_match.get("subFilter", {}).get("name"),
                                               network_filter)
        applied.append(count)
    return out, applied


def _patch_filter(apply_to: str, operation: str, value: dict[str, Any], sub_filter: str | None,
                  network_filter: dict[str, Any]) -> int:
    if apply_to == "NETWORK_FILTER":
        assert operation == "MERGE", operation
        assert value["typed_config"][TYPE] == network_filter["typed_config"][TYPE]
        merge(network_filter["typed_config"], {k: v for k, v in value["typed_config"].items()
                                               if k != TYPE})
        return 1
    assert apply_to == "HTTP_FILTER" and operation == "INSERT_BEFORE", (apply_to, operation)
    if network_filter["name"] != HCM:
        return 0
    http_filters = network_filter["typed_config"]["http_filters"]
    names = [f["name"] for f in http_filters]
    if sub_filter is not None and sub_filter not in names:
        return 0
    where = names.index(sub_filter) if sub_filter is not None else 0
    http_filters.insert(where, copy.deepcopy(value))
    return 1
