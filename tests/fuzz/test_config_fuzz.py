"""The config loaders (routing YAML and ratelimit descriptor files) on random and hostile
text: every input is either loaded or refused with the loader's own ``ConfigError`` (which
``check`` prints as ``FILE:LINE: message``), quickly, never another exception or a hang."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ratelimit.errors import ConfigError as RateLimitConfigError
from ratelimit.loader import load_text
from routing.errors import ConfigError as RoutingConfigError
from routing.loader import load_config, validate
from routing.yamlsrc import load_yaml
from tests.extproc.helpers import BASE

FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
           | st.floats() | st.text(max_size=30)
           | st.sampled_from(["10/s", "5/min", "1M/h", "0/s", "-1/s", "1e9/d", "7d", "30s",
                              "127.0.0.1:1", "x:y", "vllm-short", "llama-2-13b", "allow", "deny"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=12) | st.sampled_from(
                          ["clusters", "models", "endpoints", "max_context", "rate_limits",
                           "api_key", "default", "overrides", "requests", "tokens", "burst",
                           "canary", "percent", "cache", "namespace", "services", "envoy"]),
                          inner, max_size=5), max_leaves=30)


def routing(text: str) -> None:
    try:
        validate(load_yaml(text, "fuzz.yaml"))
    except RoutingConfigError as err:
        assert all(str(problem).startswith("fuzz.yaml:") for problem in err.problems)


def descriptors(text: str) -> None:
    try:
        load_text(text, "fuzz.yaml")
    except RoutingConfigError:
        pass  # a routing YAML handed to the ratelimit loader is checked by the routing loader
    except RateLimitConfigError as err:
        assert str(err).startswith("fuzz.yaml:")


@FUZZ
@given(text=st.text(max_size=400))
def test_random_text(text: str) -> None:
    routing(text)
    descriptors(text)


@FUZZ
@given(doc=values)
def test_random_documents(doc: Any) -> None:
    text = yaml.safe_dump(doc)
    routing(text)
    descriptors(text)


@FUZZ
@given(section=st.sampled_from(["clusters", "models", "rate_limits", "services", "envoy",
                                "auth", "api_keys", "priority"]), value=values)
def test_a_valid_config_with_one_section_replaced(section: str, value: Any) -> None:
    routing(yaml.safe_dump({**BASE, section: value}))


def laughs(levels: int, fan: int = 9) -> str:
    lines = ['a0: &a0 ["lol"]']
    for n in range(1, levels):
        refs = ", ".join([f"*a{n - 1}"] * fan)
        lines.append(f"a{n}: &a{n} [{refs}]")
    return "\n".join(lines) + "\n"


HOSTILE = {
    "billion laughs (aliases expanding to 9^9 values)": laughs(10),
    "billion laughs inside a valid section": "version: 1\n" + laughs(10).replace(
        "a0:", "x-a0:"),
    "deep nesting": "a: " + "[" * 5000 + "]" * 5000 + "\n",
    "deep block nesting": "".join(f"{' ' * i}k{i}:\n" for i in range(3000)) + " " * 3000 + "v\n",
    "huge integer": "version: " + "9" * 5000 + "\n",
    "huge rate": "version: 1\nclusters: {c: {endpoints: ['1.2.3.4:1'], max_context: 1}}\n"
                 "models: {m: {clusters: [c]}}\nrate_limits: {model: {default: {requests: "
                 "'" + "9" * 400 + "/s'}}}\n",
    "NUL bytes": "version: 1\x00\x00\n",
    "long line": "version: " + "x" * 500_000 + "\n",
    "many keys": "".join(f"k{i}: {i}\n" for i in range(10_000)),
    "quoted brackets are not nesting": "version: 1\nx: '" + "[" * 200 + "'\n",
    "python tags": "!!python/object/apply:os.system ['echo pwned']\n",
    "merge keys": "base: &b {endpoints: ['1.2.3.4:1'], max_context: 1}\n"
                  "clusters: {c: {<<: *b}}\nversion: 1\nmodels: {m: {clusters: [c]}}\n",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_yaml(name: str, tmp_path: Path) -> None:
    text = HOSTILE[name]
    started = time.perf_counter()
    routing(text)
    descriptors(text)
    path = tmp_path / "routing.yaml"
    path.write_text(text)
    with pytest.raises(RoutingConfigError):
        load_config(str(path))
    took = time.perf_counter() - started
    print(f"\n[fuzz] config {name}: {took * 1000:.0f} ms")
    # A hang guard, not a speed target: linear work takes seconds even on a loaded machine; an
    # alias bomb or a quadratic path would take far longer than this.
    assert took < 120


def test_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_bytes(b"version: 1\n\xff\xfe\x00garbage")
    with pytest.raises(RoutingConfigError, match=r"routing\.yaml:1:"):
        load_config(str(path))
