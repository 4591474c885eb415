"""The rendered Envoy's memory bounds: overload manager, buffer limits, HTTP/2 limits."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import yaml

from routing.loader import load_config
from routing.render import write_all
from routing.render.bounds import http2_options, overload_manager, stream_window
from routing.render.envoy import bootstrap
from routing.schema import EnvoySection
from tests.harness.gateway import default_doc
from tests.routing.test_render import hcm_of, validate

MiB = 1024 * 1024


def actions(envoy: EnvoySection) -> dict[str, Any]:
    return {a["name"].rsplit(".", 1)[1]: a["triggers"][0]
            for a in overload_manager(envoy).get("actions", [])}


def monitors(envoy: EnvoySection) -> dict[str, Any]:
    return {m["name"].rsplit(".", 1)[1]: m["typed_config"]
            for m in overload_manager(envoy)["resource_monitors"]}


@pytest.mark.parametrize(("heap", "expected"), [
    (None, {"global_downstream_max_connections"}),
    (768 * MiB, {"global_downstream_max_connections", "fixed_heap"}),
])
def test_the_heap_monitor_is_there_only_with_max_heap_bytes(heap: int | None,
                                                            expected: set[str]) -> None:
    envoy = EnvoySection(max_heap_bytes=heap, max_connections=500)
    found = monitors(envoy)
    assert set(found) == expected
    assert found["global_downstream_max_connections"]["max_active_downstream_connections"] == 500
    if heap is not None:
        assert found["fixed_heap"]["max_heap_size_bytes"] == heap
    else:
        assert actions(envoy) == {}  # no heap, nothing to act on


def test_heap_actions_shrink_then_reset_the_biggest_streams_then_refuse() -> None:
    envoy = EnvoySection(max_heap_bytes=512 * MiB)
    assert actions(envoy) == {
        "shrink_heap": {"name": "envoy.resource_monitors.fixed_heap",
                        "threshold": {"value": 0.90}},
        "reset_high_memory_stream": {"name": "envoy.resource_monitors.fixed_heap", "scaled": {
            "scaling_threshold": 0.90, "saturation_threshold": 0.98}},
        "stop_accepting_requests": {"name": "envoy.resource_monitors.fixed_heap",
                                    "threshold": {"value": 0.95}},
    }
    manager = overload_manager(envoy)
    # streams are tracked (and so can be reset) from 1 MiB of buffers
    assert manager["buffer_factory_config"] == {"minimum_account_to_track_power_of_two": 20}
    assert manager["refresh_interval"] == "0.25s"


@pytest.mark.parametrize(("max_request_bytes", "window"), [
    (8 * MiB, 8 * MiB),       # the default: the window is the body limit
    (64 * 1024, 64 * 1024),
    (4096, 65_535),           # HTTP/2's smallest window
    (1024, 65_535),
])
def test_the_h2_stream_window_is_the_body_limit(max_request_bytes: int, window: int) -> None:
    envoy = EnvoySection(max_request_bytes=max_request_bytes)
    assert stream_window(envoy) == window
    assert http2_options(envoy)["initial_stream_window_size"] == window


@pytest.mark.parametrize(("streams", "expected"), [(None, 100), (1, 1), (250, 250)])
def test_max_concurrent_streams(streams: int | None, expected: int) -> None:
    envoy = EnvoySection() if streams is None else EnvoySection(max_concurrent_streams=streams)
    options = http2_options(envoy)
    assert options["max_concurrent_streams"] == expected
    assert options["initial_connection_window_size"] == 4 * MiB


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("max_heap_bytes", 512, "greater than or equal to 1048576"),
    ("max_heap_bytes", "1Gi", "valid integer"),
    ("max_concurrent_streams", 0, "greater than or equal to 1"),
])
def test_bad_bounds_are_check_errors(key: str, value: Any, fragment: str,
                                     tmp_path: pathlib.Path) -> None:
    doc = default_doc()
    doc["envoy"][key] = value
    source = tmp_path / "routing.yaml"
    source.write_text(yaml.safe_dump(doc))
    with pytest.raises(Exception) as info:
        load_config(str(source))
    assert f"envoy.{key}" in str(info.value) and fragment in str(info.value)


def test_the_listener_and_its_hcm_carry_the_bounds(tmp_path: pathlib.Path) -> None:
    doc = default_doc()
    doc["envoy"].update(max_heap_bytes=768 * MiB, max_concurrent_streams=32,
                        max_request_bytes=2 * MiB)
    source = tmp_path / "routing.yaml"
    source.write_text(yaml.safe_dump(doc))
    config = load_config(str(source))
    rendered = bootstrap(config)
    listener = rendered["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == 2 * MiB
    assert hcm_of(rendered)["http2_protocol_options"] == {
        "max_concurrent_streams": 32, "initial_stream_window_size": 2 * MiB,
        "initial_connection_window_size": 4 * MiB}
    mappers = hcm_of(rendered)["local_reply_config"]["mappers"]
    overload = [m for m in mappers if "overload" in str(m["filter"])]
    assert overload[0]["body_format_override"]["json_format"]["error"]["code"] == \
        "server_overloaded"
    written = write_all(config, str(tmp_path / "out"))
    validate(pathlib.Path(next(p for p in written if p.endswith("envoy.yaml"))))
