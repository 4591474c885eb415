"""The docs site: its reference pages are what the code says, and it builds with --strict.

When the freshness test fails: run ``python -m llm_sidecar.docs_gen`` and commit what it
rewrote. The other tests check the generator itself against the code by their own route (the
schema walked here, the registries' public ``collect()``, the metric names in the source, the
real command line), so a generator that drops something fails too.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from llm_sidecar import cli
from llm_sidecar.docs_gen import COMMAND, COMMANDS_PAGE, CONFIG_PAGE, METRICS_PAGE, ROOT, stale
from llm_sidecar.docs_gen.commands import HELP_COLUMNS, subcommands
from llm_sidecar.docs_gen.config import config_keys, examples
from llm_sidecar.docs_gen.metrics import service_registries
from routing.jsonschema import json_schema
from sidecar_runtime.compat.prometheus_internals import collectors, label_names

REPO = pathlib.Path(ROOT)
SERVICE_PACKAGES = ("extproc", "ratelimit", "sidecar_runtime", "llm_sidecar")
"""Where the services' metrics are defined (the simulator's mimic vLLM's, not ours)."""


def page(path: str) -> str:
    return (REPO / path).read_text(encoding="utf-8")


def test_generated_pages_are_fresh() -> None:
    assert stale() == [], f"stale reference pages: run `{COMMAND}` and commit them"


def test_generated_pages_say_so_on_their_first_line() -> None:
    for path in (CONFIG_PAGE, METRICS_PAGE, COMMANDS_PAGE):
        assert COMMAND in page(path).splitlines()[0], path


# -- config ----------------------------------------------------------------------------------


def schema_paths(root: Mapping[str, Any], node: Mapping[str, Any], path: str,
                 depth: int = 0) -> Iterator[str]:
    """Every key path under ``node``, walked here apart from the generator's walk."""
    assert depth < 20, f"schema nests too deep at {path}"
    if "$ref" in node:
        yield from schema_paths(root, root["$defs"][node["$ref"].split("/")[-1]], path, depth + 1)
    for branch in node.get("anyOf", []):
        yield from schema_paths(root, branch, path, depth + 1)
    for name, prop in node.get("properties", {}).items():
        child = f"{path}.{name}" if path else name
        yield child
        yield from schema_paths(root, prop, child, depth + 1)
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_paths(root, node["additionalProperties"], f"{path}.<name>", depth + 1)
    if isinstance(node.get("items"), dict):
        yield from schema_paths(root, node["items"], f"{path}[]", depth + 1)


def test_every_schema_key_has_a_heading_on_the_config_page() -> None:
    root = json_schema()
    paths = set(schema_paths(root, root, ""))
    headings = set(re.findall(r"^#{2,3} `([^`]+)`$", page(CONFIG_PAGE), re.MULTILINE))
    assert len(paths) > 100  # the walk still reaches the nested definitions
    assert sorted(paths - headings) == []
    assert sorted(headings - paths) == []  # nor a key the schema does not have
    for deep in ("clusters.<name>.endpoint_picker.weights.prefix", "api_keys[].sha256",
                 "rate_limits.tenant.overrides.<name>.tokens", "models.<name>.canary.guard"):
        assert deep in paths


def test_every_example_is_valid_for_its_key() -> None:
    """What a reader copies from the page passes the schema (and the derived examples are
    few: a key without one deserves an ``examples`` entry in the schema)."""
    root = json_schema()
    with open(REPO / "llm_sidecar" / "example.yaml", encoding="utf-8") as handle:
        example: dict[str, Any] = yaml.safe_load(handle)
    keys = config_keys(root)
    empty: dict[str, Any] = {}
    for config in (example, empty):  # the page's, then every key's derived one
        found = examples(root, config)
        assert set(found) == {key.path for key in keys}
        for key in keys:
            validator = jsonschema.Draft202012Validator({"$defs": root["$defs"], **key.schema})
            assert list(validator.iter_errors(found[key.path].value)) == [], key.path


def test_the_example_config_is_valid_for_the_schema() -> None:
    """The config page's examples come from it."""
    with open(REPO / "llm_sidecar" / "example.yaml", encoding="utf-8") as handle:
        jsonschema.Draft202012Validator(json_schema()).validate(yaml.safe_load(handle))


# -- metrics ---------------------------------------------------------------------------------


def metric_headings() -> set[str]:
    return set(re.findall(r"^## `([^`]+)`$", page(METRICS_PAGE), re.MULTILINE))


def test_every_registered_metric_is_on_the_metrics_page() -> None:
    """Read through the registries' public ``collect()``, not the generator's enumeration."""
    registered = {family.name for registry in service_registries().values()
                  for family in registry.collect()}
    assert len(registered) > 40
    assert sorted(registered - metric_headings()) == []
    assert sorted(metric_headings() - registered) == []


def test_prometheus_client_still_has_what_the_generator_reads() -> None:
    """The two private attributes the metrics page is read through (a registry's collectors,
    a metric's label names, sidecar_runtime.compat.prometheus_internals): a prometheus_client
    that renames them fails here, by name."""
    registry = CollectorRegistry()
    counter = Counter("docs_probe", "probe", ["a", "b"], registry=registry)
    assert collectors(registry) == [counter]
    assert label_names(counter) == ("a", "b")
    assert label_names(GaugeMetricFamily("docs_probe", "probe", labels=["c"])) == ("c",)
    assert label_names(Counter("docs_bare", "probe", registry=CollectorRegistry())) == ()


METRIC_CALL = re.compile(
    r"\b(?:Counter|Gauge|Histogram|Summary|Info|Enum|(?:Counter|Gauge|Histogram|Summary|Info)"
    r"MetricFamily)\(\s*(f?)\"([^\"]+)\"")


def test_every_metric_name_in_the_source_is_on_the_metrics_page() -> None:
    """A metric the services only create later (in ``open``, on a first request) is not in
    the registries the generator builds; its name in the source still has to be documented."""
    documented = metric_headings()
    names: list[tuple[str, str, str]] = []
    for package in SERVICE_PACKAGES:
        for source in sorted((REPO / package).rglob("*.py")):
            names += [(str(source.relative_to(REPO)), is_f, name)
                      for is_f, name in METRIC_CALL.findall(source.read_text(encoding="utf-8"))]
    assert len(names) > 30  # the pattern still finds them
    missing = []
    for path, is_f, name in names:
        pattern = re.escape(name) if not is_f else re.sub(r"\\\{[^}]*\\\}", r"\\w+", re.escape(name))
        if not any(re.fullmatch(pattern, doc) for doc in documented):
            missing.append(f"{path}: {name}")
    assert missing == []


# -- commands --------------------------------------------------------------------------------


def command_blocks() -> dict[str, str]:
    """``## `llm-sidecar X``` → the text block under it."""
    found = re.findall(r"^## `([^`]+)`\n\n```text\n(.*?)\n```$", page(COMMANDS_PAGE),
                       re.MULTILINE | re.DOTALL)
    return dict(found)


def test_the_commands_page_is_what_the_command_line_prints(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each subcommand's ``--help`` through ``llm-sidecar``'s own entry point."""
    monkeypatch.setenv("COLUMNS", HELP_COLUMNS)
    monkeypatch.setenv("NO_COLOR", "1")
    blocks = command_blocks()
    names = list(subcommands(cli._parser()))
    assert list(blocks) == ["llm-sidecar", *(f"llm-sidecar {name}" for name in names)]
    for name in names:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
            cli.main([name, "--help"])
        assert exited.value.code == 0
        assert out.getvalue().rstrip() == blocks[f"llm-sidecar {name}"], name


def test_llm_sidecar_help_lists_every_documented_subcommand() -> None:
    """The installed command, in a process of its own."""
    result = subprocess.run([sys.executable, "-m", "llm_sidecar", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=True,
                            env={**os.environ, "COLUMNS": HELP_COLUMNS, "NO_COLOR": "1"})
    assert result.stdout.rstrip() == command_blocks()["llm-sidecar"]
    listed = set(re.findall(r"^    (\S+)", result.stdout, re.MULTILINE))
    documented = {name.split()[1] for name in command_blocks() if " " in name}
    assert documented == listed


# -- the site --------------------------------------------------------------------------------


def test_the_docs_site_builds_strict(tmp_path: pathlib.Path) -> None:
    """A broken link or a page missing from the nav fails; mkdocs.yml missing fails too."""
    assert (REPO / "mkdocs.yml").is_file(), "mkdocs.yml is missing: the docs site has no config"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
