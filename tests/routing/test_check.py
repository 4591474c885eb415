"""One fixture per mistake an operator can make, with the exact ``FILE:LINE: message``."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from routing.errors import ConfigError
from routing.loader import load_config

GOOD = """\
version: 1
clusters:
  vllm-short: {endpoints: ["10.0.0.11:8000"], max_context: 2048}
  vllm-long: {endpoints: ["vllm-long.llm.svc:8000"], max_context: 32768}
models:
  llama-2-13b:
    clusters: [vllm-short, vllm-long]
"""

CASES = {
    "unknown_top_level_key": (GOOD + "extra: 1\n",
                              ["8: unknown key 'extra' in top level (allowed: version, envoy, "
                               "services, clusters, models, auth, api_keys, rate_limits, priority)"]),
    "typo_key": (GOOD.replace("max_context: 2048", "max_contxt: 2048"),
                 ["3: missing required key clusters.vllm-short.max_context",
                  "3: unknown key 'max_contxt' in clusters.vllm-short (did you mean 'max_context'?)"]),
    "unknown_cluster": (GOOD.replace("[vllm-short, vllm-long]", "[vllm-short, vllm-lng]"),
                        ["7: model 'llama-2-13b' names unknown cluster 'vllm-lng' "
                         "(did you mean 'vllm-long'?)"]),
    "no_clusters": (GOOD.replace("[vllm-short, vllm-long]", "[]"),
                    ["7: models.llama-2-13b.clusters: List should have at least 1 item after "
                     "validation, not 0"]),
    "overlapping_pools": (GOOD.replace("max_context: 32768", "max_context: 2048"),
                          ["7: model 'llama-2-13b' has 2 clusters with max_context 2048: pools "
                           "overlap, give each pool of a model its own max_context"]),
    "bad_rate": (GOOD + "rate_limits:\n  tenant: {default: {requests: 10/fortnight}}\n",
                 ["9: rate_limits.tenant.default.requests: bad rate '10/fortnight': use N/s, "
                  "N/min, N/h, N/d or N/5m-style windows, with an optional k or M suffix, "
                  "like 100k/min"]),
    "bad_percent": (GOOD + "    canary: {model: v2, cluster: vllm-long, percent: 150}\n",
                    ["8: models.llama-2-13b.canary.percent: Input should be less than or equal "
                     "to 100"]),
    "duplicate_api_key": (GOOD + "api_keys:\n"
                          "  - {name: a, sha256: '" + "a" * 64 + "'}\n"
                          "  - {name: b, sha256: '" + "a" * 64 + "'}\n",
                          ["10: api key 'b' has the same sha256 as another key"]),
    "yaml_syntax": (GOOD + "  broken: [\n", ["9: YAML syntax: expected the node content, "
                                            "but found '<stream end>'"]),
    "duplicate_key": (GOOD + "models: {}\n", ["8: duplicate key 'models'"]),
    "bad_version": (GOOD.replace("version: 1", "version: 2"), ["1: version must be 1"]),
    "override_unknown_model": (GOOD + "rate_limits:\n  model: {overrides: {gpt: {requests: 1/s}}}\n",
                               ["9: rate_limits.model overrides unknown model 'gpt'"]),
    "burst_without_requests": (GOOD + "rate_limits:\n  tenant: {default: {tokens: 1k/min, "
                               "burst: 5}}\n",
                               ["9: burst is the capacity of the requests bucket: it needs a "
                                "requests rate"]),
    "bad_endpoint": (GOOD.replace('"10.0.0.11:8000"', '"10.0.0.11"'),
                     ["3: clusters.vllm-short.endpoints: bad address '10.0.0.11': use host:port, "
                      "like 10.0.0.11:8000"]),
    "cache_on_chat_model": (GOOD + "    cache: {namespace: x}\n",
                            ["8: cache is only for kind: embedding models ('llama-2-13b' is chat)"]),
    "not_a_mapping": ("- just\n- a list\n", ["1: the file must be a mapping with version: 1"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_mistake_is_reported_with_file_and_line(name: str, tmp_path: pathlib.Path) -> None:
    text, expected = CASES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(text))
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    assert [str(p) for p in caught.value.problems] == [f"{path}:{line}" for line in expected]


def test_the_good_file_loads(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "good.yaml"
    path.write_text(GOOD)
    config = load_config(str(path))
    assert list(config.models) == ["llama-2-13b"]
    assert config.rate_limits is None and config.api_keys == []
