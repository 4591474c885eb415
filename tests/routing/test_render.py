"""Every config ``render`` writes must pass ``envoy --mode validate``, and say what production needs."""

from __future__ import annotations

import pathlib
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from llm_sidecar.up import example_config_path, missing_upstream_keys
from routing.loader import load_config
from routing.render import write_all
from routing.schema import RoutingConfig
from sidecar_runtime.process.procs import envoy_binary
from sidecar_runtime.wire.names import CLIENT_CREDENTIALS
from tests.harness import istio_patch
from tests.harness.ci import unavailable
from tests.harness.gateway import default_doc


def validate(path: pathlib.Path) -> None:
    try:
        envoy = envoy_binary()
    except FileNotFoundError:
        unavailable("envoy")
    result = subprocess.run([envoy, "--mode", "validate", "-c", str(path)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def variants() -> dict[str, dict[str, Any]]:
    docs: dict[str, dict[str, Any]] = {}
    docs["test-default"] = default_doc()
    dns = default_doc()
    dns["clusters"]["vllm-long"]["endpoints"] = ["vllm-long.llm.svc:8000",
                                                 "vllm-long-2.llm.svc:8000"]
    dns["clusters"]["vllm-canary"]["endpoint_picker"] = {"metrics_interval": "250ms"}
    dns["services"] = {"extproc": "extproc.llm.svc:50051", "ratelimit": "[::1]:50052",
                       "failure_mode_allow": True, "fallback_cluster": "vllm-long"}
    dns["rate_limits"] = {"api_key": {"default": {"requests": "10/s", "tokens": "100k/min"}}}
    dns["istio"] = {"context": "GATEWAY", "port": 8080}
    dns["envoy"].update(max_heap_bytes=768 * 1024 * 1024, max_concurrent_streams=50)
    docs["dns-limits-gateway"] = dns
    return docs


def render(name: str, tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    if name == "example":
        return _written(load_config(example_config_path()), tmp_path)
    return render_doc(variants()[name], tmp_path)


def render_doc(doc: dict[str, Any], tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    """What ``render`` writes for the routing YAML ``doc``, by file name."""
    source = tmp_path / "routing.yaml"
    source.write_text(yaml.safe_dump(doc))
    return _written(load_config(str(source)), tmp_path)


def _written(config: RoutingConfig, tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    return {pathlib.Path(p).name: pathlib.Path(p) for p in write_all(config, str(tmp_path / "out"))}


@pytest.mark.parametrize("name", ["example", *variants()])
def test_rendered_envoy_config_validates(name: str, tmp_path: pathlib.Path) -> None:
    written = render(name, tmp_path)
    assert sorted(written) == ["envoy.yaml", "envoyfilter.yaml", "ratelimit.yaml"]
    validate(written["envoy.yaml"])
    resource = yaml.safe_load(written["envoyfilter.yaml"].read_text())
    context = resource["spec"]["configPatches"][0]["match"]["context"]
    if context == "GATEWAY":
        bootstrap, contexts = istio_patch.gateway_bootstrap(8080)
        patched, applied = istio_patch.apply(bootstrap, contexts, "gateway", resource)
    else:
        bootstrap, contexts = istio_patch.sidecar_bootstrap()
        patched, applied = istio_patch.apply(bootstrap, contexts, "sidecar", resource)
    assert all(applied), applied
    path = tmp_path / "istio-patched.yaml"
    path.write_text(yaml.safe_dump(patched))
    validate(path)


def hcm_of(bootstrap: dict[str, Any]) -> dict[str, Any]:
    listener = bootstrap["static_resources"]["listeners"][0]
    typed: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return typed


def test_the_production_shape_of_the_bootstrap(tmp_path: pathlib.Path) -> None:
    bootstrap = yaml.safe_load(render("dns-limits-gateway", tmp_path)["envoy.yaml"].read_text())
    assert bootstrap["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    hcm = hcm_of(bootstrap)
    # The usage strip (Lua) runs after ext_proc on the response, once ext_proc let the headers
    # go (its setBytes sets content-length); the usage reader reads the pool's bytes. The
    # fallback pool's query cut (this config fails open to one) runs after ext_proc too.
    assert [f["name"] for f in hcm["http_filters"]] == [
        "envoy.filters.http.health_check", "envoy.filters.http.lua",
        "envoy.filters.http.ext_proc", "llm-sidecar.fallback_query",
        "envoy.filters.http.sse_to_metadata", "envoy.filters.http.ratelimit",
        "envoy.filters.http.router"]
    # a client's own x-llm-* headers are dropped before routing (always, not only failing open)
    assert hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"] == [
        {"remove_on_match": {"key_matcher": {"prefix": "x-llm-"}}},
        {"remove_on_match": {"key_matcher": {"prefix": "x-gateway-destination-endpoint"}}}]
    assert hcm["stream_idle_timeout"] == "300s"
    routed = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    assert routed["route"]["timeout"] == "0s"  # no total timeout may cut a stream
    assert routed["route"]["idle_timeout"] == "300s"
    assert routed["route"]["retry_policy"]["retry_on"] == "connect-failure,reset-before-request"
    log = hcm["access_log"][0]["typed_config"]["log_format"]["json_format"]
    assert {"request_id", "cluster", "status", "bytes_in", "bytes_out", "duration_ms"} <= set(log)
    listener = bootstrap["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] >= 32_768 * 4  # a 32K-token prompt
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    pool = clusters["vllm-long"]
    assert pool["type"] == "STRICT_DNS" and pool["lb_policy"] == "LEAST_REQUEST"
    assert pool["health_checks"][0]["http_health_check"]["path"] == "/health"
    assert pool["outlier_detection"]["consecutive_5xx"] == 5
    assert pool["circuit_breakers"]["thresholds"][0]["max_requests"] >= 1024
    for grpc in ("llm-sidecar-extproc", "llm-sidecar-ratelimit"):
        assert "grpc_health_check" in clusters[grpc]["health_checks"][0]
        assert clusters[grpc]["circuit_breakers"]["thresholds"][0]["max_requests"] >= 10_000


@pytest.mark.parametrize("name", ["example", *variants()])
def test_no_route_reaches_a_pool_without_extprocs_decision(name: str,
                                                           tmp_path: pathlib.Path) -> None:
    """Every route to a pool matches extproc's dynamic metadata (no client can send that), no
    route takes its cluster from a header, and no route leads to a sidecar service."""
    bootstrap = yaml.safe_load(render(name, tmp_path)["envoy.yaml"].read_text())
    hcm = hcm_of(bootstrap)
    assert hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"] == [
        {"remove_on_match": {"key_matcher": {"prefix": "x-llm-"}}},
        {"remove_on_match": {"key_matcher": {"prefix": "x-gateway-destination-endpoint"}}}]
    assert "cluster_header" not in str(hcm["route_config"])
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext_proc["typed_config"]["processing_mode"]["request_trailer_mode"] == "SEND"
    pools = {c["name"] for c in bootstrap["static_resources"]["clusters"]
             if not c["name"].startswith("llm-sidecar-")}
    fallback = bootstrap_fallback(hcm)
    names = [f["name"] for f in hcm["http_filters"]]
    # The fallback route cuts the query (extproc cuts it on the routes it picks): its Lua
    # filter follows ext_proc, with code only on that route, and is absent without a fallback.
    assert (names[names.index("envoy.filters.http.ext_proc") + 1]
            == "llm-sidecar.fallback_query") == (fallback is not None)
    assert ("llm-sidecar.fallback_query" in names) == (fallback is not None)
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        assert ("typed_per_filter_config" in route) == (route["name"] == "llm-fallback")
        target = route.get("route", {}).get("cluster")
        if target is None:
            assert "direct_response" in route
            continue
        assert target in pools
        if route["name"] == "llm-fallback":
            assert target == fallback
            continue
        assert route["match"]["dynamic_metadata"] == [{
            "filter": "llm_sidecar", "path": [{"key": "cluster"}],
            "value": {"string_match": {"exact": target}}}]


def bootstrap_fallback(hcm: dict[str, Any]) -> str | None:
    """The fallback pool of a fail-open config (extproc unreachable: the operator's choice)."""
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    return next((r["route"]["cluster"] for r in routes if r["name"] == "llm-fallback"), None)


def test_pool_routes_drop_client_credentials_and_add_the_pools_own_key(
        tmp_path: pathlib.Path) -> None:
    doc = default_doc()
    doc["clusters"]["vllm-long"]["upstream_api_key_env"] = "VLLM_LONG_KEY"
    doc["services"].update(failure_mode_allow=True, fallback_cluster="vllm-long")
    source = tmp_path / "routing.yaml"
    source.write_text(yaml.safe_dump(doc))
    [envoy_yaml, *_] = write_all(load_config(str(source)), str(tmp_path / "out"))
    validate(pathlib.Path(envoy_yaml))
    hcm = hcm_of(yaml.safe_load(pathlib.Path(envoy_yaml).read_text()))
    routes = {r["name"]: r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]}
    own_key = [{"header": {"key": "authorization", "value": "Bearer %ENVIRONMENT(VLLM_LONG_KEY)%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    for name in ("llm-routed-vllm-long", "llm-fallback"):  # the fallback pool gets it too
        assert routes[name]["request_headers_to_remove"] == list(CLIENT_CREDENTIALS)
        assert routes[name]["request_headers_to_add"] == own_key
    short = routes["llm-routed-vllm-short"]
    assert short["request_headers_to_remove"] == list(CLIENT_CREDENTIALS)
    assert {"authorization", "x-api-key", "api-key", "cookie"} <= set(CLIENT_CREDENTIALS)
    assert "request_headers_to_add" not in short


def test_up_refuses_to_start_a_pool_whose_key_is_not_set(tmp_path: pathlib.Path) -> None:

    doc = default_doc()
    doc["clusters"]["vllm-long"]["upstream_api_key_env"] = "VLLM_LONG_KEY"
    source = tmp_path / "routing.yaml"
    source.write_text(yaml.safe_dump(doc))
    config = load_config(str(source))
    assert missing_upstream_keys(config, {}) == [("vllm-long", "VLLM_LONG_KEY")]
    assert missing_upstream_keys(config, {"VLLM_LONG_KEY": ""}) == [("vllm-long", "VLLM_LONG_KEY")]
    assert missing_upstream_keys(config, {"VLLM_LONG_KEY": "sk"}) == []


def fingerprint_of(doc: dict[str, Any]) -> str:
    from routing.loader import validate
    from routing.render.envoy import bootstrap_fingerprint
    from routing.yamlsrc import Located
    return bootstrap_fingerprint(validate(Located("t.yaml", doc, {})))


def test_every_request_tells_extproc_which_bootstrap_its_envoy_runs() -> None:
    """The fingerprint moves with what only render and a restart apply, and not with what
    reloads live: extproc compares it with its own config's
    (docs: Checking, editor support and live reload)."""
    from routing.loader import validate
    from routing.render.envoy import bootstrap
    from routing.yamlsrc import Located
    doc = default_doc()
    doc["rate_limits"] = {"tenant": {"default": {"requests": "5/s"}}}
    marks = [m["typed_config"]["mutations"][0]["append"]["header"]
             for m in hcm_of(bootstrap(validate(Located("t.yaml", doc, {}))))[
                 "early_header_mutation_extensions"] if m["name"].endswith(".bootstrap")]
    assert marks == [{"key": "x-llm-bootstrap", "value": fingerprint_of(doc)}]
    Edit = Callable[[dict[str, Any]], object]
    same: list[Edit] = [
        lambda d: d["rate_limits"]["tenant"]["default"].update(requests="9/s", tokens="1M/h",
                                                               concurrent=3),
        lambda d: d["rate_limits"].update(model={"default": {"requests": "1/s"}}),
        lambda d: d["models"]["llama-2-13b"].update(default_max_tokens=99),
        lambda d: d.update(api_keys=[{"name": "k", "sha256": "a" * 64}]),
    ]
    moved: list[Edit] = [
        lambda d: d["clusters"]["vllm-long"]["endpoints"].append("127.0.0.1:1"),
        lambda d: d.pop("rate_limits"),
        lambda d: d["services"].update(extproc="127.0.0.1:2"),
    ]
    for change, moves in [*((c, False) for c in same), *((c, True) for c in moved)]:
        edited = yaml.safe_load(yaml.safe_dump(doc))
        change(edited)
        assert (fingerprint_of(edited) != fingerprint_of(doc)) is moves, change
