"""``up --models``: the pure decisions behind following a folder of LLMModels (ports, pods,
the make-before-break pool set, when a change is acted on) and what a bad folder prints."""

from __future__ import annotations

import http.server
import itertools
import json
import pathlib
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from llm_sidecar.gateway_wait import reload_counts, wait_envoy_applied, wait_reloaded
from llm_sidecar.models_served import (
    BUILTIN_BASE,
    NO_MODELS,
    Pod,
    Served,
    assign_ports,
    base_document,
    build,
    make_before_break,
    models_line,
    plan_folder,
    pod_changes,
    with_placeholder,
)
from llm_sidecar.models_up import ModelsGateway, Settle
from routing.errors import ConfigError
from routing.loader import validate
from routing.schema import RoutingConfig
from routing.yamlsrc import Located

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "models"


def ports_from(*ports: int) -> Iterator[int]:
    return iter(ports)


def test_a_pool_keeps_its_port_while_its_settings_stay() -> None:
    first = assign_ports({"a": "s1", "b": "s2"}, {}, ports_from(9001, 9002).__next__)
    assert first == {"a": ("s1", 9001), "b": ("s2", 9002)}
    again = assign_ports({"a": "s1", "b": "s2", "c": "s3"}, first, ports_from(9003).__next__)
    assert again == {**first, "c": ("s3", 9003)}


def test_a_pool_whose_settings_change_gets_a_new_port_and_never_a_held_one() -> None:
    """The new pod starts beside the old one, which still holds its port until it stops."""
    held = {"a": ("s1", 9001), "b": ("s2", 9002)}
    # take() offers the ports still held first: they are skipped.
    changed = assign_ports({"a": "s1-bigger", "b": "s2"}, held,
                           ports_from(9001, 9002, 9005).__next__)
    assert changed == {"a": ("s1-bigger", 9005), "b": ("s2", 9002)}


def test_a_removed_pool_gives_up_its_port() -> None:
    assert assign_ports({"b": "s2"}, {"a": ("s1", 9001), "b": ("s2", 9002)},
                        ports_from().__next__) == {"b": ("s2", 9002)}


def pod(cluster: str, port: int, *flags: str) -> Pod:
    return Pod(cluster, f"127.0.0.1:{port}", 2048, tuple(flags))


def test_pods_to_start_and_stop() -> None:
    running = {p.endpoint: p for p in (pod("a", 1), pod("b", 2), pod("c", 3))}
    wanted = {p.endpoint: p for p in (pod("a", 1), pod("b", 2, "--speed", "2"), pod("d", 4))}
    change = pod_changes(running, wanted)
    assert change.start == (pod("b", 2, "--speed", "2"), pod("d", 4))
    assert change.stop == (pod("b", 2), pod("c", 3))
    assert pod_changes(running, running).start == pod_changes(running, running).stop == ()


def test_a_pod_runs_the_simulator_with_its_pools_settings() -> None:
    command = pod("m-2k", 8123, "--kv-cache-tokens", "18688").command()
    assert command[-11:] == ["sim", "--host", "127.0.0.1", "--port", "8123", "--name", "m-2k",
                             "--max-model-len", "2048", "--kv-cache-tokens", "18688"]


def routing(clusters: dict[str, list[int]]) -> RoutingConfig:
    doc: dict[str, Any] = {
        "version": 1, "envoy": {"dynamic_pools": True},
        "clusters": {name: {"endpoints": [f"127.0.0.1:{p}" for p in ports], "max_context": 2048}
                     for name, ports in clusters.items()},
        "models": {f"m-{name}": {"clusters": [name]} for name in clusters},
    }
    return validate(Located("t.yaml", doc, {}))


def test_while_a_change_is_applied_envoy_has_the_old_and_the_new_pools() -> None:
    old = routing({"a": [1], "b": [2], "gone": [3]})
    new = routing({"a": [1], "b": [5], "added": [4]})
    bridge = make_before_break(old, new)
    assert {name: spec.endpoints for name, spec in bridge.clusters.items()} == {
        "gone": ["127.0.0.1:3"], "a": ["127.0.0.1:1"], "b": ["127.0.0.1:5", "127.0.0.1:2"],
        "added": ["127.0.0.1:4"]}
    assert bridge.envoy.dynamic_pools


def test_a_change_is_acted_on_once_it_settled_and_only_once() -> None:
    settle = Settle(seen="v1", applied="v1")
    assert [settle.due(s) for s in ("v1", "v2", "v3", "v3", "v3", "v1", "v1")] == [
        False, False, False, True, False, False, True]


def test_the_built_in_base_runs_ratelimit_and_dynamic_pools() -> None:
    doc = base_document(None)
    assert doc["envoy"]["dynamic_pools"] is True
    assert doc["rate_limits"] is not None
    assert doc["envoy"]["listen"] == BUILTIN_BASE["envoy"]["listen"]


def test_a_base_file_keeps_its_ports_and_gets_dynamic_pools_and_rate_limits(
        tmp_path: pathlib.Path) -> None:
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump({"envoy": {"listen": "127.0.0.1:12000"},
                                    "services": {"extproc": "127.0.0.1:12001"}}))
    doc = base_document(str(path))
    assert doc["envoy"] == {"listen": "127.0.0.1:12000", "dynamic_pools": True}
    assert doc["version"] == 1 and doc["rate_limits"] == {}


def test_a_base_that_is_no_mapping_is_a_file_line_error(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "base.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError) as err:
        base_document(str(path))
    assert str(err.value).startswith(f"{path}:1: ")


def test_no_model_serves_a_placeholder_no_request_fits() -> None:
    doc = with_placeholder(base_document(None))
    config = validate(Located("t.yaml", doc, {}))
    assert list(config.models) == [NO_MODELS]
    assert config.clusters[NO_MODELS].max_context == 1
    assert config.clusters[NO_MODELS].simulator is None
    assert with_placeholder({"models": {"m": {}}}) == {"models": {"m": {}}}


def test_the_folder_becomes_pools_on_local_ports_sized_by_the_plan() -> None:
    plans = plan_folder(str(EXAMPLES), None)
    counter = itertools.count(20000)
    served = build(base_document(None), plans, {}, counter.__next__, "base.yaml")
    assert served.models == tuple(sorted(p.name for p in plans))
    pools = [pool for plan in plans for pool in plan.pools]
    for pool in pools:
        spec = served.config.clusters[pool.name]
        assert spec.endpoints == [f"127.0.0.1:{served.ports[pool.name][1]}"]
        assert spec.simulator is not None
        assert spec.simulator.kv_cache_tokens == pool.kv_cache_tokens
        assert spec.simulator.max_num_seqs == pool.max_num_seqs
    assert served.config.envoy.dynamic_pools
    # Built again from the same files: the same ports, the same document.
    again = build(base_document(None), plan_folder(str(EXAMPLES), None), served.ports,
                  counter.__next__, "base.yaml")
    assert again.doc == served.doc


def test_a_broken_file_prints_file_line_and_serves_nothing_new(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(EXAMPLES / "contract-review.yaml", folder / "a.yaml")
    broken = folder / "b.yaml"
    broken.write_text((EXAMPLES / "contract-review.yaml").read_text().replace(
        "contract-review-v2", "other").replace("gpuRequest: 40Gi", "gpuRequest: lots"))
    gateway = ModelsGateway(str(folder), base_document(None), "base", gpus=None,
                            extproc_metrics_port=1, ratelimit_metrics_port=2)
    served = gateway.first()
    assert served.models == ()
    assert list(served.config.models) == [NO_MODELS]
    lines = capsys.readouterr().err.splitlines()
    [problem] = [line for line in lines if line.startswith(f"{broken}:")]
    assert "gpuRequest" in problem
    assert any("not applied" in line for line in lines)


def test_the_line_that_says_what_a_change_did() -> None:
    def served(**models: int) -> Served:
        doc = {"models": {name: {"clusters": [f"{name}-2k"]} for name in models},
               "clusters": {f"{name}-2k": {"endpoints": [f"127.0.0.1:{port}"]}
                            for name, port in models.items()}}
        return Served(doc, routing({"x": [1]}), {}, tuple(sorted(models)))

    assert models_line(None, served(a=1)) == "models: +a"
    assert models_line(served(a=1, b=2, c=3), served(a=1, b=5, d=4)) == "models: +d -c a ~b"
    assert models_line(served(a=1), served()) == "models: -a"


class FakeAdmin:
    """An HTTP server answering each path with the text a test sets: Envoy's admin listener or
    a service's ``/metrics``, as the waits of a change read them."""

    def __init__(self) -> None:
        self.pages: dict[str, str] = {}
        pages = self.pages

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = pages.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.end_headers()
                self.wfile.write((body or "").encode())

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_admin() -> Iterator[FakeAdmin]:
    admin = FakeAdmin()
    yield admin
    admin.close()


def envoy_pages(version: str, clusters: str) -> dict[str, str]:
    return {"/config_dump?resource=dynamic_route_configs":
            json.dumps({"configs": [{"version_info": version}]}),
            "/clusters": clusters}


def test_envoy_counts_as_applied_at_the_new_routes_version_with_new_pods_healthy_and_gone_pools_gone(
        fake_admin: FakeAdmin) -> None:
    healthy = {("a-2k", "127.0.0.1:9001")}
    fake_admin.pages.update(envoy_pages("v2", "a-2k::127.0.0.1:9001::health_flags::healthy\n"
                                              "a-2k::127.0.0.1:9001::cx_active::0\n"))
    assert wait_envoy_applied(fake_admin.address, "v2", healthy, {"old-2k"}, 5)
    # each condition alone keeps the wait going until its timeout
    assert not wait_envoy_applied(fake_admin.address, "v3", healthy, set(), 0.3)
    fake_admin.pages.update(envoy_pages("v2", "a-2k::127.0.0.1:9001::health_flags::/failed_active_hc\n"))
    assert not wait_envoy_applied(fake_admin.address, "v2", healthy, set(), 0.3)
    fake_admin.pages.update(envoy_pages("v2", "a-2k::127.0.0.1:9001::health_flags::healthy\n"
                                              "old-2k::127.0.0.1:9000::health_flags::healthy\n"))
    assert not wait_envoy_applied(fake_admin.address, "v2", healthy, {"old-2k"}, 0.3)


def test_a_reload_is_seen_on_every_service_s_counter(fake_admin: FakeAdmin) -> None:
    url = f"http://{fake_admin.address}/metrics"
    down = f"http://{fake_admin.address}/not-there"
    fake_admin.pages["/metrics"] = ('extproc_config_reloads_total{result="ok"} 2.0\n'
                                    'extproc_config_reloads_total{result="error"} 1.0\n'
                                    'ratelimit_config_reloads_total{result="ok"} 7.0\n')
    metrics = [(url, "extproc"), (down, "ratelimit")]
    before = reload_counts(metrics)
    assert before == [3.0, -1.0]  # both results summed; another prefix's not; no answer is -1
    assert not wait_reloaded(metrics, before, 0.3)  # extproc has not reloaded
    fake_admin.pages["/metrics"] = 'extproc_config_reloads_total{result="error"} 4.0\n'
    fake_admin.pages["/not-there"] = 'ratelimit_config_reloads_total{result="ok"} 0.0\n'
    assert wait_reloaded(metrics, before, 5)
