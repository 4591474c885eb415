"""The extproc and ratelimit clusters, as the bootstrap and the Istio EnvoyFilter render them."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import yaml

from routing.render.clusters import EXTPROC_CLUSTER, HTTP_OPTIONS, RATELIMIT_CLUSTER
from routing.units import parse_duration
from sidecar_runtime.h2grpc.limits import Limits
from sidecar_runtime.wire.names import GRPC_MAX_CONCURRENT_STREAMS
from tests.harness.gateway import default_doc
from tests.routing.test_render import render_doc, validate

LIMITS = {"api_key": {"default": {"requests": "10/s", "tokens": "100k/min"}}}


def service_docs() -> dict[str, dict[str, Any]]:
    """The services on TCP by DNS name, and on Unix sockets (a ``pipe`` cluster)."""
    dns = default_doc()
    dns["services"] = {"extproc": "extproc.llm.svc:50051", "ratelimit": "ratelimit.llm.svc:50052"}
    unix = default_doc()
    unix["services"] = {"extproc": "unix:/run/llm-sidecar/extproc.sock",
                        "ratelimit": "unix:/run/llm-sidecar/ratelimit.sock"}
    for doc in (dns, unix):
        doc["rate_limits"] = LIMITS
    return {"dns": dns, "unix": unix}


def _service_options(clusters: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c["typed_extension_protocol_options"][HTTP_OPTIONS] for c in clusters
            if c["name"] in (EXTPROC_CLUSTER, RATELIMIT_CLUSTER)}


@pytest.mark.parametrize("name", sorted(service_docs()))
def test_envoy_closes_an_idle_service_connection_before_the_server_does(
        name: str, tmp_path: pathlib.Path) -> None:
    """The services' server ends a connection with no stream and no frame for
    ``Limits.idle_timeout_s`` (GOAWAY); Envoy's upstream idle timeout for both service
    clusters is well below it, so Envoy closes first and never sends a request into a
    connection the server is closing. Merged into the clusters' one HttpProtocolOptions
    (its HTTP/2 options kept), in the bootstrap and in the EnvoyFilter alike."""
    written = render_doc(service_docs()[name], tmp_path)
    bootstrap = yaml.safe_load(written["envoy.yaml"].read_text())
    envoy_filter = yaml.safe_load(written["envoyfilter.yaml"].read_text())
    rendered = {
        "bootstrap": _service_options(bootstrap["static_resources"]["clusters"]),
        "envoyfilter": _service_options([p["patch"]["value"]
                                         for p in envoy_filter["spec"]["configPatches"]
                                         if p["applyTo"] == "CLUSTER"]),
    }
    server_idle_s = Limits().idle_timeout_s
    for where, options in rendered.items():
        assert sorted(options) == [EXTPROC_CLUSTER, RATELIMIT_CLUSTER], where
        for cluster, option in options.items():
            idle_s = parse_duration(option["common_http_protocol_options"]["idle_timeout"])
            assert idle_s <= server_idle_s / 2, (where, cluster, idle_s)
            http2 = option["explicit_http_config"]["http2_protocol_options"]
            assert http2["max_concurrent_streams"] == GRPC_MAX_CONCURRENT_STREAMS
            # Envoy's keepalive PINGs, well inside its own idle timeout, are frames the
            # server counts: an idle connection stays open to the server until Envoy closes it.
            assert parse_duration(http2["connection_keepalive"]["interval"]) < idle_s
    validate(written["envoy.yaml"])
