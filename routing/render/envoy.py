"""Routing YAML → Envoy bootstrap (``envoy.yaml``), as plain dicts dumped to YAML.

Cold path, built without ``envoy-data-plane``: every config rendered here is checked by
``envoy --mode validate`` in the tests. The filter chain is health_check (``/healthz``) →
(the usage strip) → ext_proc → (the fallback route's query cut) → (the usage reader) →
ratelimit → router; the router takes the pool extproc decided, named in dynamic
metadata only a filter can set (``x-llm-cluster`` carries the same name, for logs and pods).
Clusters are built in :mod:`routing.render.clusters`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from routing.ratelimits import DOMAIN, route_rate_limits
from routing.render.bounds import http2_options, overload_manager
from routing.render.clusters import (
    API,
    EXTPROC_CLUSTER,
    RATELIMIT_CLUSTER,
    TYPE,
    clusters,
    service_clusters,
)
from routing.render.usage import usage_filters_after_ext_proc, usage_filters_before_ext_proc
from routing.render.xds import (
    FINGERPRINT_DIR,
    ROUTE_CONFIG_NAME,
    XDS_NODE,
    dynamic_resources,
    rds,
)
from routing.schema import RoutingConfig
from routing.units import parse_duration, parse_hostport
from sidecar_runtime.wire.names import (
    BOOTSTRAP_HEADER,
    CLIENT_CREDENTIALS,
    CLUSTER_METADATA_KEY,
    DESTINATION_ENDPOINT,
    ENVOY_USAGE_HEADER,
    LB_METADATA_NAMESPACE,
    LLM_HEADER_PREFIX,
    METADATA_NAMESPACE,
    RATELIMIT_BACKEND_HEADER,
    RESERVATION_METADATA_KEY,
)

RATELIMIT_DOMAIN = DOMAIN
HEALTH_PATH = "/healthz"
"""Answered by Envoy itself (200, or 503 while draining): probes need no admin access."""


def sidecar_retry(retry_on: str, max_interval_s: float = 0.05) -> dict[str, Any]:
    """Retry policy of the gRPC stream to extproc or ratelimit: another replica, quickly.

    Envoy (1.40 included) also uses ``retry_back_off.max_interval`` as the per-try timeout of
    a gRPC call made with this policy (envoyproxy/envoy#38847). For a unary call (ratelimit)
    that bounds every decision: with 50 ms, Envoy gave up on any decision slower than 50 ms
    and failed open, whatever ``services.ratelimit_timeout_s`` said. The backoff itself stays
    short either way (10 ms base, doubling, 2 retries).
    """
    return {
        **retry_on_another_host(retry_on),
        "retry_back_off": {"base_interval": "0.01s", "max_interval": f"{max_interval_s:g}s"},
    }


def retry_on_another_host(retry_on: str) -> dict[str, Any]:
    """Up to 2 retries on ``retry_on``, each to a host not tried yet (re-picked up to 3 times):
    the part of every retry policy rendered here (vLLM pools, extproc, ratelimit)."""
    return {
        "retry_on": retry_on,
        "num_retries": 2,
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {TYPE: API + "extensions.retry.host.previous_hosts.v3"
                                         ".PreviousHostsPredicate"},
        }],
        "host_selection_retry_max_attempts": 3,
    }


# A replica that is draining (SIGTERM: listener closed, GOAWAY sent, calls that raced the
# shutdown answered CANCELLED or reset) or just died refuses a new stream before answering it:
# open it on another replica instead of failing the request. Envoy retries only before the
# response starts, so a stream extproc already answered is never retried; a rate-limit call
# that was reset or cancelled may have charged its buckets, so only a refused one is retried.
# ext_proc's stream keeps its request side open for the whole HTTP exchange, so the implicit
# per-try timeout never starts on it: a hung extproc replica costs its message_timeout.
EXTPROC_RETRY = sidecar_retry("connect-failure,refused-stream,unavailable,cancelled,reset")
RATELIMIT_RETRY_ON = "connect-failure,refused-stream,unavailable"


def _address(text: str) -> dict[str, Any]:
    host, port = parse_hostport(text)
    return {"socket_address": {"address": host, "port_value": port}}


def _json_error(message: str, type_: str, code: str) -> dict[str, Any]:
    """A local-reply body format that renders OpenAI's error JSON."""
    return {
        "json_format": {"error": {"message": message, "type": type_, "param": None, "code": code}},
        "content_type": "application/json",
    }


def _cel(expression: str) -> dict[str, Any]:
    return {"extension_filter": {
        "name": "envoy.access_loggers.extension_filters.cel",
        "typed_config": {TYPE: API + "extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                         "expression": expression},
    }}


def local_reply_config() -> dict[str, Any]:
    """Envoy's own error replies as OpenAI JSON; replies extproc or ratelimit wrote are kept."""
    return {"mappers": [
        {   # body bigger than the ext_proc buffer
            "filter": _cel("response.code_details == 'request_payload_too_large'"),
            "body_format_override": _json_error(
                "The request body is larger than the gateway accepts.", "invalid_request_error",
                "request_too_large"),
        },
        {   # the rate limiter denied because its store (Redis) is down: fail closed as a 503,
            # keeping the JSON body the rate limiter wrote
            "filter": _cel(f"response.code == 429 && "
                           f"'{RATELIMIT_BACKEND_HEADER}' in response.headers"),
            "status_code": 503,
        },
        {   # no upstream, upstream failure, or a sidecar service down and failing closed
            "filter": {"or_filter": {"filters": [
                {"response_flag_filter": {"flags": ["UH", "UF", "NR", "NC", "URX", "UO", "UC",
                                                    "RLSE", "UAEX"]}},
                _cel("response.code_details.startsWith('ext_proc_error')"),
            ]}},
            "status_code": 503,
            "body_format_override": _json_error(
                "The model backend or a gateway service is unavailable "
                "(%RESPONSE_CODE_DETAILS%).", "server_error", "upstream_unavailable"),
        },
        {   # the overload manager refused the request (heap above 95% of envoy.max_heap_bytes);
            # Envoy sets no response flag for it, only these details
            "filter": _cel("response.code_details == 'overload'"),
            "status_code": 503,
            "body_format_override": _json_error(
                "The gateway is overloaded; retry later.", "server_error", "server_overloaded"),
        },
        {
            "filter": {"response_flag_filter": {"flags": ["UT"]}},
            "body_format_override": _json_error(
                "The model backend timed out.", "server_error", "upstream_timeout"),
        },
        # Every other reply of Envoy's own (its HTTP codec's 400, 408, 426, 431 and 501, an
        # upgrade's 403, ...) is text or empty: OpenAI JSON too, naming Envoy's details. A reply
        # that is JSON already (extproc's, the rate limiter's) is left as it is.
        *({"filter": _cel(f"response.code >= {low} && response.code <= {high} && "
                          f"!{_JSON_REPLY}"),
           "body_format_override": _json_error(
               "The gateway refused the request (%RESPONSE_CODE_DETAILS%).", type_,
               "%RESPONSE_CODE_DETAILS%")}
          for low, high, type_ in ((400, 499, "invalid_request_error"),
                                   (500, 599, "server_error"))),
    ]}


_JSON_REPLY = ("('content-type' in response.headers && "
               "response.headers['content-type'].startsWith('application/json'))")
"""CEL: the reply carries a JSON body already (extproc's replies, the rate limiter's 429)."""


def access_log() -> list[dict[str, Any]]:
    """One JSON line per request on stdout; Kubernetes probes of ``/healthz`` are left out."""
    fields = {
        "time": "%START_TIME%", "request_id": "%REQ(X-REQUEST-ID)%", "method": "%REQ(:METHOD)%",
        # Without the query: a client that put its key there (?key=sk-...) must not have it
        # written to the log.
        "path": "%REQ_WITHOUT_QUERY(:PATH)%", "status": "%RESPONSE_CODE%",
        "details": "%RESPONSE_CODE_DETAILS%",
        "flags": "%RESPONSE_FLAGS%", "cluster": "%UPSTREAM_CLUSTER%",
        "upstream_host": "%UPSTREAM_HOST%", "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
        "model": "%REQ(X-LLM-MODEL)%", "variant": "%REQ(X-LLM-VARIANT)%",
        "tenant": "%REQ(X-LLM-TENANT)%", "key_id": "%REQ(X-LLM-KEY-ID)%",
        # The tokens extproc reserved for the request (prompt + requested output, docs: Rate limits).
        "reservation": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{RESERVATION_METADATA_KEY})%",
        # The pods extproc picked (endpoint_picker pools), best first; upstream_host: the one used.
        "picked": f"%DYNAMIC_METADATA({LB_METADATA_NAMESPACE}:{DESTINATION_ENDPOINT})%",
        "bytes_in": "%BYTES_RECEIVED%", "bytes_out": "%BYTES_SENT%",
        # duration: whole stream; request: until the body was read; first_byte: until the
        # first response byte (time to first token, for a stream).
        "duration_ms": "%DURATION%", "request_ms": "%REQUEST_DURATION%",
        "first_byte_ms": "%RESPONSE_DURATION%",
        "upstream_ms": "%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%",
    }
    return [{
        "name": "envoy.access_loggers.stdout",
        "filter": {"not_health_check_filter": {}},
        "typed_config": {TYPE: API + "extensions.access_loggers.stream.v3.StdoutAccessLog",
                         "log_format": {"json_format": fields, "formatters": [{
                             "name": "envoy.formatter.req_without_query",
                             "typed_config": {TYPE: API + "extensions.formatter."
                                              "req_without_query.v3.ReqWithoutQuery"}}]}},
    }]


def health_check_filter() -> dict[str, Any]:
    """``GET /healthz`` answered by Envoy: 200, or 503 once it drains (admin healthcheck/fail)."""
    return {
        "name": "envoy.filters.http.health_check",
        "typed_config": {
            TYPE: API + "extensions.filters.http.health_check.v3.HealthCheck",
            "pass_through_mode": False,
            "headers": [{"name": ":path", "string_match": {"exact": HEALTH_PATH}}],
        },
    }


WAIT_MARGIN_S = 1.0
"""How much longer than the longest flow-control wait Envoy waits for extproc's answer: the
503 that ends a wait must reach Envoy before Envoy gives up on extproc."""


def extproc_message_timeout_s(config: RoutingConfig) -> float:
    """ext_proc's ``message_timeout``: ``services.extproc_timeout_s``, or longer than the
    longest ``flow_control.max_wait`` of a pool (a request holds its body answer that long),
    so that Envoy never gives up on a request extproc is holding (docs: Flow control)."""
    waits = [spec.endpoint_picker.flow_control.max_wait_s for spec in config.clusters.values()
             if spec.endpoint_picker is not None and spec.endpoint_picker.flow_control is not None]
    longest = max(waits, default=0.0)
    return max(config.services.extproc_timeout_s, longest + WAIT_MARGIN_S if waits else 0.0)


def ext_proc_filter(config: RoutingConfig) -> dict[str, Any]:
    # extproc hands the LLM tokens a response used to the rate limiter in llm_sidecar, and
    # (endpoint_picker pools) the picked pods to the override_host balancer in envoy.lb.
    # With dynamic pools, always: a pool with a picker may arrive while Envoy runs.
    namespaces = [METADATA_NAMESPACE]
    if config.envoy.dynamic_pools or any(spec.endpoint_picker is not None
                                         for spec in config.clusters.values()):
        namespaces.append(LB_METADATA_NAMESPACE)
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            TYPE: API + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}, "timeout": "10s",
                             "retry_policy": EXTPROC_RETRY},
            "failure_mode_allow": config.services.failure_mode_allow,
            "status_on_error": {"code": 503},
            "message_timeout": f"{extproc_message_timeout_s(config):g}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "response_header_mode": "SKIP",
                "response_body_mode": "NONE",
                # Trailers with no body before them (HTTP/2 HEADERS, then trailers) would
                # otherwise reach no extproc step that decides the request.
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SKIP",
            },
            "allow_mode_override": True,
            "mutation_rules": {"allow_all_routing": True},
            "metadata_options": {"receiving_namespaces": {"untyped": namespaces}},
        },
    }


def ratelimit_filter(config: RoutingConfig) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ratelimit",
        "typed_config": {
            TYPE: API + "extensions.filters.http.ratelimit.v3.RateLimit",
            "domain": RATELIMIT_DOMAIN,
            # The service answers within its Redis deadline (50 ms by default) plus a margin.
            "timeout": f"{config.services.ratelimit_timeout_s}s",
            "failure_mode_deny": config.services.ratelimit_failure_mode_deny,
            "status_on_error": {"code": 503},
            "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
            # Filter-level actions: Envoy honours hits_addend (0 = check only, or the tokens
            # extproc reported) on these, and evaluates apply_on_stream_done ones at the end.
            "rate_limits": route_rate_limits(config, every_level=True),
            "rate_limit_service": {
                "grpc_service": {"envoy_grpc": {"cluster_name": RATELIMIT_CLUSTER},
                                 # Each try may use the whole timeout (see sidecar_retry).
                                 "retry_policy": sidecar_retry(
                                     RATELIMIT_RETRY_ON, config.services.ratelimit_timeout_s)},
                "transport_api_version": "V3",
            },
        },
    }


def strip_llm_headers() -> dict[str, Any]:
    """Drop every client-sent ``x-llm-*`` and ``x-gateway-destination-endpoint*`` header
    before routing or any filter sees it (the second: no pod may take a client's value for
    extproc's pick; the prefix also covers the protocol's ``-subset`` and ``-served`` names).

    An early header mutation (not an HTTP filter): it runs before the route is chosen, so no
    route is ever picked on a client's ``x-llm-*`` header, whatever extproc later answers (or
    does not: a request failing open past an unreachable extproc, or one extproc never saw a
    body of). extproc also drops them itself (Istio setups that do not merge this patch).
    """
    return {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            TYPE: API + "extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{"remove_on_match": {"key_matcher": {"prefix": prefix}}}
                          for prefix in (LLM_HEADER_PREFIX, DESTINATION_ENDPOINT)],
        },
    }


CLIENT_REQUEST_ID = "x-client-request-id"


def own_request_id() -> dict[str, Any]:
    """Move a client's ``x-request-id`` to ``x-client-request-id``, so Envoy generates the id.

    Envoy keeps a client's id whenever it does not count the request as coming from the edge
    (``use_remote_address`` off, or a client on a private network, whatever
    ``preserve_external_request_id`` says): a client could then choose its id, and with it its
    ``sticky: request`` canary variant, or collide with another request's id in the logs. The
    client's value still travels (to the pool, for tracing) under another name.
    """
    return {
        "name": "envoy.http.early_header_mutation.header_mutation.request_id",
        "typed_config": {
            TYPE: API + "extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [
                {"append": {"header": {"key": CLIENT_REQUEST_ID, "value": "%REQ(x-request-id)%"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}},
                {"remove": "x-request-id"},
            ],
        },
    }


def _marker(name: str, header: str, value: str) -> dict[str, Any]:
    """``header: value`` on every request, after the client's ``x-llm-*`` are removed (so no
    client can send it)."""
    return {
        "name": f"envoy.http.early_header_mutation.header_mutation.{name}",
        "typed_config": {
            TYPE: API + "extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{"append": {"header": {"key": header, "value": value},
                                      "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}],
        },
    }


def early_header_mutations(envoy_usage: bool = False,
                           fingerprint: str | None = None) -> dict[str, Any]:
    """The connection manager's ``early_header_mutation_extensions``, run before routing and
    before Envoy makes the request id: always rendered (extproc failing closed is no
    protection for a request whose route was chosen before it answered). ``envoy_usage``: the
    bootstrap has the usage filters, and says so to extproc (:data:`ENVOY_USAGE_HEADER`);
    ``fingerprint``: the bootstrap's own, told to extproc (:data:`BOOTSTRAP_HEADER`)."""
    markers = [_marker("envoy_usage", ENVOY_USAGE_HEADER, "1")] if envoy_usage else []
    if fingerprint is not None:
        markers.append(_marker("bootstrap", BOOTSTRAP_HEADER, fingerprint))
    return {"early_header_mutation_extensions": [strip_llm_headers(), own_request_id(),
                                                 *markers]}


UNDERSCORE_HEADERS_DROPPED = {
    "common_http_protocol_options": {"headers_with_underscores_action": "DROP_HEADER"}}
"""A header name with "_" is dropped: a server behind a pool that reads "_" as "-" (CGI-style,
nginx's ``underscores_in_headers``) would take a client's ``x_llm_tenant`` for the
``x-llm-tenant`` extproc set, or ``x_api_key`` for a credential never removed."""


def router_filter() -> dict[str, Any]:
    return {"name": "envoy.filters.http.router",
            "typed_config": {TYPE: API + "extensions.filters.http.router.v3.Router"}}


def upstream_credentials(config: RoutingConfig, cluster: str) -> dict[str, Any]:
    """The route's header changes: the client's credentials out, the pool's own key in (read by
    Envoy from its environment at each request, so it is in no file and no other process)."""
    out: dict[str, Any] = {"request_headers_to_remove": list(CLIENT_CREDENTIALS)}
    env = config.clusters[cluster].upstream_api_key_env
    if env is not None:
        out["request_headers_to_add"] = [{
            "header": {"key": "authorization", "value": f"Bearer %ENVIRONMENT({env})%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }]
    return out


def _upstream(config: RoutingConfig, cluster: str) -> dict[str, Any]:
    """Route settings to the vLLM pool ``cluster``."""
    idle = f"{parse_duration(config.envoy.stream_idle_timeout)}s"
    return {
        "cluster": cluster,
        # No whole-request timeout may cut a long generation or an SSE stream: an idle
        # timeout ends stuck ones instead.
        "timeout": "0s",
        "idle_timeout": idle,
        # Retry only what never reached vLLM (a generation is not idempotent, and it
        # is expensive): a failed connect, or a reset before the request was sent.
        "retry_policy": retry_on_another_host("connect-failure,reset-before-request"),
    }


def routed_match(cluster: str) -> dict[str, Any]:
    """The match of the route to pool ``cluster``: extproc's decision, carried as dynamic
    metadata (``llm_sidecar.cluster``) that only a filter can set, never a client."""
    return {"prefix": "/", "dynamic_metadata": [{
        "filter": METADATA_NAMESPACE,
        "path": [{"key": CLUSTER_METADATA_KEY}],
        "value": {"string_match": {"exact": cluster}},
    }]}


FALLBACK_QUERY_FILTER = "llm-sidecar.fallback_query"
"""A Lua filter after ext_proc that runs only on the fallback route (its per-route code)."""
_STRIP_QUERY_LUA = """
function envoy_on_request(handle)
  local headers = handle:headers()
  local path = headers:get(":path")
  if path == nil then return end
  local at = string.find(path, "[?;]")
  local encoded = string.find(path, "%%3[fF]")
  if encoded ~= nil and (at == nil or encoded < at) then at = encoded end
  if at ~= nil and at > 1 then headers:replace(":path", string.sub(path, 1, at - 1)) end
end
"""
"""Cuts ``:path`` at its query (``?``), or where a path parameter (``;``) or an encoded ``?``
(``%3F``) would put a key: no OpenAI path has either, and a pod's server may decode or log
them."""


def fallback_query_filter() -> dict[str, Any]:
    """The filter :func:`fallback_route` runs: no code of its own, so it does nothing on a pool
    route (extproc sends those the bare path itself)."""
    return {"name": FALLBACK_QUERY_FILTER,
            "typed_config": {TYPE: API + "extensions.filters.http.lua.v3.Lua",
                             # http.llm.lua.fallback_query.*: its runs apart from the strip's
                             "stat_prefix": "fallback_query"}}


def fallback_route(config: RoutingConfig, fallback: str) -> dict[str, Any]:
    """The route of a request extproc could not route (unreachable, failing open). Its query
    string is cut here (and a ``;`` or ``%3F`` tail), as extproc cuts the query on every
    request it routes: a client may put its key there (``?key=sk-...``), and no key reaches a
    pool."""
    return {"name": "llm-fallback", "match": {"prefix": "/"},
            "route": _upstream(config, fallback),
            **upstream_credentials(config, fallback),
            "typed_per_filter_config": {FALLBACK_QUERY_FILTER: {
                TYPE: API + "extensions.filters.http.lua.v3.LuaPerRoute",
                "source_code": {"inline_string": _STRIP_QUERY_LUA}}}}


def fails_open_to(config: RoutingConfig) -> str | None:
    """The pool a request goes to when extproc cannot be reached, if the config has one."""
    return config.services.fallback_cluster if config.services.failure_mode_allow else None


def routes(config: RoutingConfig) -> list[dict[str, Any]]:
    """One route per pool, taken only on extproc's decision; then the fallback or a 503.

    No route names its cluster from a header: a request reaches a pool only when extproc
    decided it (its body answer sets the metadata and clears the route cache), and a sidecar
    cluster (extproc, ratelimit) is never a route's target.
    """
    routed = [
        {"name": f"llm-routed-{name}", "match": routed_match(name),
         "route": _upstream(config, name), **upstream_credentials(config, name)}
        for name in config.clusters
    ]
    fallback = fails_open_to(config)
    if fallback is not None:
        # extproc was unreachable and the filter failed open: serve from the fallback pool
        # (unchecked, unlimited by token counts extproc would have read) rather than 503.
        return [*routed, fallback_route(config, fallback)]
    return [
        *routed,
        {
            "name": "llm-unrouted",
            "match": {"prefix": "/"},
            "direct_response": {"status": 503, "body": {"inline_string": (
                '{"error":{"message":"No model pool was chosen for this request.",'
                '"type":"server_error","param":null,"code":"upstream_unavailable"}}')}},
            "response_headers_to_add": [{"header": {"key": "content-type",
                                                    "value": "application/json"},
                                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        },
    ]


def route_configuration(config: RoutingConfig) -> dict[str, Any]:
    """The listener's routes: inline in the bootstrap, or ``xds/rds.yaml`` (``dynamic_pools``)."""
    return {"name": ROUTE_CONFIG_NAME, "virtual_hosts": [
        {"name": "llm", "domains": ["*"], "routes": routes(config)}]}


def _routes_source(config: RoutingConfig, xds_dir: str | None) -> dict[str, Any]:
    if not config.envoy.dynamic_pools:
        return {"route_config": route_configuration(config)}
    if xds_dir is None:
        raise ValueError("envoy.dynamic_pools: the bootstrap needs the folder of its xds files")
    return {"rds": rds(xds_dir)}


def http_connection_manager(config: RoutingConfig, fingerprint: str | None = None,
                            xds_dir: str | None = None) -> dict[str, Any]:
    """The listener's connection manager; ``xds_dir``: where its routes are (absolute), with
    ``envoy.dynamic_pools``."""
    envoy_usage = config.rate_limits is not None and config.telemetry.envoy_usage
    return {
        TYPE: API + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "llm",
        "codec_type": "AUTO",
        "generate_request_id": True,
        "always_set_request_id_in_response": True,
        # No whole-stream limit (generations and SSE streams may take minutes); a stream that
        # sends nothing for stream_idle_timeout is ended instead.
        "stream_idle_timeout": f"{parse_duration(config.envoy.stream_idle_timeout)}s",
        "request_timeout": f"{parse_duration(config.envoy.request_timeout)}s",
        "request_headers_timeout": "10s",
        "http2_protocol_options": http2_options(config.envoy),
        **UNDERSCORE_HEADERS_DROPPED,
        **early_header_mutations(envoy_usage, fingerprint),
        "access_log": access_log(),
        "local_reply_config": local_reply_config(),
        **_routes_source(config, xds_dir),
        "http_filters": [
            health_check_filter(),
            *(usage_filters_before_ext_proc() if envoy_usage else []),
            ext_proc_filter(config),
            *([fallback_query_filter()] if fails_open_to(config) is not None else []),
            *(usage_filters_after_ext_proc() if envoy_usage else []),
            *([ratelimit_filter(config)] if config.rate_limits is not None else []),
            router_filter(),
        ],
    }


def bootstrap(config: RoutingConfig, xds_dir: str | None = None) -> dict[str, Any]:
    """The full Envoy bootstrap for ``config``; the admin interface listens on loopback only.
    Every request it forwards carries its :func:`bootstrap_fingerprint`. With
    ``envoy.dynamic_pools``, ``xds_dir`` is the absolute folder of the pools' watched files
    (:mod:`routing.render.xds`)."""
    return _bootstrap(config, bootstrap_fingerprint(config), xds_dir)


def bootstrap_fingerprint(config: RoutingConfig) -> str:
    """What identifies the bootstrap ``config`` renders (without the fingerprint itself): Envoy
    sends it to extproc in :data:`BOOTSTRAP_HEADER`, and extproc compares it with its own
    config's, so an edit that needs ``render`` and an Envoy restart (a cluster, a service
    address, ``rate_limits:`` added to a file that had none) is reported, not silently half
    applied. With ``envoy.dynamic_pools`` the pools' clusters and routes are not in the
    bootstrap (Envoy reloads them from their files), so they do not change it; nor does the
    folder the files are in."""
    doc = _bootstrap(config, None, FINGERPRINT_DIR)
    # The order of the YAML's clusters changes neither Envoy's clusters nor its routes (each
    # route matches its own pool's metadata): it does not change the fingerprint.
    statics = doc["static_resources"]
    statics["clusters"] = sorted(statics["clusters"], key=lambda c: str(c["name"]))
    for listener in statics["listeners"]:
        for host in hcm_of_listener(listener).get("route_config", {}).get("virtual_hosts", []):
            host["routes"] = sorted(host["routes"], key=lambda r: str(r.get("name", "")))
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def hcm_of_listener(listener: dict[str, Any]) -> dict[str, Any]:
    """The connection manager config of a listener rendered here."""
    typed: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return typed


def _bootstrap(config: RoutingConfig, fingerprint: str | None,
               xds_dir: str | None) -> dict[str, Any]:
    dynamic = config.envoy.dynamic_pools
    if dynamic and xds_dir is None:
        raise ValueError("envoy.dynamic_pools: the bootstrap needs the folder of its xds files")
    doc: dict[str, Any] = {
        # The admin interface stays reachable when the client listener is full.
        "admin": {"address": _address(config.envoy.admin), "ignore_global_conn_limit": True},
        "overload_manager": overload_manager(config.envoy),
        "static_resources": {
            "listeners": [{
                "name": "llm",
                "address": _address(config.envoy.listen),
                # ext_proc buffers whole request bodies: the limit is the largest body accepted
                # (each HTTP/2 stream gets a buffer limit this size: see render_bounds).
                "per_connection_buffer_limit_bytes": config.envoy.max_request_bytes,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": http_connection_manager(config, fingerprint, xds_dir),
                }]}],
            }],
            # dynamic_pools: only the services here; the pools come from xds/cds.yaml.
            "clusters": service_clusters(config) if dynamic else clusters(config),
        },
    }
    if dynamic and xds_dir is not None:
        # Envoy refuses a cluster subscription, even a file, from a node without a name.
        doc["node"] = dict(XDS_NODE)
        doc["dynamic_resources"] = dynamic_resources(xds_dir)
    return doc
