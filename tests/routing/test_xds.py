"""``envoy.dynamic_pools``: the bootstrap reads the pools from watched ``xds/`` files, which are
replaced by a rename, and the bootstrap's fingerprint ignores the pools."""

from __future__ import annotations

import copy
import os
import pathlib
from typing import Any

import pytest
import yaml

from routing.loader import validate as validate_doc
from routing.render import render_all, write_all
from routing.render.clusters import EXTPROC_CLUSTER, RATELIMIT_CLUSTER, pool_cluster
from routing.render.envoy import bootstrap, bootstrap_fingerprint, hcm_of_listener
from routing.render.xds import CLUSTER_TYPE, ROUTE_TYPE
from routing.schema import RoutingConfig
from routing.yamlsrc import Located
from tests.routing.test_render import validate


def doc() -> dict[str, Any]:
    return {
        "version": 1,
        "envoy": {"listen": "127.0.0.1:10000", "admin": "127.0.0.1:9901", "dynamic_pools": True},
        "services": {"extproc": "127.0.0.1:50051", "ratelimit": "127.0.0.1:50052"},
        "clusters": {"short": {"endpoints": ["127.0.0.1:8001"], "max_context": 2048},
                     "long": {"endpoints": ["127.0.0.1:8002"], "max_context": 32768}},
        "models": {"m": {"clusters": ["short", "long"]}},
        "rate_limits": {"model": {"overrides": {"m": {"requests": "10/s"}}}},
    }


def config(d: dict[str, Any]) -> RoutingConfig:
    return validate_doc(Located("t.yaml", d, {}))


def read(path: pathlib.Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


def test_the_bootstrap_reads_pool_clusters_and_routes_from_watched_files(
        tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    write_all(config(doc()), str(out))
    boot = read(out / "envoy.yaml")
    xds = str(out / "xds")
    assert boot["dynamic_resources"] == {"cds_config": {
        "path_config_source": {"path": f"{xds}/cds.yaml", "watched_directory": {"path": xds}},
        "resource_api_version": "V3"}}
    assert boot["node"]["id"] and boot["node"]["cluster"]
    # The services stay static: they do not change with the pools.
    assert [c["name"] for c in boot["static_resources"]["clusters"]] == [
        EXTPROC_CLUSTER, RATELIMIT_CLUSTER]
    hcm = hcm_of_listener(boot["static_resources"]["listeners"][0])
    assert "route_config" not in hcm
    assert hcm["rds"] == {"route_config_name": "llm", "config_source": {
        "path_config_source": {"path": f"{xds}/rds.yaml", "watched_directory": {"path": xds}},
        "resource_api_version": "V3"}}


def test_the_xds_files_hold_every_pool_and_its_route(tmp_path: pathlib.Path) -> None:
    cfg = config(doc())
    write_all(cfg, str(tmp_path))
    cds = read(tmp_path / "xds" / "cds.yaml")
    assert [r["@type"] for r in cds["resources"]] == [CLUSTER_TYPE, CLUSTER_TYPE]
    assert [{k: v for k, v in r.items() if k != "@type"} for r in cds["resources"]] == [
        pool_cluster(name, spec) for name, spec in cfg.clusters.items()]
    rds = read(tmp_path / "xds" / "rds.yaml")
    [route_config] = rds["resources"]
    assert route_config["@type"] == ROUTE_TYPE and route_config["name"] == "llm"
    targets = [r["route"]["cluster"] for r in route_config["virtual_hosts"][0]["routes"]
               if "route" in r]
    assert targets == ["short", "long"]
    assert cds["version_info"] != rds["version_info"]


def test_a_static_config_renders_no_xds_files(tmp_path: pathlib.Path) -> None:
    static = doc()
    static["envoy"]["dynamic_pools"] = False
    written = write_all(config(static), str(tmp_path))
    assert [os.path.basename(p) for p in written] == [
        "envoy.yaml", "ratelimit.yaml", "envoyfilter.yaml"]
    boot = read(tmp_path / "envoy.yaml")
    assert "dynamic_resources" not in boot
    assert {c["name"] for c in boot["static_resources"]["clusters"]} >= {"short", "long"}


def test_a_new_render_replaces_each_file_by_a_rename(tmp_path: pathlib.Path) -> None:
    """Envoy reloads a watched file on a move into its folder, never on a write in place: a
    reader that opened the old file keeps reading it whole, and no scratch file is left."""
    write_all(config(doc()), str(tmp_path))
    cds = tmp_path / "xds" / "cds.yaml"
    with open(cds, encoding="utf-8") as old:
        changed = doc()
        changed["clusters"]["extra"] = {"endpoints": ["127.0.0.1:8003"], "max_context": 4096}
        write_all(config(changed), str(tmp_path))
        assert "extra" not in old.read()
    assert "extra" in cds.read_text()
    assert sorted(os.listdir(tmp_path / "xds")) == ["cds.yaml", "rds.yaml"]


def test_the_version_info_follows_the_resources(tmp_path: pathlib.Path) -> None:
    first = render_all(config(doc()), str(tmp_path))
    again = render_all(config(doc()), str(tmp_path / "elsewhere"))
    assert first["xds/cds.yaml"] == again["xds/cds.yaml"]
    moved = doc()
    moved["clusters"]["short"]["endpoints"] = ["127.0.0.1:9001"]
    changed = render_all(config(moved), str(tmp_path))
    assert yaml.safe_load(changed["xds/cds.yaml"])["version_info"] != yaml.safe_load(
        first["xds/cds.yaml"])["version_info"]
    assert changed["xds/rds.yaml"] == first["xds/rds.yaml"]


def pool_changes() -> dict[str, dict[str, Any]]:
    added = doc()
    added["clusters"]["extra"] = {"endpoints": ["127.0.0.1:8003"], "max_context": 4096,
                                  "simulate": True}
    added["models"]["n"] = {"clusters": ["extra"]}
    moved = doc()
    moved["clusters"]["long"]["endpoints"] = ["127.0.0.1:9002", "127.0.0.1:9003"]
    removed = doc()
    del removed["clusters"]["long"]
    removed["models"]["m"]["clusters"] = ["short"]
    keyed = doc()
    keyed["clusters"]["short"]["upstream_api_key_env"] = "SHORT_KEY"
    picked = doc()
    picked["clusters"]["short"]["endpoint_picker"] = {}
    return {"added": added, "endpoints": moved, "removed": removed, "upstream_key": keyed,
            "endpoint_picker": picked}


@pytest.mark.parametrize("change", sorted(pool_changes()))
def test_pool_changes_keep_the_fingerprint_with_dynamic_pools(change: str) -> None:
    """Envoy applies these live: extproc must not call it stale after each of them."""
    changed = pool_changes()[change]
    assert bootstrap_fingerprint(config(changed)) == bootstrap_fingerprint(config(doc()))
    static, static_changed = doc(), copy.deepcopy(changed)
    static["envoy"]["dynamic_pools"] = static_changed["envoy"]["dynamic_pools"] = False
    assert bootstrap_fingerprint(config(static_changed)) != bootstrap_fingerprint(config(static))


def other_changes() -> dict[str, dict[str, Any]]:
    service = doc()
    service["services"]["extproc"] = "127.0.0.1:50061"
    unlimited = doc()
    del unlimited["rate_limits"]
    listener = doc()
    listener["envoy"]["listen"] = "127.0.0.1:10001"
    static = doc()
    static["envoy"]["dynamic_pools"] = False
    waits = doc()
    waits["clusters"]["short"]["endpoint_picker"] = {"flow_control": {"max_wait": "30s"}}
    return {"service": service, "rate_limits": unlimited, "listener": listener,
            "static": static, "longer_flow_control_wait": waits}


@pytest.mark.parametrize("change", sorted(other_changes()))
def test_everything_else_still_changes_the_fingerprint(change: str) -> None:
    assert bootstrap_fingerprint(config(other_changes()[change])) != bootstrap_fingerprint(
        config(doc()))


def test_the_fingerprint_does_not_depend_on_the_output_folder(tmp_path: pathlib.Path) -> None:
    """extproc computes it from the routing YAML alone, not knowing where render wrote."""
    cfg = config(doc())

    def sent(out: str) -> str:
        hcm = hcm_of_listener(bootstrap(cfg, out)["static_resources"]["listeners"][0])
        markers = hcm["early_header_mutation_extensions"]
        return str(markers[-1]["typed_config"]["mutations"][0]["append"]["header"]["value"])

    assert sent(str(tmp_path / "a")) == sent(str(tmp_path / "b")) == bootstrap_fingerprint(cfg)


def test_a_dynamic_bootstrap_needs_its_folder() -> None:
    with pytest.raises(ValueError, match="folder of its xds files"):
        bootstrap(config(doc()))


def test_envoy_accepts_the_dynamic_bootstrap(tmp_path: pathlib.Path) -> None:
    written = write_all(config(doc()), str(tmp_path / "out"))
    validate(pathlib.Path(written[0]))
