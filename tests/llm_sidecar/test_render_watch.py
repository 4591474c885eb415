"""``render --watch``: what it renders again, and what it refuses, as a routing YAML changes
under it (the gateway pod's ConfigMap, updated by hand or by the LLMModel operator)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pytest
import yaml
from kubernetes_validate import latest_version, validate

from llm_sidecar.render_watch import RenderWatch
from routing.loader import load_config
from routing.loader import validate as validate_config
from routing.render import write_all
from routing.render.deploy import kubernetes
from routing.render.envoy import bootstrap_fingerprint
from routing.yamlsrc import load_yaml
from sidecar_runtime.process.files import replace_file
from sidecar_runtime.process.reload import path_signature


def doc(**extra_clusters: int) -> dict[str, Any]:
    clusters = {"short": {"endpoints": ["127.0.0.1:8101"], "max_context": 2048}}
    models: dict[str, Any] = {"m": {"clusters": ["short"]}}
    for name, port in extra_clusters.items():
        clusters[name] = {"endpoints": [f"127.0.0.1:{port}"], "max_context": 4096}
        models[f"model-{name}"] = {"clusters": [name]}
    return {"version": 1, "envoy": {"dynamic_pools": True, "listen": "127.0.0.1:10000"},
            "clusters": clusters, "models": models}


def write(path: pathlib.Path, content: dict[str, Any] | str) -> None:
    text = content if isinstance(content, str) else yaml.safe_dump(content)
    replace_file(str(path), text.encode())


def started(tmp_path: pathlib.Path) -> tuple[RenderWatch, pathlib.Path, list[str]]:
    """A first render of ``doc()``, as ``render --watch`` starts; and what it reports."""
    config, out = tmp_path / "routing.yaml", tmp_path / "envoy"
    write(config, doc())
    signature = path_signature(str(config))
    loaded = load_config(str(config))
    write_all(loaded, str(out))
    said: list[str] = []
    return (RenderWatch(str(config), str(out), bootstrap_fingerprint(loaded), signature,
                        said.append), out, said)


def test_a_new_pool_is_rendered_into_the_watched_files(tmp_path: pathlib.Path) -> None:
    watch, out, said = started(tmp_path)
    assert watch.check() is False  # nothing changed
    write(tmp_path / "routing.yaml", doc(extra=8102))
    assert watch.check() is True
    cds = (out / "xds" / "cds.yaml").read_text()
    rds = (out / "xds" / "rds.yaml").read_text()
    assert "extra" in cds and "127.0.0.1" in cds and "8102" in cds
    assert "llm-routed-extra" in rds
    assert said == ["rendered; Envoy applies the pools from xds/ now"]
    assert watch.check() is False  # once per change


def test_a_file_that_does_not_load_keeps_the_last_good_render(tmp_path: pathlib.Path) -> None:
    watch, out, said = started(tmp_path)
    before = (out / "xds" / "cds.yaml").read_bytes()
    write(tmp_path / "routing.yaml", "version: 1\nclusters: {short: {endpoints: [x]}}\n")
    assert watch.check() is False
    assert (out / "xds" / "cds.yaml").read_bytes() == before
    assert said[-1] == "not rendered; Envoy keeps the last good files"
    assert any("routing.yaml:" in line for line in said[:-1])  # FILE:LINE of each problem
    write(tmp_path / "routing.yaml", doc(extra=8102))  # fixed: rendered again
    assert watch.check() is True and "extra" in (out / "xds" / "cds.yaml").read_text()


def test_a_change_beyond_the_pools_is_reported_as_needing_a_restart(
        tmp_path: pathlib.Path) -> None:
    watch, _, said = started(tmp_path)
    changed = doc()
    changed["envoy"]["listen"] = "127.0.0.1:10001"
    write(tmp_path / "routing.yaml", changed)
    assert watch.check() is True
    assert "restart Envoy to apply it" in said[-1]


def test_a_failed_write_is_reported_and_the_watch_goes_on(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    watch, out, said = started(tmp_path)

    def full_disk(*_: object) -> list[str]:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("llm_sidecar.render_watch.write_all", full_disk)
    write(tmp_path / "routing.yaml", doc(extra=8102))
    assert watch.check() is False
    assert "No space left on device" in said[-1] and "keeps the files it has" in said[-1]
    monkeypatch.undo()
    write(tmp_path / "routing.yaml", doc(extra=8103))  # the next change renders
    assert watch.check() is True and "8103" in (out / "xds" / "cds.yaml").read_text()


def test_a_removed_file_is_reported_not_rendered(tmp_path: pathlib.Path) -> None:
    watch, out, said = started(tmp_path)
    os.remove(tmp_path / "routing.yaml")
    assert watch.check() is False
    assert said[-1] == "not rendered; Envoy keeps the last good files"
    assert (out / "xds" / "cds.yaml").exists()


def gateway_pod(config_doc: dict[str, Any]) -> dict[str, Any]:
    config = validate_config(load_yaml(yaml.safe_dump(config_doc), "routing.yaml"))
    [deployment] = [d for d in kubernetes(config, "x")["gateway.yaml"] if d["kind"] == "Deployment"]
    return deployment


def test_the_gateway_pod_renders_again_beside_envoy_only_with_dynamic_pools() -> None:
    dynamic = gateway_pod(doc())
    validate(dynamic, latest_version(), strict=True)
    containers = {c["name"]: c for c in dynamic["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"envoy", "render-watch"}
    watcher = containers["render-watch"]
    assert watcher["args"][0] == "render" and watcher["args"][-1] == "--watch"
    envoy_dir = next(m["mountPath"] for m in containers["envoy"]["volumeMounts"])
    assert watcher["args"][watcher["args"].index("--out") + 1] == envoy_dir
    assert {m["name"] for m in watcher["volumeMounts"]} == {"routing", "envoy"}

    static = doc()
    del static["envoy"]["dynamic_pools"]
    containers = gateway_pod(static)["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["envoy"]
