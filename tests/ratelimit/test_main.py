"""The CLI entry: flags, default ports, and a routing YAML given to the service."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ratelimit.errors import ConfigError
from ratelimit.loader import load_path
from ratelimit.main import add_arguments, default_address, run
from sidecar_runtime.process.settings import Settings

ROUTING = """version: 1
services: {extproc: 127.0.0.1:50051, ratelimit: 0.0.0.0:50099}
clusters: {}
models: {}
"""


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


LIMITED = """version: 1
clusters: {c: {endpoints: ["10.0.0.1:8000"], max_context: 2048}}
models: {m: {clusters: [c]}}
rate_limits:
  tenant: {default: {requests: 600/min}}
"""


def test_a_routing_yaml_is_compiled_from_its_one_parse(tmp_path: Path) -> None:
    routing = tmp_path / "gateway.yaml"
    routing.write_text(LIMITED)
    config = load_path(routing)
    limit = config.domains["llm-sidecar"].match([("kind", "requests"), ("tenant", "legal")])
    assert limit is not None and (limit.requests_per_unit, limit.unit) == (600, "minute")
    assert limit.full_key == "llm-sidecar.kind_requests.tenant"


def test_each_problem_of_a_routing_yaml_is_at_its_own_line(tmp_path: Path) -> None:
    routing = tmp_path / "gateway.yaml"
    routing.write_text(LIMITED.replace("[c]", "[d]") + "  model: {overrides: {x: {requests: 1/s}}}\n")
    with pytest.raises(ConfigError) as caught:
        load_path(routing)
    assert [p.line for p in caught.value.problems] == [3, 6]


def test_run_reports_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("domain: llm\nfoo: 1\n")
    args = argparse.Namespace(config=str(bad), host=None, port=0, metrics_port=0, workers=None,
                              worker_ops_socket=None, worker_index=0)
    assert run(args, Settings()) == 1
    assert capsys.readouterr().err.strip() == (
        f"{bad}:2: unknown key 'foo' (expected one of: domain, descriptors, on_backend_error)"
    )
