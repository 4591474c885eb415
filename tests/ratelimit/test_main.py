"""The CLI entry: flags, default ports, and the routing YAML hook."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from ratelimit.loader import load_path
from ratelimit.main import add_arguments, default_address, run
from sidecar_runtime.settings import Settings

ROUTING = """version: 1
services: {extproc: 127.0.0.1:50051, ratelimit: 0.0.0.0:50099}
clusters: {}
models: {}
"""


def fake_routing(monkeypatch: pytest.MonkeyPatch, result: Any) -> list[str]:
    calls: list[str] = []

    def descriptor_document(path: str) -> Any:
        calls.append(path)
        return result

    module = types.ModuleType("routing.ratelimits")
    module.descriptor_document = descriptor_document  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "routing.ratelimits", module)
    return calls


def test_flags() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", "x.yaml"])
    assert (args.config, args.host, args.port, args.metrics_port) == ("x.yaml", None, None, 9102)
    with pytest.raises(SystemExit):
        parser.parse_args([])


def test_default_address(tmp_path: Path) -> None:
    descriptors = tmp_path / "d.yaml"
    descriptors.write_text("domain: llm\n")
    assert default_address(str(descriptors)) == ("127.0.0.1", 50052)
    assert default_address(str(tmp_path)) == ("127.0.0.1", 50052)
    routing = tmp_path / "gateway.yaml"
    routing.write_text(ROUTING)
    assert default_address(str(routing)) == ("0.0.0.0", 50099)


def test_routing_yaml_goes_through_the_converter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    routing = tmp_path / "gateway.yaml"
    routing.write_text(ROUTING)
    doc = {
        "domain": "llm-sidecar",
        "descriptors": [{"key": "tenant", "rate_limit": {"unit": "minute", "requests_per_unit": 600}}],
    }
    calls = fake_routing(monkeypatch, doc)
    config = load_path(routing)
    assert calls == [str(routing)]
    limit = config.domains["llm-sidecar"].match([("tenant", "legal")])
    assert limit is not None and limit.requests_per_unit == 600


def test_converter_line_map_points_into_the_routing_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    routing = tmp_path / "gateway.yaml"
    routing.write_text(ROUTING)
    doc = {"domain": "llm-sidecar", "descriptors": [{"key": "tenant", "rate_limit": {"unit": "x"}}]}
    fake_routing(monkeypatch, (doc, {("descriptors", 0, "rate_limit", "unit"): 17}))
    with pytest.raises(Exception, match=rf"^{routing}:17: invalid rate limit unit 'x'"):
        load_path(routing)


def test_run_reports_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("domain: llm\nfoo: 1\n")
    args = argparse.Namespace(config=str(bad), host=None, port=0, metrics_port=0, workers=None,
                              worker_ops_socket=None, worker_index=0)
    assert run(args, Settings()) == 1
    assert capsys.readouterr().err.strip() == (
        f"{bad}:2: unknown key 'foo' (expected one of: domain, descriptors, on_backend_error)"
    )
