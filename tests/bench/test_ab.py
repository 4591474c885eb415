"""``bench.ab``: each patch changes the rendered front bootstrap as it says, and a tiny run
measures both sides in alternating rounds."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from bench import ab, front
from bench.front import bench_config
from tests.bench.test_bench_smoke import run_with_envoy

ROUTING = {"services": {"extproc": "127.0.0.1:3", "ratelimit": "127.0.0.1:4"}}
"""What the patches read of the routing YAML: ``bench_config``'s placeholder ports."""


def rendered() -> dict[str, Any]:
    return front.front_bootstrap(bench_config(), "full")


def names(bootstrap: dict[str, Any]) -> list[str]:
    return [f["name"] for f in front._hcm(bootstrap)["http_filters"]]


def services(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    return ab._grpc_services(bootstrap)


def test_the_rendered_bootstrap_has_what_the_patches_take_away() -> None:
    doc = rendered()
    assert {ab.LUA, ab.SSE} <= set(names(doc)) and "access_log" in front._hcm(doc)
    assert len(services(doc)) == 2  # ext_proc's and the rate limit's
    assert all({"envoy_grpc", "retry_policy"} <= set(s) for s in services(doc))


@pytest.mark.parametrize(("patch", "check"), [
    ("no_lua", lambda d: ab.LUA not in names(d) and ab.SSE in names(d)),
    ("no_sse", lambda d: ab.SSE not in names(d) and ab.LUA in names(d)),
    ("no_access_log", lambda d: "access_log" not in front._hcm(d)),
    ("no_retry", lambda d: all("retry_policy" not in s and "envoy_grpc" in s
                               for s in services(d))),
    ("google_grpc", lambda d: [s["google_grpc"]["target_uri"] for s in services(d)]
     == ["127.0.0.1:3", "127.0.0.1:4"]
     and all("envoy_grpc" not in s and "retry_policy" not in s for s in services(d))),
    ("no_lua,no_sse", lambda d: not {ab.LUA, ab.SSE} & set(names(d))),
])
def test_each_patch_changes_only_what_it_names(patch: str, check: Any) -> None:
    doc = rendered()
    before = copy.deepcopy(doc)
    ab.combined(patch)(doc, ROUTING)
    assert check(doc)
    assert doc != before


@pytest.mark.parametrize("bad", ["", "no_such", "no_lua,no_such"])
def test_an_unknown_patch_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="known: google_grpc"):
        ab.combined(bad)


def test_unix_patches_no_bootstrap_and_puts_b_s_services_on_unix_sockets() -> None:
    doc = rendered()
    before = copy.deepcopy(doc)
    ab.combined("unix")(doc, ROUTING)
    assert doc == before
    assert ab.wants_unix("no_lua, unix") and not ab.wants_unix("no_lua")


def test_a_tiny_run_alternates_a_and_b(tmp_path: Path) -> None:
    out = run_with_envoy("bench.ab", "no_lua,unix", "--rounds", "2", "--duration", "1",
                         "--saturation-connections", "4", "--loadgen", "python",
                         "--out", str(tmp_path))
    doc = json.loads(out.splitlines()[-1])
    assert doc["patches"] == "no_lua,unix" and len(doc["rounds"]) == 2
    b_routing = (tmp_path / "ab-work" / "routing-ab-b.yaml").read_text(encoding="utf-8")
    assert "extproc: unix:/" in b_routing and "ratelimit: unix:/" in b_routing
    assert "unix:" not in (tmp_path / "ab-work" / "routing-ab-a.yaml").read_text(encoding="utf-8")
    for entry in doc["rounds"]:
        assert entry["a_rps"] > 0 and entry["b_rps"] > 0
        assert entry["ratio"] == round(entry["b_rps"] / entry["a_rps"], 4)
    assert doc["ratio_min"] <= doc["ratio_median"] <= doc["ratio_max"]
    assert set(doc["cpu_us_a"]) == set(doc["cpu_us_b"]) == {"envoy", "extproc", "ratelimit",
                                                             "redis"}
