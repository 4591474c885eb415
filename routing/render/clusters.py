"""Envoy clusters for the routing YAML: vLLM pools and the two gRPC sidecar services.

Pools are hardened for long generations: active health checks on vLLM's ``/health``, outlier
detection, circuit breakers sized for many concurrent streams, least-request balancing (one
request can hold a pod for minutes, so round robin piles work on busy pods), and upstream
connections closed before vLLM's own keep-alive (5 s) would close them under a request.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from routing.schema import ClusterSpec, RoutingConfig, ServicesTls
from routing.units import parse_hostport
from sidecar_runtime.h2grpc.limits import Limits
from sidecar_runtime.wire.names import (
    DESTINATION_ENDPOINT,
    DESTINATION_ENDPOINT_SERVED,
    GRPC_MAX_CONCURRENT_STREAMS,
    LB_METADATA_NAMESPACE,
    UNIX_PREFIX,
)

EXTPROC_CLUSTER = "llm-sidecar-extproc"
RATELIMIT_CLUSTER = "llm-sidecar-ratelimit"
TYPE = "@type"
API = "type.googleapis.com/envoy."
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

VLLM_HEALTH_PATH = "/health"
# uvicorn (vLLM's server) closes idle keep-alive connections after 5 s; Envoy must close first,
# or a request can be written to a connection the server is closing.
POOL_IDLE_TIMEOUT = "4s"

SERVICE_IDLE_TIMEOUT_S = Limits().idle_timeout_s / 2
"""Envoy closes a connection to extproc or ratelimit that has carried no request this long:
half the services' own idle timeout (:attr:`sidecar_runtime.h2grpc.limits.Limits.idle_timeout_s`,
600 s), so Envoy closes an idle connection first, cleanly, and never writes a request into one
the server is closing. Envoy counts requests only; the server counts any frame, so Envoy's
keepalive PINGs (every 30 s) keep its own idle timeout from tripping on Envoy's connections
as well."""


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _base(name: str, endpoints: list[str]) -> dict[str, Any]:
    hosts = [parse_hostport(e) for e in endpoints]
    static = all(_is_ip(h) for h, _ in hosts)
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if static else "STRICT_DNS",
        "connect_timeout": "2s",
    }
    if not static:
        # Kubernetes headless Services give one A record per pod: balance across all of them.
        cluster["dns_lookup_family"] = "V4_PREFERRED"
        cluster["respect_dns_ttl"] = True
        cluster["dns_refresh_rate"] = "5s"
    cluster["load_assignment"] = {"cluster_name": name, "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
        for h, p in hosts]}]}
    return cluster


def _thresholds(*, connections: int, pending: int, requests: int) -> dict[str, Any]:
    return {"thresholds": [{
        "priority": "DEFAULT",
        "max_connections": connections,
        "max_pending_requests": pending,
        "max_requests": requests,
        "max_retries": 3,
        "track_remaining": True,
    }]}


def _policy(name: str, message: str, config: dict[str, Any]) -> dict[str, Any]:
    return {"typed_extension_config": {"name": f"envoy.load_balancing_policies.{name}",
                                       "typed_config": {TYPE: API + message, **config}}}


def override_host_policy() -> dict[str, Any]:
    """The pool's balancer when extproc picks its pods (``endpoint_picker``).

    Envoy's override_host follows the endpoint picker protocol's ``envoy.lb`` metadata
    (``ip:port,ip:port``): the first listed pod of the cluster, the next one on each retry,
    then least request once the list is used up; without the metadata, least request. It reads
    the metadata only, never a header: only a filter (extproc) can set dynamic metadata, while
    a header could come from the client. It does not look at health (docs/concepts/picker.md):
    the picker must leave out pods it knows are down. ``selected_host_key`` records the pod
    used, as the protocol's ``x-gateway-destination-endpoint-served`` (access log, extproc).
    """
    lb_key = {"key": LB_METADATA_NAMESPACE}
    return {"policies": [_policy(
        "override_host", "extensions.load_balancing_policies.override_host.v3.OverrideHost", {
            "override_host_sources": [
                {"metadata": {**lb_key, "path": [{"key": DESTINATION_ENDPOINT}]}}],
            "selected_host_key": {**lb_key, "path": [{"key": DESTINATION_ENDPOINT_SERVED}]},
            "fallback_policy": {"policies": [_policy(
                "least_request", "extensions.load_balancing_policies.least_request.v3"
                                 ".LeastRequest", {})]},
        })]}


def pool_cluster(name: str, spec: ClusterSpec) -> dict[str, Any]:
    """One vLLM pool: HTTP/1.1 to each pod, health-checked and ejected when failing."""
    cluster = _base(name, spec.endpoints)
    if spec.endpoint_picker is not None:
        cluster["load_balancing_policy"] = override_host_policy()
    else:
        cluster["lb_policy"] = "LEAST_REQUEST"
    cluster.update({
        "health_checks": [{
            "timeout": "2s",
            "interval": "5s",
            "interval_jitter": "1s",
            "unhealthy_threshold": 3,
            "healthy_threshold": 1,
            # An idle pool (a canary at 0 %) is still probed, so it is known healthy when used.
            "no_traffic_interval": "10s",
            "http_health_check": {"path": VLLM_HEALTH_PATH},
        }],
        "outlier_detection": {
            "consecutive_5xx": 5,
            "consecutive_gateway_failure": 3,
            "enforcing_consecutive_gateway_failure": 100,
            "interval": "10s",
            "base_ejection_time": "30s",
            "max_ejection_percent": 50,
        },
        # HTTP/1.1: one connection per in-flight request, and a generation can last minutes.
        "circuit_breakers": _thresholds(connections=4096, pending=1024, requests=4096),
        "typed_extension_protocol_options": {HTTP_OPTIONS: {
            TYPE: API + "extensions.upstreams.http.v3.HttpProtocolOptions",
            "common_http_protocol_options": {"idle_timeout": POOL_IDLE_TIMEOUT},
            "explicit_http_config": {"http_protocol_options": {}},
        }},
    })
    return cluster


def _unix_cluster(name: str, address: str) -> dict[str, Any]:
    """A cluster of one Unix socket (``unix:/path``): a sidecar in the same pod as Envoy."""
    path = address[len(UNIX_PREFIX):]
    return {"name": name, "type": "STATIC", "connect_timeout": "2s", "load_assignment": {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": path}}}}]}]}}


def _tls_socket(tls: ServicesTls) -> dict[str, Any]:
    """Envoy → service TLS: verify the service against ``ca_file`` (and ``server_name``)."""
    validation: dict[str, Any] = {"trusted_ca": {"filename": tls.ca_file}}
    if tls.server_name:
        validation["match_typed_subject_alt_names"] = [
            {"san_type": "DNS", "matcher": {"exact": tls.server_name}}]
    common: dict[str, Any] = {"alpn_protocols": ["h2"], "validation_context": validation}
    if tls.cert_file and tls.key_file:
        common["tls_certificates"] = [{"certificate_chain": {"filename": tls.cert_file},
                                       "private_key": {"filename": tls.key_file}}]
    context: dict[str, Any] = {TYPE: API + "extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                               "common_tls_context": common}
    if tls.server_name:
        context["sni"] = tls.server_name
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def grpc_cluster(name: str, address: str, tls: ServicesTls | None = None) -> dict[str, Any]:
    """extproc or ratelimit: HTTP/2, gRPC health-checked, sized for a stream per request; over
    TLS with ``tls``; a Unix socket for a ``unix:/path`` address."""
    unix = address.startswith(UNIX_PREFIX)
    cluster = _unix_cluster(name, address) if unix else _base(name, [address])
    if tls is not None:
        cluster["transport_socket"] = _tls_socket(tls)
    cluster.update({
        "lb_policy": "ROUND_ROBIN",
        # A replica that hangs (accepts, never answers) costs every request sent to it the
        # ext_proc message timeout, so it is found in ~2 checks (3-6 s) and skipped. The
        # no-traffic interval too: Envoy's default (60 s) applies until a cluster has seen
        # traffic, which left a replica that froze in Envoy's first minute in use for a minute.
        "health_checks": [{
            "timeout": "1s",
            "interval": "2s",
            "no_traffic_interval": "2s",
            "unhealthy_threshold": 2,
            "healthy_threshold": 1,
            "grpc_health_check": {},
        }],
        # ext_proc holds one gRPC stream per in-flight HTTP request (for its whole life): the
        # default of 1024 concurrent requests would cap the gateway at 1024 open generations.
        "circuit_breakers": _thresholds(connections=1024, pending=100_000, requests=100_000),
        "typed_extension_protocol_options": {HTTP_OPTIONS: {
            TYPE: API + "extensions.upstreams.http.v3.HttpProtocolOptions",
            "common_http_protocol_options": {"idle_timeout": f"{SERVICE_IDLE_TIMEOUT_S:g}s"},
            "explicit_http_config": {"http2_protocol_options": {
                "connection_keepalive": {"interval": "30s", "timeout": "5s"},
                # The services' limit, kept from Envoy's side too (it opens another connection
                # rather than send a stream the server would refuse before its SETTINGS came).
                "max_concurrent_streams": GRPC_MAX_CONCURRENT_STREAMS,
            }},
        }},
    })
    return cluster


def service_clusters(config: RoutingConfig) -> list[dict[str, Any]]:
    """The gRPC clusters of extproc and (when there are limits) ratelimit."""
    tls = config.services.tls
    out = [grpc_cluster(EXTPROC_CLUSTER, config.services.extproc, tls)]
    if config.rate_limits is not None:
        out.append(grpc_cluster(RATELIMIT_CLUSTER, config.services.ratelimit, tls))
    return out


def pool_clusters(config: RoutingConfig) -> list[dict[str, Any]]:
    """The vLLM pools' clusters (with ``envoy.dynamic_pools``, what ``xds/cds.yaml`` holds)."""
    return [pool_cluster(name, spec) for name, spec in config.clusters.items()]


def clusters(config: RoutingConfig) -> list[dict[str, Any]]:
    return [*pool_clusters(config), *service_clusters(config)]
