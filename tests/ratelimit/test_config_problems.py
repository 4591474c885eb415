"""Every problem of a bad config, each at its own ``FILE:LINE``, whichever format the file is in:
what ``llm-sidecar ratelimit`` prints at start-up and logs on a failed reload."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ratelimit.errors import ConfigError
from ratelimit.loader import load_path
from routing.loader import load_config
from sidecar_runtime.process.reload import Reloader

UNITS = " (expected second, minute, hour, day, week, month, year, or a window like 5m)"
LIMIT_KEYS = "unit, requests_per_unit, unlimited, name, replaces, burst, unit_multiplier, debt, concurrent"
ROUTING_HEAD = """version: 1
clusters:
  short: {endpoints: ["10.0.0.1:8000"], max_context: 2048}
models:
  m: {clusters: [short]}
"""

DESCRIPTOR_FILES: dict[str, tuple[str, list[str]]] = {
    "three bad descriptors": ("""domain: llm
descriptors:
  - key: api_key
    rate_limit: {unit: fortnight, requests_per_unit: 10}
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: -1}
  - key: model
    shadow_mode: maybe
    rate_limit: {unit: second, requests_per_unit: 1}
""", [f"4: invalid rate limit unit 'fortnight'{UNITS}",
      "6: requests_per_unit must be an integer from 0 to 4294967295",
      "8: 'shadow_mode' must be true or false"]),
    "bad domain, policy and an unknown key": ("""domain: ""
on_backend_error: maybe
descriptor: []
""", ["1: config file cannot have empty domain",
      "2: on_backend_error must be 'allow' or 'deny'",
      "3: unknown key 'descriptor' (expected one of: domain, descriptors, on_backend_error)"]),
    "unknown key and a bad unit in one block": ("""domain: llm
descriptors:
  - key: api_key
    rate_limit:
      unit: 0m
      requests_per_unit: 10
      burts: 20
""", [f"5: invalid rate limit unit '0m'{UNITS}",
      f"7: unknown key 'burts' (expected one of: {LIMIT_KEYS})"]),
    "nested and repeated": ("""domain: llm
descriptors:
  - key: kind
    value: requests
    descriptors:
      - key: api_key
        rate_limit: {unit: second, requests_per_unit: 10, burst: 0}
      - key: api_key
        rate_limit: {unit: second, requests_per_unit: 20}
  - value: orphan
""", ["7: burst must be a positive integer",
      "8: duplicate descriptor composite key 'llm.kind_requests.api_key' (first at line 6)",
      "10: descriptor has empty key"]),
    "unlimited with two fields": ("""domain: llm
descriptors:
  - key: ldap
    rate_limit:
      unlimited: true
      unit: second
      requests_per_unit: 5
""", ["6: unlimited rate limit should not specify 'unit'",
      "7: unlimited rate limit should not specify 'requests_per_unit'"]),
    "a limit name UTF-8 cannot carry": ("""domain: llm
descriptors:
  - key: api_key
    rate_limit: {unit: second, requests_per_unit: 5, name: "key\\ud800"}
""", ["4: name holds a lone surrogate (such as \\ud800), which is not text UTF-8 can carry"]),
    "two repeated YAML keys": ("""domain: llm
domain: llm2
descriptors:
  - key: a
    key: b
""", ["2: duplicate key 'domain' (first at line 1)", "5: duplicate key 'key' (first at line 4)"]),
}

ROUTING_FILES: dict[str, tuple[str, list[str]]] = {
    "cross-section problems": (ROUTING_HEAD.replace("[short]", "[shrt]") + """rate_limits:
  tenant:
    overrides:
      acme corp: {requests: 1/s}
  model: {overrides: {gpt: {requests: 1/s}}}
""", ["5: model 'm' names unknown cluster 'shrt' (did you mean 'short'?)",
      "10: rate_limits.model overrides unknown model 'gpt' (known models: m)",
      "9: rate_limits.tenant overrides 'acme corp', a tenant no request can have: a tenant is 1 "
      "to 64 ASCII letters, digits, '.', '_' or '-'"]),
    "amounts Envoy's API cannot carry": (ROUTING_HEAD + """rate_limits:
  api_key:
    default: {requests: 5000M/h, burst: 5000000000}
    overrides: {}
  model:
    overrides:
      m: {concurrent: 4294967296}
""", ["8: requests '5000M/h' is more than 4294967295 per window, the most Envoy's rate-limit API "
      "carries: use a shorter window",
      "8: burst 5000000000 is more than 4294967295, the most Envoy's rate-limit API carries",
      "12: concurrent 4294967296 is more than 4294967295, the most Envoy's rate-limit API "
      "carries"]),
    "a syntax error, in the routing YAML's words": (ROUTING_HEAD + "rate_limits: [\n",
        ["7: YAML syntax: expected the node content, but found '<stream end>' (check "
         "indentation, quotes and closing brackets on this line and the one above)"]),
    "repeated keys": (ROUTING_HEAD + "models: {}\nclusters: {}\n",
        ["6: duplicate key 'models' (first at line 4): YAML keeps only the last, so merge the two",
         "7: duplicate key 'clusters' (first at line 2): YAML keeps only the last, so merge the "
         "two"]),
}


def lines(error: ConfigError) -> list[str]:
    return [str(problem) for problem in error.problems]


@pytest.mark.parametrize("name", list(DESCRIPTOR_FILES))
def test_every_problem_of_a_descriptor_file(name: str, tmp_path: Path) -> None:
    text, expected = DESCRIPTOR_FILES[name]
    path = tmp_path / "ratelimit.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_path(path)
    assert lines(caught.value) == [f"{path}:{line}" for line in expected]


@pytest.mark.parametrize("name", list(ROUTING_FILES))
def test_every_problem_of_a_routing_yaml_as_check_reports_it(name: str, tmp_path: Path) -> None:
    text, expected = ROUTING_FILES[name]
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as service:
        load_path(path)
    with pytest.raises(ConfigError) as check:
        load_config(str(path))
    assert lines(service.value) == lines(check.value) == [f"{path}:{line}" for line in expected]


def test_the_problems_of_every_file_of_a_directory(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("domain: llm\ndescriptors:\n  - key: x\n    foo: 1\n")
    (tmp_path / "b.yaml").write_text(ROUTING_HEAD.replace("[short]", "[long]"))
    (tmp_path / "c.yaml").write_text("domain: llm\n")
    (tmp_path / "d.yaml").write_text("domain: llm\n")
    with pytest.raises(ConfigError) as caught:
        load_path(tmp_path)
    assert lines(caught.value) == [
        f"{tmp_path}/a.yaml:4: unknown key 'foo' (expected one of: key, value, rate_limit, "
        "descriptors, shadow_mode, detailed_metric)",
        f"{tmp_path}/b.yaml:5: model 'm' names unknown cluster 'long' (known clusters: short)",
    ]
    (tmp_path / "a.yaml").unlink()
    (tmp_path / "b.yaml").unlink()
    with pytest.raises(ConfigError) as caught:
        load_path(tmp_path)
    assert lines(caught.value) == [
        f"{tmp_path}/d.yaml:1: duplicate domain 'llm' (first in {tmp_path}/c.yaml:1)"]


BAD_ROUTING = ROUTING_FILES["cross-section problems"][0]


def test_check_extproc_and_ratelimit_print_the_same_lines(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(BAD_ROUTING)
    expected = [f"{path}:{line}" for line in ROUTING_FILES["cross-section problems"][1]]
    outputs = {}
    for command in ("check", "extproc", "ratelimit"):
        # Ports 0: were the file loaded, the service would not collide with anything running.
        ports = [] if command == "check" else ["--port", "0", "--metrics-port", "0"]
        done = subprocess.run(
            [sys.executable, "-m", "llm_sidecar", command, "--config", str(path), *ports],
            capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 1, (command, done.stderr)
        outputs[command] = done.stderr.splitlines()
    assert outputs["check"] == expected
    assert outputs["extproc"] == expected
    assert outputs["ratelimit"] == expected


def test_a_failed_reload_reports_the_lines_check_prints(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(ROUTING_HEAD)
    results: list[tuple[bool, str]] = []
    reloader = Reloader(path, load_path, on_result=lambda ok, message: results.append((ok, message)),
                        errors=(ConfigError, OSError))
    path.write_text(BAD_ROUTING)
    assert reloader.check_now() is False  # seen once
    assert reloader.check_now() is False  # judged
    with pytest.raises(ConfigError) as check:
        load_config(str(path))
    assert results == [(False, str(check.value))]
    assert str(check.value).count("\n") == 2  # three problems, three lines
