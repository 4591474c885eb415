"""envoyfilter.yaml: the EnvoyFilter, applied to Istio-shaped configs, passes envoy validate."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import yaml

from routing.loader import validate as validate_config
from routing.render.envoy import http_connection_manager
from routing.render.istio import envoy_filter
from routing.schema import RoutingConfig
from routing.yamlsrc import Located
from sidecar_runtime.wire.names import ENVOY_USAGE_HEADER
from tests.harness import istio_patch
from tests.harness.gateway import default_doc
from tests.routing.test_render import validate


def config(failure_mode_allow: bool = False, **istio: Any) -> RoutingConfig:
    doc = default_doc()
    doc["services"] = {"extproc": "llm-sidecar-extproc.llm.svc.cluster.local:50051",
                       "ratelimit": "llm-sidecar-ratelimit.llm.svc.cluster.local:50052",
                       "failure_mode_allow": failure_mode_allow}
    doc["rate_limits"] = {"tenant": {"default": {"requests": "10/s", "tokens": "1M/min"}}}
    if istio:
        doc["istio"] = istio
    return validate_config(Located("t.yaml", doc, {}))


def http_filters(bootstrap: dict[str, Any], listener: str) -> list[list[str]]:
    found = next(x for x in bootstrap["static_resources"]["listeners"] if x["name"] == listener)
    return [[f["name"] for f in net["typed_config"]["http_filters"]]
            for chain in found["filter_chains"] for net in chain["filters"]
            if net["name"] == istio_patch.HCM]


PATCHED = ["envoy.filters.http.fault", "envoy.filters.http.cors", "envoy.filters.http.ext_proc",
           "envoy.filters.http.ratelimit", "envoy.filters.http.router"]


def test_sidecar_inbound_patches_validate(tmp_path: pathlib.Path) -> None:
    resource = envoy_filter(config())
    assert resource["spec"]["workloadSelector"] == {"labels": {"app": "llm-gateway"}}
    bootstrap, contexts = istio_patch.sidecar_bootstrap()
    patched, applied = istio_patch.apply(bootstrap, contexts, "sidecar", resource)
    assert all(applied), applied  # every patch found what it patches
    assert http_filters(patched, "virtualInbound") == [PATCHED]
    assert patched["static_resources"]["listeners"][0] == bootstrap["static_resources"]["listeners"][0]
    names = [c["name"] for c in patched["static_resources"]["clusters"]]
    assert names[-2:] == ["llm-sidecar-extproc", "llm-sidecar-ratelimit"]
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(patched))
    validate(path)


def test_gateway_patches_validate_and_reach_only_the_chosen_port(tmp_path: pathlib.Path) -> None:
    resource = envoy_filter(config(context="GATEWAY", namespace="istio-system", port=8080))
    assert resource["metadata"]["namespace"] == "istio-system"
    assert resource["spec"]["workloadSelector"] == {"labels": {"istio": "ingressgateway"}}
    bootstrap, contexts = istio_patch.gateway_bootstrap(8080)
    patched, applied = istio_patch.apply(bootstrap, contexts, "gateway", resource)
    assert all(applied), applied
    assert http_filters(patched, "0.0.0.0_8080") == [PATCHED]
    hcm = patched["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert hcm["typed_config"]["local_reply_config"]["mappers"]
    # A client's x_llm_tenant or x_api_key reaches no pool behind Istio either.
    assert hcm["typed_config"]["common_http_protocol_options"] == {
        "headers_with_underscores_action": "DROP_HEADER"}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(patched))
    validate(path)
    # A sidecar proxy is not touched by a GATEWAY filter, nor a gateway on another port.
    sidecar, sidecar_contexts = istio_patch.sidecar_bootstrap()
    assert not any(istio_patch.apply(sidecar, sidecar_contexts, "sidecar", resource)[1])
    other, other_contexts = istio_patch.gateway_bootstrap(9090)
    assert not any(istio_patch.apply(other, other_contexts, "gateway", resource)[1][:2])


@pytest.mark.parametrize("fail_open", [False, True])
def test_client_llm_headers_are_stripped_before_routing(tmp_path: pathlib.Path,
                                                         fail_open: bool) -> None:
    """Failing closed is no protection: Istio's VirtualService routes on x-llm-cluster before
    extproc answers, so the client's copy goes before any route is chosen, in either mode."""
    bootstrap, contexts = istio_patch.sidecar_bootstrap()
    resource = envoy_filter(config(failure_mode_allow=fail_open))
    patched, applied = istio_patch.apply(bootstrap, contexts, "sidecar", resource)
    assert all(applied), applied
    inbound = next(x for x in patched["static_resources"]["listeners"]
                   if x["name"] == "virtualInbound")
    hcm = inbound["filter_chains"][0]["filters"][0]["typed_config"]
    mutation, request_id = hcm["early_header_mutation_extensions"]
    assert request_id["typed_config"]["mutations"][-1] == {"remove": "x-request-id"}
    assert mutation["typed_config"]["mutations"] == [
        {"remove_on_match": {"key_matcher": {"prefix": "x-llm-"}}},
        {"remove_on_match": {"key_matcher": {"prefix": "x-gateway-destination-endpoint"}}}]
    path = tmp_path / "sidecar-open.yaml"
    path.write_text(yaml.safe_dump(patched))
    validate(path)


def test_without_rate_limits_only_ext_proc_is_inserted() -> None:
    doc = default_doc()
    resource = envoy_filter(validate_config(Located("t.yaml", doc, {})))
    bootstrap, contexts = istio_patch.sidecar_bootstrap()
    patched, _ = istio_patch.apply(bootstrap, contexts, "sidecar", resource)
    assert http_filters(patched, "virtualInbound") == [[n for n in PATCHED if "ratelimit" not in n]]


def test_the_ratelimit_patch_carries_the_rate_limits_actions() -> None:
    patches = envoy_filter(config())["spec"]["configPatches"]
    ratelimit = patches[1]["patch"]["value"]["typed_config"]
    assert ratelimit["domain"] == "llm-sidecar"
    kinds = [next(action["generic_key"]["descriptor_value"] for action in a["actions"]
                  if action.get("generic_key", {}).get("descriptor_key") == "kind")
             for a in ratelimit["rate_limits"]]
    # Every (kind, level): a limit a reload adds anywhere binds without a new EnvoyFilter.
    assert kinds == ["requests"] * 3 + ["tokens"] * 6 + ["concurrent"] * 6


def test_the_context_is_checked() -> None:
    doc = default_doc()
    doc["istio"] = {"context": "SIDECAR_OUTBOUND"}
    with pytest.raises(ValueError, match=r"istio\.context"):
        validate_config(Located("t.yaml", doc, {}))


def test_only_the_bootstrap_tells_extproc_it_reads_stream_usage() -> None:
    """The EnvoyFilter carries no usage filters, so it must not say it does: without the
    marker extproc reads streams itself (``telemetry.envoy_usage`` is on by default)."""
    cfg = config()
    assert cfg.telemetry.envoy_usage
    assert ENVOY_USAGE_HEADER not in json.dumps(envoy_filter(cfg))
    hcm = http_connection_manager(cfg)
    names = [e["name"] for e in hcm["early_header_mutation_extensions"]]
    assert names[-1].endswith(".envoy_usage")  # after the strip of the client's x-llm-*
    off = validate_config(Located("t.yaml", {**default_doc(), "telemetry": {"envoy_usage": False},
                                             "rate_limits": cfg.model_dump()["rate_limits"]}, {}))
    assert ENVOY_USAGE_HEADER not in json.dumps(http_connection_manager(off))
