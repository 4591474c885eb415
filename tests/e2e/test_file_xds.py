"""``envoy.dynamic_pools`` through a real Envoy: a pool added, moved to other pods and removed by
``render`` into the folder Envoy runs from, with Envoy never restarted."""

from __future__ import annotations

import json
import os
import pathlib
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from routing.loader import load_config
from routing.render import write_all
from sidecar_runtime.process.files import replace_file
from sidecar_runtime.process.procs import Child, free_port, sidecar_command, start, wait_http_ok
from tests.harness.envoy_alone import post
from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.waits import wait_for

pytestmark = pytest.mark.e2e


def base_doc() -> dict[str, Any]:
    doc = default_doc()
    doc["envoy"]["dynamic_pools"] = True
    doc["clusters"] = {"short": {"endpoints": [f"127.0.0.1:{free_port()}"], "max_context": 2048,
                                 "simulate": {"decode_ms_per_token": 0.2}}}
    doc["models"] = {"m": {"clusters": ["short"]}}
    return doc


@pytest.fixture
def gateway(tmp_path: pathlib.Path) -> Iterator[Gateway]:
    with running_gateway(base_doc(), str(tmp_path / "gw")) as gw:
        yield gw


@pytest.fixture
def sims(tmp_path: pathlib.Path) -> Iterator[list[tuple[Child, int]]]:
    """Two simulators of the pool the test adds, on ports of their own."""
    started: list[tuple[Child, int]] = []
    try:
        for _ in range(2):
            port = free_port()
            child = start("sim extra", sidecar_command(
                "sim", "--host", "127.0.0.1", "--port", str(port), "--name", "extra",
                "--max-model-len", "4096", "--decode-ms-per-token", "0.2"),
                log_path=str(tmp_path / f"sim-{port}.log"))
            started.append((child, port))
        for child, port in started:
            wait_http_ok(f"http://127.0.0.1:{port}/health", 30, child)
        yield started
    finally:
        for child, _ in started:
            child.stop()


def chat(gw: Gateway, model: str) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"model": model, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _, answer = post(gw.url, body)
    return status, answer


def admin(gw: Gateway, path: str) -> str:
    with urllib.request.urlopen(f"{gw.admin_url}{path}", timeout=5) as resp:
        text: str = resp.read().decode()
    return text


def healthy(gw: Gateway, cluster: str, port: int) -> bool:
    return f"{cluster}::127.0.0.1:{port}::health_flags::healthy" in admin(gw, "/clusters")


def served_by(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/requests", timeout=5) as resp:
        return len(json.loads(resp.read()))


def render_pools(gw: Gateway, doc: dict[str, Any]) -> None:
    """``render`` into Envoy's folder, from a copy (extproc still reads the old YAML)."""
    scratch = os.path.join(gw.workdir, "next.yaml")
    with open(scratch, "w", encoding="utf-8") as handle:
        yaml.safe_dump(doc, handle, sort_keys=False)
    write_all(load_config(scratch), gw.workdir)


def route(gw: Gateway, doc: dict[str, Any]) -> None:
    """The routing YAML extproc and ratelimit reload live, replaced in one rename."""
    replace_file(gw.config_path, yaml.safe_dump(doc, sort_keys=False).encode())


def stale(gw: Gateway) -> float:
    with urllib.request.urlopen(f"{gw.extproc_metrics}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("extproc_envoy_bootstrap_stale "):
                return float(line.split()[1])
    raise AssertionError("extproc_envoy_bootstrap_stale is not exported")


def test_pools_come_and_go_while_envoy_runs(gateway: Gateway,
                                            sims: list[tuple[Child, int]]) -> None:
    gw = gateway
    envoy = gw.child("envoy")
    assert chat(gw, "m")[0] == 200
    assert chat(gw, "n")[1]["error"]["code"] == "model_not_found"
    (_, first), (_, second) = sims

    # Added: the cluster first (Envoy has it, health-checked), then the route to it.
    added = gw_doc(gw)
    added["clusters"]["extra"] = {"endpoints": [f"127.0.0.1:{first}"], "max_context": 4096}
    added["models"]["n"] = {"clusters": ["extra"]}
    render_pools(gw, added)
    wait_for(lambda: healthy(gw, "extra", first), timeout=20, what="Envoy to load the new cluster")
    route(gw, added)
    wait_for(lambda: chat(gw, "n")[0] == 200, timeout=20, what="the new model to answer")
    assert served_by(first) >= 1

    # Moved to another pod: an endpoint change, applied by Envoy alone.
    moved = json.loads(json.dumps(added))
    moved["clusters"]["extra"]["endpoints"] = [f"127.0.0.1:{second}"]
    render_pools(gw, moved)
    wait_for(lambda: healthy(gw, "extra", second) and not healthy(gw, "extra", first),
             timeout=20, what="Envoy to move the pool to the other pod")
    route(gw, moved)
    before = served_by(first)
    wait_for(lambda: chat(gw, "n")[0] == 200 and served_by(second) >= 1, timeout=20,
             what="the moved pool to answer from its new pod")
    assert served_by(first) == before

    # Removed: the route first (extproc stops choosing it), then the cluster.
    route(gw, gw_doc_without_extra(moved))
    wait_for(lambda: chat(gw, "n")[1].get("error", {}).get("code") == "model_not_found",
             timeout=20, what="the removed model to be unknown")
    render_pools(gw, gw_doc_without_extra(moved))
    wait_for(lambda: "extra::" not in admin(gw, "/clusters"), timeout=20,
             what="Envoy to drop the cluster")

    assert chat(gw, "m")[0] == 200
    assert envoy.alive() and gw.child("envoy") is envoy
    # The pools are live in Envoy: extproc does not call its bootstrap stale.
    assert stale(gw) == 0.0


def gw_doc(gw: Gateway) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(pathlib.Path(gw.config_path).read_text())
    return doc


def gw_doc_without_extra(doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(doc))
    del out["clusters"]["extra"]
    del out["models"]["n"]
    return out


def test_render_watch_brings_a_routing_change_to_envoy_and_the_services(
        gateway: Gateway, sims: list[tuple[Child, int]], tmp_path: pathlib.Path) -> None:
    """One edit of the routing YAML, as a ConfigMap update (by hand or by the LLMModel
    operator) is in a gateway pod: ``render --watch`` gives Envoy the pool, the services reload
    the model, and it answers; Envoy is never restarted."""
    gw = gateway
    envoy = gw.child("envoy")
    (_, first), _ = sims
    log = tmp_path / "render-watch.log"
    watcher = start("render --watch", sidecar_command(
        "render", "--config", gw.config_path, "--out", gw.workdir, "--watch"), log_path=str(log))
    try:
        wait_for(lambda: log.exists() and "envoy.yaml" in log.read_text(), timeout=30,
                 what="render --watch to render once")
        added = gw_doc(gw)
        added["clusters"]["extra"] = {"endpoints": [f"127.0.0.1:{first}"], "max_context": 4096}
        added["models"]["n"] = {"clusters": ["extra"]}
        route(gw, added)
        wait_for(lambda: chat(gw, "n")[0] == 200, timeout=30,
                 what="the model added to the routing YAML to answer")
        assert served_by(first) >= 1
        assert "Envoy applies the pools from xds/ now" in log.read_text()

        broken = pathlib.Path(gw.config_path).read_text().replace("version: 1", "version: 7")
        replace_file(gw.config_path, broken.encode())
        wait_for(lambda: "Envoy keeps the last good files" in log.read_text(), timeout=30,
                 what="render --watch to refuse the broken file")
        assert watcher.alive() and chat(gw, "n")[0] == 200
        assert envoy.alive() and gw.child("envoy") is envoy and stale(gw) == 0.0
    finally:
        watcher.stop()
