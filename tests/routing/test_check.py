"""One fixture per mistake an operator can make, with the exact ``FILE:LINE: message``.

Every message names what is wrong and carries a hint (a "did you mean", the allowed values, or
what to write instead). ``llm-sidecar check`` prints these lines and exits 1.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import textwrap
from collections.abc import Callable

import pytest

from ratelimit.loader import read_config
from routing.errors import ConfigError
from routing.loader import check_config, load_config
from routing.yamlsrc import MAX_YAML_BYTES
from sidecar_runtime.process.procs import sidecar_command

GOOD = """\
version: 1
clusters:
  vllm-short: {endpoints: ["10.0.0.11:8000"], max_context: 2048}
  vllm-long: {endpoints: ["vllm-long.llm.svc:8000"], max_context: 32768}
models:
  llama-2-13b:
    clusters: [vllm-short, vllm-long]
"""
HEX_A = "a" * 64

CASES = {
    "unknown_top_level_key": (GOOD + "extra: 1\n",
                              ["8: unknown key 'extra' in top level (allowed: version, envoy, "
                               "services, clusters, models, auth, api_keys, rate_limits, priority, "
                               "telemetry, istio)"]),
    "typo_key": (GOOD.replace("max_context: 2048", "max_contxt: 2048"),
                 ["3: missing required key clusters.vllm-short.max_context (the longest context "
                  "the pool serves: its vLLM --max-model-len)",
                  "3: unknown key 'max_contxt' in clusters.vllm-short (did you mean 'max_context'?)"]),
    "unknown_cluster": (GOOD.replace("[vllm-short, vllm-long]", "[vllm-short, vllm-lng]"),
                        ["7: model 'llama-2-13b' names unknown cluster 'vllm-lng' "
                         "(did you mean 'vllm-long'?)"]),
    "unknown_cluster_far_off": (GOOD.replace("[vllm-short, vllm-long]", "[vllm-short, gpu-7]"),
                                ["7: model 'llama-2-13b' names unknown cluster 'gpu-7' "
                                 "(known clusters: vllm-short, vllm-long)"]),
    "no_clusters": (GOOD.replace("[vllm-short, vllm-long]", "[]"),
                    ["7: model 'llama-2-13b' has no clusters: list the pools that serve it "
                     "(known clusters: vllm-short, vllm-long)"]),
    "model_without_clusters_key": (GOOD.replace("    clusters: [vllm-short, vllm-long]\n",
                                                "    default_max_tokens: 10\n"),
                                   ["6: missing required key models.llama-2-13b.clusters (the "
                                    "vLLM pools, by name)"]),
    "overlapping_pools": (GOOD.replace("max_context: 32768", "max_context: 2048"),
                          ["7: model 'llama-2-13b' has 2 clusters with max_context 2048: pools "
                           "overlap, give each pool of a model its own max_context"]),
    "pools_share_a_server": (GOOD.replace('"vllm-long.llm.svc:8000"', '"10.0.0.11:8000"'),
                             ["4: endpoint 10.0.0.11:8000 is in pools 'vllm-short' (max_context "
                              "2048) and 'vllm-long' (max_context 32768): pools overlap, and one "
                              "vLLM server has one --max-model-len; list it in one pool"]),
    "cluster_listed_twice": (GOOD.replace("[vllm-short, vllm-long]", "[vllm-short, vllm-short]"),
                             ["7: model 'llama-2-13b' has 2 clusters with max_context 2048: pools "
                              "overlap, give each pool of a model its own max_context",
                              "7: model 'llama-2-13b' lists a cluster twice"]),
    "bad_upstream_key_env": (GOOD.replace("max_context: 2048}", "max_context: 2048, "
                                          "upstream_api_key_env: 'VLLM KEY'}"),
                             ["3: clusters.vllm-short.upstream_api_key_env: bad "
                              "upstream_api_key_env 'VLLM KEY': an environment variable name, "
                              "letters, digits and '_', not starting with a digit"]),
    "bad_rate": (GOOD + "rate_limits:\n  tenant: {default: {requests: 10/fortnight}}\n",
                 ["9: rate_limits.tenant.default.requests: bad rate '10/fortnight': use N/s, "
                  "N/min, N/h, N/d or N/5m-style windows, with an optional k or M suffix, "
                  "like 100k/min"]),
    "listen_on_the_admin_port": (GOOD + 'envoy: {listen: "0.0.0.0:9901"}\n',
                                 ["8: envoy.admin and envoy.listen both use port 9901: give each "
                                  "its own"]),
    "services_on_one_port": (GOOD + 'services: {extproc: "127.0.0.1:6000", '
                             'ratelimit: "127.0.0.1:6000"}\n'
                             'rate_limits: {model: {default: {requests: 5/s}}}\n',
                             ["8: services.ratelimit and services.extproc both use port 6000: "
                              "give each its own"]),
    "simulated_endpoint_twice": (GOOD.replace('{endpoints: ["10.0.0.11:8000"], max_context: 2048}',
                                              '{endpoints: ["127.0.0.1:7001", "127.0.0.1:7001"], '
                                              'max_context: 2048, simulate: true}'),
                                 ["3: vllm-short lists endpoint 127.0.0.1:7001 twice: list it "
                                  "once"]),
    "simulated_endpoint_on_a_service_port": (
        GOOD.replace('{endpoints: ["10.0.0.11:8000"], max_context: 2048}',
                     '{endpoints: ["127.0.0.1:50051"], max_context: 2048, simulate: true}'),
        ["3: vllm-short's endpoint 127.0.0.1:50051 and services.extproc both use port 50051: "
         "give each its own"]),
    "envoy_values_out_of_its_range": (GOOD + "envoy: {max_request_bytes: 99999999999, "
                                      "stream_idle_timeout: 9999999999d}\n",
                                      ["8: envoy.stream_idle_timeout: 9999999999d is longer "
                                       "than Envoy takes (at most 3650d)",
                                       "8: envoy.max_request_bytes: Input should be less than "
                                       "or equal to 4294967295"]),
    "bad_prefix_cache_scope": (GOOD + "    prefix_cache_scope: key\n",
                               ["8: models.llama-2-13b.prefix_cache_scope: Input should be "
                                "'shared' or 'tenant'"]),
    "embedding_prefix_cache_scope": (GOOD + "  bge-m3: {kind: embedding, clusters: [vllm-short], "
                                     "prefix_cache_scope: tenant}\n",
                                     ["8: models.bge-m3: prefix_cache_scope is for chat models; "
                                      "an embedding model's cache scope is cache.scope"]),
    "bad_percent": (GOOD + "    canary: {model: v2, cluster: vllm-long, percent: 150}\n",
                    ["8: models.llama-2-13b.canary.percent: 150 is not a percentage: use 0 to "
                     "100 (5 sends 5% of the sticky keys to the canary)"]),
    "yes_as_percent": (GOOD + "    canary: {model: v2, cluster: vllm-long, percent: yes}\n",
                       ["8: models.llama-2-13b.canary.percent: True is not a percentage: use 0 "
                        "to 100 (5 sends 5% of the sticky keys to the canary)"]),
    "negative_percent": (GOOD + "    canary: {model: v2, cluster: vllm-long, percent: -1}\n",
                         ["8: models.llama-2-13b.canary.percent: -1 is not a percentage: use 0 to "
                          "100 (5 sends 5% of the sticky keys to the canary)"]),
    "percent_with_sign": (GOOD + "    canary: {model: v2, cluster: vllm-long, percent: 5%}\n",
                          ["8: models.llama-2-13b.canary.percent: '5%' is not a percentage: use 0 "
                           "to 100 (5 sends 5% of the sticky keys to the canary)"]),
    "canary_unknown_cluster": (GOOD + "    canary: {model: v2, cluster: canary, percent: 5}\n",
                               ["8: canary of 'llama-2-13b' names unknown cluster 'canary' "
                                "(known clusters: vllm-short, vllm-long)"]),
    "canary_model_is_a_model": (GOOD + "    canary: {model: llama-2-13b, cluster: vllm-long, "
                                "percent: 5}\n",
                                ["8: the canary model must differ from the model"]),
    "duplicate_api_key": (GOOD + "api_keys:\n"
                          f"  - {{name: a, sha256: '{HEX_A}'}}\n"
                          f"  - {{name: b, sha256: '{HEX_A}'}}\n",
                          ["10: api key 'b' has the same sha256 as 'a': one secret can be one "
                           "key only; give each key its own secret, or remove one"]),
    "duplicate_api_key_name": (GOOD + "api_keys:\n"
                               f"  - {{name: a, sha256: '{HEX_A}'}}\n"
                               f"  - {{name: a, sha256: '{'b' * 64}'}}\n",
                               ["10: api key name 'a' is used twice (first at line 9): names "
                                "must be unique"]),
    "unicode_tenant": (GOOD + f"api_keys:\n  - {{name: a, sha256: '{HEX_A}', tenant: acmé}}\n",
                       ["9: api_keys.0.tenant: bad tenant 'acmé': use 1 to 64 ASCII letters, "
                        "digits, '.', '_' or '-'"]),
    "tenant_over_64": (GOOD + f"api_keys:\n  - {{name: a, sha256: '{HEX_A}', tenant: {'t' * 65}}}\n",
                       [f"9: api_keys.0.tenant: bad tenant '{'t' * 65}': use 1 to 64 ASCII "
                        "letters, digits, '.', '_' or '-'"]),
    "long_key_name_is_no_tenant": (GOOD + f"api_keys:\n  - {{name: {'k' * 65}, sha256: '{HEX_A}'}}\n",
                                   [f"9: api_keys.0: api key '{'k' * 65}' has no tenant, so its "
                                    "name is its tenant, and a tenant is 1 to 64 ASCII letters, "
                                    "digits, '.', '_' or '-': set tenant, or shorten the name"]),
    "override_of_impossible_tenant": (GOOD + "rate_limits:\n  tenant:\n    overrides:\n"
                                      "      acme corp: {requests: 1/s}\n",
                                      ["11: rate_limits.tenant overrides 'acme corp', a tenant no "
                                       "request can have: a tenant is 1 to 64 ASCII letters, "
                                       "digits, '.', '_' or '-'"]),
    "bad_sha256": (GOOD + "api_keys:\n  - {name: a, sha256: sk-live-123}\n",
                   ["9: api_keys.0.sha256: sha256 must be 64 hex digits: the sha256 of the "
                    "secret key"]),
    "yaml_syntax": (GOOD + "  broken: [\n",
                    ["9: YAML syntax: expected the node content, but found '<stream end>' "
                     "(check indentation, quotes and closing brackets on this line and the one "
                     "above)"]),
    "yaml_tab_indent": (GOOD + "\tbad: 1\n",
                        ["8: YAML syntax: found character '\\t' that cannot start any token "
                         "(check indentation, quotes and closing brackets on this line and the "
                         "one above)"]),
    "duplicate_key": (GOOD + "models: {}\n",
                      ["8: duplicate key 'models' (first at line 5): YAML keeps only the last, "
                       "so merge the two"]),
    "bad_version": (GOOD.replace("version: 1", "version: 2"), ["1: version must be 1"]),
    "override_unknown_model": (GOOD + "rate_limits:\n  model: {overrides: {lama-2-13b: "
                               "{requests: 1/s}}}\n",
                               ["9: rate_limits.model overrides unknown model 'lama-2-13b' "
                                "(did you mean 'llama-2-13b'?)"]),
    "override_unknown_key_name": (GOOD + "rate_limits:\n  api_key: {overrides: {bot: "
                                  "{requests: 1/s}}}\n",
                                  ["9: rate_limits.api_key overrides unknown api key name 'bot' "
                                   "(there are no api key names under api_keys)"]),
    "burst_without_requests": (GOOD + "rate_limits:\n  tenant: {default: {tokens: 1k/min, "
                               "burst: 5}}\n",
                               ["9: burst is the capacity of the requests bucket: it needs a "
                                "requests rate"]),
    "empty_limit": (GOOD + "rate_limits:\n  tenant: {default: {}}\n",
                    ["9: a limit needs requests, tokens, concurrent or a combination"]),
    "bad_endpoint": (GOOD.replace('"10.0.0.11:8000"', '"10.0.0.11"'),
                     ["3: clusters.vllm-short.endpoints: bad address '10.0.0.11': use host:port, "
                      "like 10.0.0.11:8000"]),
    "bad_duration": (GOOD + "envoy: {stream_idle_timeout: 5 minutes}\n",
                     ["8: envoy.stream_idle_timeout: bad duration '5 minutes': use a whole number "
                      "with s, m, h or d, like 30s or 7d"]),
    "admin_not_on_loopback": (GOOD + "envoy: {admin: 0.0.0.0:9901}\n",
                              ["8: envoy.admin: the admin interface can stop Envoy and dump its "
                               "config: listen on loopback, like 127.0.0.1:9901 (probes use GET "
                               "/healthz on the listener)"]),
    "cache_on_chat_model": (GOOD + "    cache: {namespace: x}\n",
                            ["8: cache is only for kind: embedding models ('llama-2-13b' is chat)"]),
    "bad_name": (GOOD.replace("  vllm-long:", "  vllm long:").replace(", vllm-long]", "]"),
                 ["2: clusters: bad name 'vllm long': use letters, digits, '.', '_' and '-'"]),
    "priority_inverted": (GOOD + "priority: {high_below: 9000, low_from: 10}\n",
                          ["8: priority.high_below must not be above priority.low_from"]),
    "not_a_mapping": ("- just\n- a list\n", ["1: the file must be a mapping with version: 1"]),
    "empty_file": ("", ["1: the file must be a mapping with version: 1"]),
}


def write(tmp_path: pathlib.Path, name: str, text: str) -> pathlib.Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_mistake_is_reported_with_file_and_line(name: str, tmp_path: pathlib.Path) -> None:
    text, expected = CASES[name]
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    assert [str(p) for p in caught.value.problems] == [f"{path}:{line}" for line in expected]


def test_the_good_file_loads(tmp_path: pathlib.Path) -> None:
    config = load_config(str(write(tmp_path, "good", GOOD)))
    assert list(config.models) == ["llama-2-13b"]
    assert config.rate_limits is None and config.api_keys == []


def test_an_unreadable_file_is_one_located_line(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(str(missing))
    assert str(caught.value) == f"{missing}:1: cannot read the file: No such file or directory"


@pytest.mark.parametrize(("make", "why"), [
    (lambda path: os.mkfifo(path),  # would block open() for good
     "not a regular file (a FIFO, device or socket is not read)"),
    (lambda path: path.write_bytes(b"version: 1\n\xff\xfe\n"), "not UTF-8 text"),
    # Sparse: no disk used; refused by its size before a byte is read.
    (lambda path: os.truncate(path.write_bytes(b"") or path, MAX_YAML_BYTES + 1),
     f"{MAX_YAML_BYTES + 1} bytes, more than the {MAX_YAML_BYTES} read"),
])
def test_a_routing_yaml_that_is_no_bounded_text_file_is_refused_before_it_is_read(
        tmp_path: pathlib.Path, make: Callable[[pathlib.Path], object], why: str) -> None:
    """The services reload the routing YAML (and the rate limiter its descriptor files) from
    disk: a FIFO or a device in its place must not hang the reload, a huge file not fill the
    memory."""
    path = tmp_path / "routing.yaml"
    make(path)
    for load in (load_config, lambda name: read_config(pathlib.Path(name))):
        with pytest.raises(ConfigError) as caught:
            load(str(path))
        assert str(caught.value) == f"{path}:1: cannot read the file: {why}"


def test_every_problem_of_a_file_is_reported_at_once(tmp_path: pathlib.Path) -> None:
    text = (GOOD.replace("[vllm-short, vllm-long]", "[vllm-short, vllm-lng]")
            + "    canary: {model: v2, cluster: vllm-long, percent: 5}\n"
            + "rate_limits:\n  model: {overrides: {gpt: {requests: 1/s}}}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(str(write(tmp_path, "many", text)))
    assert [p.line for p in caught.value.problems] == [7, 10]


REQUIRED = f"auth: {{required: true}}\napi_keys:\n  - {{name: bot, sha256: '{HEX_A}'}}\n"
"""Production mode: keys required, and one listed."""


ESCAPE = ("warning: {levels} limits with auth.required false bind only callers that keep their "
          "key and tenant: any caller can send a new key or name a new tenant (x-tenant-id) and "
          "get fresh buckets; only model limits bind everyone. Set auth.required: true where "
          "they must hold")


@pytest.mark.parametrize(("limits", "expected"), [
    ("rate_limits:\n  tenant: {default: {requests: 5/s}}\n",
     ["9: " + ESCAPE.format(levels="tenant")]),
    ("rate_limits:\n  api_key: {default: {tokens: 1k/min}}\n"
     "  tenant: {default: {requests: 5/s}}\n",
     ["9: " + ESCAPE.format(levels="api_key and tenant")]),
    ("rate_limits:\n  model: {default: {requests: 5/s}}\n", []),   # binds every caller
    ("rate_limits:\n  tenant: {default: {requests: 5/s, shadow: true}}\n", []),  # enforces none
    # An override inherits its default's shadow, as the rate limiter reads it.
    ("rate_limits:\n  tenant: {default: {requests: 5/s, shadow: true}, "
     "overrides: {acme: {requests: 9/s}}}\n", []),
    (REQUIRED + "rate_limits:\n  tenant: {default: {requests: 5/s}}\n", []),
])
def test_check_warns_that_open_mode_lets_callers_escape_key_and_tenant_limits(
        tmp_path: pathlib.Path, limits: str, expected: list[str]) -> None:
    path = write(tmp_path, "open", GOOD + limits)
    assert [str(p) for p in check_config(str(path))] == [f"{path}:{line}" for line in expected]


SCOPED = GOOD + """\
  bge-m3:
    kind: embedding
    clusters: [vllm-short]
    cache: {namespace: bge, scope: tenant}
"""


SALTED = GOOD + "    prefix_cache_scope: tenant\n"
CACHE_WARNING = ("11: warning: cache scope tenant with auth.required false keeps apart only "
                 "tenants callers cannot name: any unlisted caller names its own tenant "
                 "(x-tenant-id) and reads that tenant's cached vectors. Set auth.required: true "
                 "where tenants must not see each other's entries")
PREFIX_WARNING = ("8: warning: prefix_cache_scope tenant with auth.required false keeps apart "
                  "only tenants callers cannot name: any unlisted caller names its own tenant "
                  "(x-tenant-id) and gets that tenant's cache_salt and can time its prompts. Set "
                  "auth.required: true where tenants must not see each other's prefixes")


@pytest.mark.parametrize(("text", "expected"), [
    # A budget no prompt fits next to (warned, not refused: clients that always send
    # max_tokens are served, as before the warning).
    (GOOD + "    default_max_tokens: 40000\n" + REQUIRED,
     ["8: warning: default_max_tokens 40000 leaves no room for a prompt in the largest pool "
      "of 'llama-2-13b' (max_context 32768): every request without max_tokens gets a 413; use "
      "less than max_context"]),
    (GOOD + "    default_max_tokens: 32767\n", []),
    # Two local listeners on one port but two addresses; ratelimit's address unused without
    # rate_limits.
    (GOOD.replace('{endpoints: ["10.0.0.11:8000"], max_context: 2048}',
                  '{endpoints: ["127.0.0.1:7001", "127.0.0.2:7001"], max_context: 2048, '
                  'simulate: true}'), []),
    (GOOD + 'services: {extproc: "127.0.0.1:6000", ratelimit: "127.0.0.1:6000"}\n', []),
    (SCOPED, [CACHE_WARNING]),
    (SCOPED + REQUIRED, []),
    (SCOPED.replace("scope: tenant", "scope: shared"), []),
    (SALTED, [PREFIX_WARNING]),
    (SALTED + REQUIRED, []),
    (SALTED.replace("scope: tenant", "scope: shared"), []),
])
def test_check_warns_that_tenant_scoped_caches_need_authenticated_tenants(
        tmp_path: pathlib.Path, text: str, expected: list[str]) -> None:
    """The embedding cache's scope and vLLM's prefix cache scope alike."""
    path = write(tmp_path, "scoped", text)
    assert [str(p) for p in check_config(str(path))] == [f"{path}:{w}" for w in expected]


def test_check_command_prints_the_lines_and_exits_1(tmp_path: pathlib.Path) -> None:
    bad = write(tmp_path, "bad", CASES["unknown_cluster"][0])
    result = subprocess.run(sidecar_command("check", "--config", str(bad)),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"{bad}:{CASES['unknown_cluster'][1][0]}"]
    good = write(tmp_path, "good", GOOD)
    result = subprocess.run(sidecar_command("check", "--config", str(good)),
                            capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


KEYED = GOOD + f"api_keys:\n  - {{name: bot, sha256: '{HEX_A}'}}\n"


@pytest.mark.parametrize(("text", "expected"), [
    (KEYED, ["8: warning: api_keys are listed but auth.required is false: any other caller is "
             "let in and names its own tenant with the x-tenant-id header; set auth.required: "
             "true in production"]),
    (KEYED + "auth: {required: true}\n", []),
    (GOOD + "auth: {required: false}\n", []),  # open mode with no keys: nothing to protect
    (GOOD + "auth:\n  required: true\n", [
        "9: warning: auth.required is true and no api_keys are listed: every request gets 401 "
        "invalid_api_key; list the keys (name and sha256) under api_keys"]),
])
def test_check_warns_when_keys_are_listed_but_not_required(tmp_path: pathlib.Path, text: str,
                                                           expected: list[str]) -> None:
    path = write(tmp_path, "keyed", text)
    assert [str(p) for p in check_config(str(path))] == [f"{path}:{line}" for line in expected]


def test_check_command_prints_warnings_on_stderr_and_exits_0(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "keyed", KEYED)
    result = subprocess.run(sidecar_command("check", "--config", str(path)),
                            capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stdout) == (0, "")
    assert result.stderr.splitlines() == [str(p) for p in check_config(str(path))]
    assert "warning: api_keys are listed but auth.required is false" in result.stderr
