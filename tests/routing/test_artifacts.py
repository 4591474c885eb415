"""envoy/, deploy/, docker-compose.yml and the JSON Schema are what the example config renders.

When one fails: run ``python -m routing.render.artifacts`` and commit what it rewrote.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import textwrap
from typing import Any

import jsonschema
import pytest
import yaml

from routing.jsonschema import json_schema
from routing.loader import load_config
from routing.render.artifacts import COMMAND, ROOT, artifacts, stale
from sidecar_runtime.process.procs import sidecar_command
from tests.routing.test_render import validate

REPO = pathlib.Path(ROOT)


def test_checked_in_artifacts_are_fresh() -> None:
    assert stale() == [], f"stale generated files: run `{COMMAND}` and commit them"


def test_envoy_dir_is_what_render_writes_and_validates() -> None:
    assert sorted(p.name for p in (REPO / "envoy").iterdir()) == [
        "envoy.yaml", "envoyfilter.yaml", "ratelimit.yaml"]
    validate(REPO / "envoy" / "envoy.yaml")


def test_the_container_routing_yaml_is_the_example_with_other_addresses(
        tmp_path: pathlib.Path) -> None:
    example = load_config(str(REPO / "llm_sidecar" / "example.yaml"))
    deployed = load_config(str(REPO / "deploy" / "compose" / "routing.yaml"))
    for section in ("models", "rate_limits", "auth", "api_keys", "priority", "istio"):
        assert getattr(deployed, section) == getattr(example, section), section
    assert {n: c.max_context for n, c in deployed.clusters.items()} == {
        n: c.max_context for n, c in example.clusters.items()}
    assert deployed.envoy.admin.startswith("127.0.0.1:")
    # The bootstrap compose and Kubernetes render at start (DNS names everywhere) validates too.
    from routing.render import write_all
    validate(pathlib.Path(write_all(deployed, str(tmp_path))[0]))


def test_the_schema_accepts_the_examples_and_rejects_mistakes() -> None:
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    shipped = json.loads((REPO / "llm_sidecar" / "llm-sidecar.schema.json").read_text())
    assert shipped == schema
    for path in ("llm_sidecar/example.yaml", "deploy/compose/routing.yaml"):
        doc = yaml.safe_load((REPO / path).read_text())
        assert list(validator.iter_errors(doc)) == [], path
    good = yaml.safe_load((REPO / "llm_sidecar" / "example.yaml").read_text())
    mistakes: list[tuple[str, Any]] = [
        ("unknown key", {**good, "extra": 1}),
        ("bad rate", {**good, "rate_limits": {"tenant": {"default": {"requests": "10/fortnight"}}}}),
        ("bad percent", {**good, "models": {"m": {"clusters": ["embed"], "canary": {
            "model": "x", "cluster": "embed", "percent": 150}}}}),
        ("bad duration", {**good, "envoy": {"stream_idle_timeout": "5 minutes"}}),
        ("admin on all interfaces", {**good, "envoy": {"admin": "0.0.0.0:9901"}}),
        ("bad endpoint", {**good, "clusters": {"a": {"endpoints": ["10.0.0.1"], "max_context": 1}}}),
        ("no clusters", {**good, "models": {"m": {"clusters": []}}}),
        ("bad name", {**good, "clusters": {"a b": {"endpoints": ["h:1"], "max_context": 1}}}),
    ]
    for what, doc in mistakes:
        assert list(validator.iter_errors(doc)), what


@pytest.mark.parametrize("path", sorted(p for p in artifacts() if p.endswith((".yaml", ".yml"))))
def test_every_generated_yaml_parses(path: str) -> None:
    docs = list(yaml.safe_load_all((REPO / path).read_text()))
    assert docs and all(isinstance(d, dict) for d in docs)


def test_the_readme_istio_resources_parse_and_name_example_pools() -> None:
    istio = (pathlib.Path(__file__).parents[2] / "docs" / "operations" / "istio.md").read_text()
    blocks = [b.split("```", 1)[0] for b in istio.split("```yaml")[1:]]
    docs = [yaml.safe_load(textwrap.dedent(b)) for b in blocks]
    assert sorted(d["kind"] for d in docs) == ["DestinationRule", "ServiceEntry", "VirtualService"]
    clusters = set(load_config(str(REPO / "llm_sidecar" / "example.yaml")).clusters)
    service = next(d for d in docs if d["kind"] == "VirtualService")
    routed = [m["headers"]["x-llm-cluster"]["exact"]
              for rule in service["spec"]["http"] for m in rule["match"]]
    assert set(routed) <= clusters
    for doc in docs:
        assert doc["apiVersion"] == "networking.istio.io/v1"


def test_the_schema_command_prints_the_schema() -> None:
    result = subprocess.run(sidecar_command("schema"), capture_output=True, text=True, timeout=60,
                            check=True)
    assert json.loads(result.stdout) == json_schema()
