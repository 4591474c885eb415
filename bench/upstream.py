"""The stand-in upstream: a second Envoy process that answers like vLLM from ``direct_response``.

Envoy answers in a few microseconds of C++, so what the benchmark measures is the gateway, not
the simulator. Routes (any method):

- ``/health`` → 200 (the pool clusters' active health check);
- ``/v1/chat/completions`` and ``/v1/completions`` with ``x-bench-stream: 1`` → an SSE stream
  (``text/event-stream``, one event per token, usage chunk, ``[DONE]``), sent as one body;
- the same paths without it → a ``chat.completion`` JSON with ``usage``;
- ``/v1/embeddings`` → an embeddings list.

Tokens that arrive over time (one chunk per token, each a separate ext_proc message) come from
:mod:`bench.paced`, a small asyncio server, since ``direct_response`` sends its body at once.
"""

from __future__ import annotations

from typing import Any

from bench import bodies

TYPE = "@type"
API = "type.googleapis.com/envoy."
MAX_BODY = 4 * 1024 * 1024


def _direct(prefix: str, body: str, content_type: str,
            headers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    route: dict[str, Any] = {
        "match": {"prefix": prefix, **({"headers": headers} if headers else {})},
        "direct_response": {"status": 200, "body": {"inline_string": body}},
        "response_headers_to_add": [{"header": {"key": "content-type", "value": content_type},
                                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
    }
    return route


def routes() -> list[dict[str, Any]]:
    stream = [{"name": "x-bench-stream", "present_match": True}]
    sse = "".join(bodies.sse_events())
    chat = bodies.chat_response()
    return [
        _direct("/health", "", "text/plain"),
        _direct("/v1/chat/completions", sse, "text/event-stream", stream),
        _direct("/v1/completions", sse, "text/event-stream", stream),
        _direct("/v1/chat/completions", chat, "application/json"),
        _direct("/v1/completions", chat, "application/json"),
        _direct("/v1/embeddings", bodies.embeddings_response(), "application/json"),
        {"match": {"prefix": "/"}, "direct_response": {"status": 404}},
    ]


def bootstrap(ports: list[int], admin_port: int) -> dict[str, Any]:
    """An Envoy bootstrap with the same listener on each of 127.0.0.1:``ports`` (one per pool:
    a vLLM server belongs to one pool) and no clusters."""
    hcm = {
        TYPE: API + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "upstream",
        "codec_type": "AUTO",
        "route_config": {
            "name": "upstream",
            "max_direct_response_body_size_bytes": MAX_BODY,
            "virtual_hosts": [{"name": "vllm", "domains": ["*"], "routes": routes()}],
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            TYPE: API + "extensions.filters.http.router.v3.Router"}}],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": admin_port}}},
        "static_resources": {"listeners": [{
            "name": f"upstream-{port}",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": hcm,
            }]}],
        } for port in ports]},
    }
