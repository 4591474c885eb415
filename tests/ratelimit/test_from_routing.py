"""A routing YAML's limits compiled straight into the descriptor tree give the tree that the
``ratelimit.yaml`` written by ``llm-sidecar render`` loads into: same limits, same full keys,
same matches (and so the same Redis buckets, which are named from the domain and the request's
descriptor entries)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from ratelimit.from_descriptors import compile_domain
from ratelimit.from_routing import compile_rate_limits
from routing.compiled import listed_key_id
from routing.loader import validate
from routing.ratelimits import descriptors
from routing.schema import RoutingConfig
from routing.yamlsrc import Located
from tests.extproc.helpers import BASE

SHA = hashlib.sha256(b"sk-bot").hexdigest()
BOT = listed_key_id(SHA)


def routing(rate_limits: dict[str, Any] | None) -> RoutingConfig:
    doc: dict[str, Any] = {**BASE, "api_keys": [{"name": "bot", "sha256": SHA, "tenant": "legal"}]}
    if rate_limits is not None:
        doc["rate_limits"] = rate_limits
    return validate(Located("gateway.yaml", doc))


CONFIGS: dict[str, dict[str, Any] | None] = {
    "no rate_limits": None,
    "empty rate_limits": {},
    "every level and kind": {
        "api_key": {"default": {"requests": "10/s", "burst": 20, "tokens": "100k/min",
                                "concurrent": 8},
                    "overrides": {"bot": {"requests": "50/s"}}},
        "tenant": {"default": {"requests": "600/min", "tokens": "2M/min"},
                   "overrides": {"legal": {"requests": "1200/min", "shadow": True}}},
        "model": {"overrides": {"llama-2-13b": {"requests": "40/s", "tokens": "500k/min"}}},
        "on_backend_error": "deny"},
    "multi-unit windows": {"tenant": {"default": {"requests": "50/5m", "tokens": "1M/2h"}}},
    "an override that only shadows": {"api_key": {"default": {"requests": "1/s"},
                                                  "overrides": {"bot": {"shadow": True}}}},
    "a new requests rate drops the default burst": {
        "api_key": {"default": {"requests": "10/s", "burst": 99},
                    "overrides": {"bot": {"requests": "5/s"}}}},
    "overrides without a default": {"model": {"overrides": {"llama-2-13b": {"concurrent": 2}}}},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_same_tree_as_the_rendered_descriptor_file(name: str) -> None:
    config = routing(CONFIGS[name])
    rendered = compile_domain(Located("gateway.yaml", descriptors(config)))
    assert compile_rate_limits(config, "gateway.yaml") == rendered


MATCHES: list[tuple[tuple[tuple[str, str], ...], tuple[str, int, str, int, int | None, bool] | None]] = [
    # descriptor Envoy sends -> (full key, amount, unit, multiplier, burst, shadow)
    ((("kind", "requests"), ("api_key", BOT)),
     (f"llm-sidecar.kind_requests.api_key_{BOT}", 50, "second", 1, None, False)),
    ((("kind", "requests"), ("api_key", "anyone-else")),
     ("llm-sidecar.kind_requests.api_key", 10, "second", 1, 20, False)),
    ((("kind", "tokens"), ("api_key", BOT)),
     (f"llm-sidecar.kind_tokens.api_key_{BOT}", 100_000, "minute", 1, None, False)),
    ((("kind", "requests"), ("tenant", "legal")),
     ("llm-sidecar.kind_requests.tenant_legal", 1200, "minute", 1, None, True)),
    ((("kind", "concurrent"), ("api_key", "k")),
     ("llm-sidecar.kind_concurrent.api_key", 8, "second", 1, None, False)),
    ((("kind", "requests"), ("model", "bge-m3")), None),
    ((("kind", "requests"),), None),
]


@pytest.mark.parametrize(("entries", "expected"), MATCHES)
def test_what_each_descriptor_matches(
    entries: tuple[tuple[str, str], ...],
    expected: tuple[str, int, str, int, int | None, bool] | None,
) -> None:
    table = compile_rate_limits(routing(CONFIGS["every level and kind"]))
    assert table.on_backend_error == "deny"
    limit = table.match(entries)
    got = None if limit is None else (limit.full_key, limit.requests_per_unit, limit.unit,
                                      limit.unit_multiplier, limit.burst, limit.shadow_mode)
    assert got == expected
