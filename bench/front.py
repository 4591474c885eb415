"""The gateway under test: the bench routing YAML and the front Envoy's bootstrap per variant.

Every variant starts from the bootstrap ``llm-sidecar render`` writes for the bench routing YAML
(same listener, access log, local replies, clusters) and takes filters away:

- ``bare``: no ext_proc, no ratelimit; the route picks the cluster from ``x-bench-cluster``,
  which the load generator sends on every request (extproc ignores it);
- ``headers``: ext_proc sees request headers only (no body, no response, no mode override);
  requests extproc did not route go to the ``x-bench-cluster`` pool;
- ``body``: ext_proc as rendered (buffered request body, the response phases it asks for),
  no ratelimit filter;
- ``full``: exactly as rendered: ext_proc, then ratelimit, then the router.
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any, Literal

import yaml

from bench import bodies
from bench.paced import POOLS
from routing.loader import load_config
from routing.render.envoy import bootstrap
from routing.schema import RoutingConfig

Variant = Literal["bare", "headers", "body", "full"]
BENCH_CLUSTER_HEADER = "x-bench-cluster"
EXT_PROC = "envoy.filters.http.ext_proc"
RATELIMIT = "envoy.filters.http.ratelimit"
HUGE = "1000M/min"
"""Limits the benchmark never reaches: every request takes the admitted path."""


def routing_doc(*, listen: int, admin: int, extproc: int, ratelimit: int,
                upstream: tuple[int, int, int], paced: dict[str, int]) -> dict[str, Any]:
    """The bench routing YAML: the short, long and embeddings pools on the stand-in upstream's
    three listeners, each paced pool (``paced``: port by cluster) on its paced SSE server."""
    def at(port: int) -> list[str]:
        return [f"127.0.0.1:{port}"]

    limit = {"requests": "1M/s", "tokens": HUGE}
    return {
        "version": 1,
        "envoy": {"listen": f"127.0.0.1:{listen}", "admin": f"127.0.0.1:{admin}"},
        "services": {"extproc": f"127.0.0.1:{extproc}", "ratelimit": f"127.0.0.1:{ratelimit}"},
        "clusters": {
            "pool-short": {"endpoints": at(upstream[0]), "max_context": 4096},
            # 131072: a 220 KB prompt (~75K tokens by the estimate) fits a Llama-3.1-class pool.
            "pool-long": {"endpoints": at(upstream[1]), "max_context": 131072},
            "embed": {"endpoints": at(upstream[2]), "max_context": 8192},
            **{pool.cluster: {"endpoints": at(paced[pool.cluster]), "max_context": 4096}
               for pool in POOLS},
        },
        "models": {
            bodies.MODEL: {"clusters": ["pool-short", "pool-long"], "default_max_tokens": 64},
            **{pool.model: {"clusters": [pool.cluster], "default_max_tokens": 64}
               for pool in POOLS},
            bodies.EMBED_MODEL: {"kind": "embedding", "clusters": ["embed"],
                                 "cache": {"namespace": "bench-embed", "ttl": "1h"}},
        },
        "rate_limits": {
            # The example config's three levels, with limits no run reaches.
            "api_key": {"default": limit},
            "tenant": {"default": limit},
            "model": {"overrides": {bodies.MODEL: limit, **{p.model: limit for p in POOLS}}},
            "on_backend_error": "allow",
        },
    }


def bench_config() -> RoutingConfig:
    """The bench routing YAML loaded as the services load it, its ports placeholders: for the
    benches that time the services' Python without starting anything."""
    doc = routing_doc(listen=1, admin=2, extproc=3, ratelimit=4, upstream=(5, 6, 7),
                      paced={pool.cluster: 8 for pool in POOLS})
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.safe_dump(doc, handle)
    try:
        return load_config(handle.name)
    finally:
        os.unlink(handle.name)


def _hcm(doc: dict[str, Any]) -> dict[str, Any]:
    listener = doc["static_resources"]["listeners"][0]
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def _route_by_bench_header(hcm: dict[str, Any]) -> None:
    """The pool routes (extproc's decision) stay first; every other request picks its cluster
    from ``x-bench-cluster`` (a bench-only front: the gateway itself never routes on a header)."""
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    routed = [r for r in routes if r["name"].startswith("llm-routed-")]
    fallback = copy.deepcopy(routed[0])
    fallback["name"] = "bench-fallback"
    fallback["match"] = {"prefix": "/"}
    del fallback["route"]["cluster"]
    fallback["route"]["cluster_header"] = BENCH_CLUSTER_HEADER
    routes[:] = [*routed, fallback]


def front_bootstrap(config: RoutingConfig, variant: Variant) -> dict[str, Any]:
    doc = bootstrap(config)
    hcm = _hcm(doc)
    filters: list[dict[str, Any]] = hcm["http_filters"]
    if variant == "full":
        return doc
    if variant == "bare":
        filters[:] = [f for f in filters if f["name"] not in (EXT_PROC, RATELIMIT)]
        _route_by_bench_header(hcm)
        return doc
    filters[:] = [f for f in filters if f["name"] != RATELIMIT]
    if variant == "headers":
        ext = next(f for f in filters if f["name"] == EXT_PROC)["typed_config"]
        ext["processing_mode"] = {
            "request_header_mode": "SEND", "request_body_mode": "NONE",
            "response_header_mode": "SKIP", "response_body_mode": "NONE",
            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP",
        }
        ext["allow_mode_override"] = False
        _route_by_bench_header(hcm)
    return doc
